"""End-to-end RL on real Ray + vLLM CPU + DeepSpeed CPU with a tiny random-init model.

One set of workers (2 rollout engines, 2 actor ranks, critic, reference) is built for the
module and reused: engines take ~15 s each to start on CPU.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlhf.config import compose

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")


def _cfg(tmp_path, *overrides):
    return compose(
        "ppo",
        [
            "experiment=toy_count",
            "train.num_steps=2",
            "train.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=2",
            "cluster.actor_ranks=2",
            "train.tensorboard=false",
            f"train.output_dir={tmp_path}",
            "data.num_toy_prompts=32",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_dir):
    from transformers import AutoTokenizer

    from rlhf.data.prompts import load_prompts
    from rlhf.trainer.setup import build_workers, init_ray

    out = tmp_path_factory.mktemp("ppo")
    cfg = _cfg(out, f"model.path={tiny_llama_dir}")
    started = not ray.is_initialized()  # else: the session's Ray (tests/conftest.py), left running
    init_ray(cfg.cluster)
    workers = build_workers(cfg, str(tiny_llama_dir))
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts, _ = load_prompts("toy:count", tok, num_toy=32, max_len=cfg.data.max_prompt_len)
    yield {"cfg": cfg, "workers": workers, "tok": tok, "prompts": prompts, "model_dir": str(tiny_llama_dir)}
    workers.shutdown()
    # A shared Ray must get its CPUs back: Workers.shutdown frees the placement groups too.
    assert all(
        v["state"] == "REMOVED"
        for v in ray.util.placement_group_table().values()
        if v["name"].startswith("rlhf-")
    )
    if started:
        ray.shutdown()


def _trainer(world, tmp_path, **cfg_changes):
    from rlhf.data.prompts import PromptLoader
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer

    cfg = world["cfg"]
    for section, changes in cfg_changes.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path)))
    loader = PromptLoader(world["prompts"], cfg.train.rollout_batch_size, seed=0)
    return PPOTrainer(cfg, world["workers"], world["tok"], loader, load_reward_fn(cfg.reward.function))


def _engine_loads(world):
    """Weight loads per engine so far (a run numbers the weights it starts from, loading nothing)."""
    return [st["weight_updates"] for st in world["workers"].rollout.stats()]


def _engines_serve_actor_weights(world, num_prompts=3):
    """Greedy output of every engine == HF generate on the actor's current (gathered) weights."""
    from transformers import AutoModelForCausalLM

    weights = world["workers"].actor.get_weights()
    model = AutoModelForCausalLM.from_pretrained(world["model_dir"], dtype=torch.float32)
    model.load_state_dict(weights)
    prompts = [p.token_ids for p in world["prompts"][:num_prompts]]
    pool = world["workers"].rollout
    outs = pool.generate(prompts * pool.num_engines, {"n": 1, "temperature": 0.0, "max_tokens": 6})
    for prompt, comps in zip(prompts * pool.num_engines, outs, strict=True):
        ref = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=world["tok"].eos_token_id
        )[0, len(prompt) :].tolist()
        assert comps[0]["token_ids"] == ref
    return weights


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_experience_contract(world, tmp_path, temperature):
    # At T != 1 the actor's old logprobs must be taken at the sampling temperature too.
    tr = _trainer(world, tmp_path, rollout={"temperature": temperature})
    prompts = world["prompts"][:4]
    samples, stats = tr.maker.generate(prompts, step=0)
    assert len(samples) == 4 * 2 and stats.num_samples == 8
    samples = tr.maker.score(samples, stats)
    for s in samples:
        p = s.prompt_len
        # prompt tokens are never actions; every generated token is
        assert not s.action_mask[:p].any() and s.action_mask[p:].all()
        assert s.input_ids[:p].tolist() == prompts[s.group_id % 4].token_ids
        assert s.old_logprobs.shape == s.ref_logprobs.shape == s.values.shape == s.input_ids.shape
        # engine and DeepSpeed actor hold the same weights: their logprobs agree token by token
        torch.testing.assert_close(s.old_logprobs[p:], s.rollout_logprobs[p:], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(s.ref_logprobs, s.old_logprobs, atol=1e-5, rtol=1e-5)
        assert 0.0 <= s.score <= 1.0


@pytest.mark.parametrize("algorithm", ["gae", "grpo"])
def test_rl_steps_update_and_sync(world, tmp_path, algorithm):
    before = world["workers"].actor.get_weights()
    changes = {"algorithm": {}}
    if algorithm == "grpo":
        changes["algorithm"] = {"advantage": "grpo", "kl_in_reward": False, "kl_kind": "k3"}
    tr = _trainer(world, tmp_path, **changes)
    if algorithm == "grpo":
        assert tr.policy_objective.kl_coef_in_loss > 0
    history = tr.fit()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        for key in ("policy/loss", "reward/mean", "perf/tokens_per_s"):
            assert torch.isfinite(torch.tensor(h[key])), (key, h)
        if algorithm == "gae":
            assert torch.isfinite(torch.tensor(h["critic/loss"]))
    after = _engines_serve_actor_weights(world)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the actor did not change"
    # resume: a new trainer picks up at the saved step and the data position
    tr2 = _trainer(world, tmp_path, train={"num_steps": 3}, **changes)
    assert tr2.try_resume() and tr2.step == 2
    assert tr2.loader.state_dict() == tr.loader.state_dict()


def test_multi_turn_masks_observations(world, tmp_path):
    from rlhf.envs import load_env

    tr = _trainer(world, tmp_path, env={"name": "rlhf.envs.toy:EchoToolEnv", "max_turns": 2})
    tr.maker.env_factory = lambda: load_env("rlhf.envs.toy:EchoToolEnv")
    samples, stats = tr.maker.generate(world["prompts"][:2], step=0)
    samples = tr.maker.score(samples, stats)
    tool_id = world["tok"].convert_tokens_to_ids("<|tool|>")
    multi = [s for s in samples if (s.input_ids == tool_id).any()]
    assert multi, "no trajectory reached a second turn"
    for s in multi:
        t = int((s.input_ids == tool_id).nonzero()[0])
        assert not s.action_mask[t], "observation token marked as action"
        assert s.action_mask[:t].any() and s.action_mask[t:].any(), (
            "expected actions before and after the tool turn"
        )
        # logprobs on the second assistant turn line up with the actor's too
        m = s.action_mask
        torch.testing.assert_close(s.old_logprobs[m], s.rollout_logprobs[m], atol=2e-3, rtol=1e-3)


def test_reward_function_that_raises_loses_no_step(world, tmp_path):
    from rlhf.rewards import RewardFunctionError

    before, loads = world["workers"].actor.get_weights(), _engine_loads(world)
    tr = _trainer(world, tmp_path, reward={"function": "rlhf.rewards.toy:always_raises"})
    with pytest.raises(RewardFunctionError, match="sample 0"):
        tr.fit()
    assert tr.step == 0
    after = world["workers"].actor.get_weights()
    assert all(torch.equal(after[k], before[k]) for k in before), "a failed step must not update the actor"
    assert _engine_loads(world) == loads  # nor sync the engines


def test_non_finite_reward_error_or_drop(world, tmp_path):
    from rlhf.rewards import RewardFunctionError

    tr = _trainer(world, tmp_path, reward={"function": "rlhf.rewards.toy:nan_reward"})
    samples, stats = tr.maker.generate(world["prompts"][:4], step=0)
    with pytest.raises(RewardFunctionError, match="reward.non_finite=drop"):
        tr.maker.score(copy.deepcopy(samples), stats)
    tr.maker.cfg = dataclasses.replace(tr.cfg, reward=dataclasses.replace(tr.cfg.reward, non_finite="drop"))
    kept = tr.maker.score(copy.deepcopy(samples), stats)
    assert stats.dropped_non_finite == len(samples) - len(kept) == 4  # prompts 1 and 3, 2 samples each
    assert all(s.score == 1.0 for s in kept)

    # Only the very first sample is NaN: a per-token estimator drops it alone, a group estimator
    # drops its whole group (a group of one has no baseline).
    calls = []

    def first_is_nan(prompt, response, info):
        calls.append(1)
        return float("nan") if len(calls) == 1 else 1.0

    from rlhf.rewards import Reward, RewardComponent

    for advantage, dropped in (("gae", 1), ("grpo", 2)):
        calls.clear()
        tr.maker.reward = Reward([RewardComponent("first_is_nan", first_is_nan)])
        tr.maker.cfg = dataclasses.replace(
            tr.maker.cfg, algorithm=dataclasses.replace(tr.cfg.algorithm, advantage=advantage)
        )
        batch = copy.deepcopy(samples)
        kept = tr.maker.score(batch, stats)
        assert stats.dropped_non_finite == dropped and len(kept) == len(samples) - dropped, advantage
        ids = {id(k) for k in kept}
        assert id(batch[0]) not in ids and (id(batch[1]) in ids) == (advantage == "gae")

    # reward.on_error=drop: the first sample's call raises; it leaves with its group (grpo),
    # counted in reward/errors, while non_finite stays "error" for genuine NaN scores
    def first_raises(prompt, response, info):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("unparsable")
        return 1.0

    calls.clear()
    tr.maker.cfg = dataclasses.replace(
        tr.maker.cfg, reward=dataclasses.replace(tr.cfg.reward, non_finite="error", on_error="drop")
    )
    tr.maker.reward = Reward([RewardComponent("first_raises", first_raises)], on_error="drop")
    from rlhf.trainer.experience import RolloutStats

    drop_stats = RolloutStats()
    kept = tr.maker.score(copy.deepcopy(samples), drop_stats)
    assert drop_stats.reward_errors == 1 and len(kept) == len(samples) - 2


def test_empty_response_trains_without_nan(world, tmp_path):
    from rlhf.data.types import Sample
    from rlhf.trainer.advantage_step import advantage_step

    tr = _trainer(world, tmp_path)
    samples, stats = tr.maker.generate(world["prompts"][:2], step=0)
    p = world["prompts"][0].token_ids
    empty = Sample(
        input_ids=torch.tensor(p),
        action_mask=torch.zeros(len(p), dtype=torch.bool),
        rollout_logprobs=torch.zeros(len(p)),
        group_id=samples[0].group_id,
        prompt=world["prompts"][0].text,
        prompt_len=len(p),
    )
    samples = tr.maker.score([*samples, empty], stats)
    advantage_step(samples, tr.cfg.algorithm)
    stats = tr.train(samples)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()), stats


def test_killed_engine_is_restarted_without_losing_the_step(world, tmp_path):
    pool = world["workers"].rollout
    tr = _trainer(world, tmp_path, train={"num_steps": 1})
    ray.kill(pool.engines[1])
    history = tr.fit()
    assert len(history) == 1 and tr.step == 1
    assert pool.restarts[1] >= 1
    _engines_serve_actor_weights(world)


def test_an_engine_killed_under_the_agent_loop_is_restarted_once_for_all_its_turns(world, tmp_path):
    """Four trajectories' turns are in flight on the killed engine: each comes back failed, and
    the first restarts the engine; the others go to the replacement instead of counting as a
    second death of it (which would fail the step, rollout.max_restarts=1)."""
    from rlhf.envs import load_env

    pool = world["workers"].rollout
    tr = _trainer(
        world, tmp_path, env={"name": "rlhf.envs.toy:EchoToolEnv", "max_turns": 2}, train={"num_steps": 1}
    )
    tr.maker.env_factory = lambda: load_env("rlhf.envs.toy:EchoToolEnv")
    before = list(pool.restarts)
    ray.kill(pool.engines[1])
    history = tr.fit()
    assert len(history) == 1 and history[0]["agent/turns_mean"] == 2.0
    assert pool.restarts == [before[0], before[1] + 1]
    _engines_serve_actor_weights(world)


def test_overlong_prompt_is_a_clear_error(world):
    from rlhf.data.prompts import load_prompts

    with pytest.raises(ValueError, match="data.max_prompt_len"):
        load_prompts("toy:count", world["tok"], num_toy=4, max_len=3)
    too_long = list(range(5, 5 + world["cfg"].rollout.max_model_len))
    with pytest.raises(ValueError, match="max_model_len"):
        world["workers"].rollout.generate([too_long], {"n": 1, "max_tokens": 4, "temperature": 1.0})


# -- asynchronous (one-step-off) training ------------------------------------------------------


def _snapshot(world, path):
    for name in ("actor", "critic"):
        getattr(world["workers"], name).save_checkpoint(str(path / name), tag="start")


def _restore(world, path):
    for name in ("actor", "critic"):
        getattr(world["workers"], name).load_checkpoint(str(path / name), tag="start")
    world["workers"].rollout.update_weights(world["workers"].actor.get_weights_ref())


def _numbers(history):
    # Timings differ from run to run; every other metric must not.
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "perf/"))} for h in history]


def test_staleness_zero_on_the_producer_thread_reproduces_the_synchronous_run(world, tmp_path):
    _snapshot(world, tmp_path / "start")
    sync = _trainer(world, tmp_path / "sync")
    sync.threaded_rollouts = False
    reference = _numbers(sync.fit())
    _restore(world, tmp_path / "start")
    threaded = _trainer(world, tmp_path / "threaded")
    threaded.threaded_rollouts = True  # max_staleness=0 through the async machinery
    assert _numbers(threaded.fit()) == reference
    assert all(h["rollout/staleness_mean"] == 0 for h in reference)


def test_one_step_off_with_gae_trains_on_stale_samples_and_syncs(world, tmp_path):
    before = world["workers"].actor.get_weights()
    tr = _trainer(world, tmp_path, train={"num_steps": 3, "max_staleness": 1})
    history = tr.fit()
    # batch 1 comes from the initial weights; every later one from the weights one step older
    assert [h["rollout/staleness_mean"] for h in history] == [0.0, 1.0, 1.0]
    # The engine/trainer gap still checks the sync: taken before the behaviour log-probs replace
    # the trainer's (after, it was 0 by construction); stale batches add one update's change.
    gaps = [h["rollout/logprob_gap"] for h in history]
    assert gaps[0] < 1e-4 and all(0 < g < 0.5 for g in gaps[1:]), gaps
    for h in history:
        for key in (
            "policy/loss",
            "critic/loss",
            "reward/mean",
            "time/engine_wait_s",
            "time/trainer_wait_s",
            "time/sync_wait_s",
        ):
            assert torch.isfinite(torch.tensor(h[key])), (key, h)
    after = _engines_serve_actor_weights(world)
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_one_step_off_resume_is_exact_with_the_batch_generated_ahead(world, tmp_path):
    _snapshot(world, tmp_path / "start")
    out = tmp_path / "run"
    straight = _trainer(world, out, train={"num_steps": 3, "max_staleness": 1, "save_every": 2})
    uninterrupted = _numbers(straight.fit())
    # The step-2 checkpoint holds the batch of step 3, generated ahead by the step-2 weights.
    assert (out / "checkpoints/step_2/pending_rollouts.pt").is_file()
    pending = out / "checkpoints/step_2/pending_rollouts.pt"
    kept = pending.read_bytes()

    def resume():
        (out / "checkpoints/latest").write_text("step_2")  # as if the run had stopped after step 2
        return _trainer(world, out, train={"num_steps": 3, "max_staleness": 1, "resume": True}).fit()

    # The check can fail: without the saved batch, step 3 trains on a fresh one and differs.
    pending.unlink()
    assert _numbers(resume())[2:] != uninterrupted[2:]
    pending.write_bytes(kept)
    history = resume()
    assert [h["step"] for h in history] == [1, 2, 3]  # rows 1-2 kept from metrics.jsonl
    assert _numbers(history) == uninterrupted


def test_one_step_off_with_a_multi_turn_environment(world, tmp_path):
    from rlhf.envs import load_env

    tr = _trainer(
        world, tmp_path, env={"name": "rlhf.envs.toy:EchoToolEnv", "max_turns": 2}, train={"max_staleness": 1}
    )
    tr.maker.env_factory = lambda: load_env("rlhf.envs.toy:EchoToolEnv")
    history = tr.fit()
    assert [h["rollout/staleness_mean"] for h in history] == [0.0, 1.0]
    assert all(h["rollout/observation_tokens_mean"] > 0 for h in history)
    assert all(torch.isfinite(torch.tensor(h["policy/loss"])) for h in history)


# -- labelled prompts, verifiers, held-out evaluation ---------------------------------------------


def test_labelled_parquet_prompts_reach_the_reward_and_eval_reports_accuracy(world, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf.rewards import Reward, RewardComponent
    from rlhf.rewards.verifiers import format_reward
    from rlhf.trainer.ppo_trainer import PPOTrainer

    rows = [{"prompt": f"count {i} {i + 1}", "answer": str(i + 2), "meta": {"i": i}} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    seen = []

    def label_reward(prompt, response, info):
        # the row's own columns arrive untouched: the label matches the prompt it belongs to
        assert info["answer"] == str(info["meta"]["i"] + 2) and f"count {info['meta']['i']} " in prompt
        seen.append(info["answer"])
        return float(response.split()[:1] == [info["answer"]])

    from rlhf.data.prompts import PromptLoader, load_prompts

    prompts, _ = load_prompts(str(tmp_path / "train.parquet"), world["tok"], label_key="answer")
    cfg = world["cfg"]
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, output_dir=str(tmp_path), num_steps=2),
        eval=dataclasses.replace(cfg.eval, prompts="set", every=1, n_samples=3, success_threshold=0.9),
    )
    reward = Reward(
        [RewardComponent("label_reward", label_reward, 0.9), RewardComponent("format", format_reward, 0.1)]
    )
    loader = PromptLoader(prompts[:8], cfg.train.rollout_batch_size, seed=0)
    history = PPOTrainer(cfg, world["workers"], world["tok"], loader, reward, eval_prompts=prompts[8:]).fit()
    assert [h["step"] for h in history] == [0, 1, 2]  # evaluated before the first step, then every step
    for h in history:
        assert 0.0 <= h["eval/accuracy"] <= 1.0 and 0.0 <= h["eval/pass@1"] <= h["eval/pass@3"] <= 1.0
        assert h["eval/response_length"] > 0 and h["eval/time_s"] > 0
    for h in history[1:]:
        assert {"reward/label_reward", "reward/format"} <= h.keys()
        assert h["reward/mean"] == pytest.approx(
            0.9 * h["reward/label_reward"] + 0.1 * h["reward/format"], abs=1e-6
        )
    assert seen and set(seen) <= {r["answer"] for r in rows}


# -- sequence parallelism ----------------------------------------------------------------------


def test_a_sequence_parallel_actor_reproduces_the_grpo_run_metric_by_metric(world, tmp_path):
    """The actor's 2 ranks as one sequence-parallel group (k=2) instead of 2 data-parallel ranks:
    the same GRPO run, metric by metric (fp32 rounding apart)."""
    from rlhf.trainer.setup import deepspeed_settings
    from rlhf.workers.group import ModelGroup
    from rlhf.workers.placement import Placement

    cfg, workers = world["cfg"], world["workers"]
    grpo = {"advantage": "grpo", "kl_coef": 0.01, "kl_kind": "k3", "kl_in_reward": False}
    grpo.update(loss_aggregation="seq_mean_token_mean", normalize_advantages=False)
    _snapshot(world, tmp_path / "start")
    data_parallel = _numbers(_trainer(world, tmp_path / "k1", train={"num_steps": 3}, algorithm=grpo).fit())
    _restore(world, tmp_path / "start")
    sp_actor = ModelGroup(
        "actor",
        world["model_dir"],
        cfg.cluster.actor_ranks,
        deepspeed_settings(cfg.train, cfg.train.actor_lr),
        attn_impl=cfg.model.attn_impl,
        seed=cfg.train.seed,
        sequence_parallel_size=2,
        # The world holds every CPU of the test's Ray; the two actors never compute at once.
        placement=Placement(num_cpus=0),
    )
    dp_actor = workers.actor
    try:
        sp_actor.load_checkpoint(str(tmp_path / "start" / "actor"), tag="start")
        workers.actor = sp_actor
        split = _numbers(_trainer(world, tmp_path / "k2", train={"num_steps": 3}, algorithm=grpo).fit())
    finally:
        workers.actor = dp_actor
        sp_actor.shutdown()
        _restore(world, tmp_path / "start")
    assert [i["attn_impl"] for i in sp_actor.infos] == ["ulysses_packed_sdpa"] * 2
    assert len(split) == len(data_parallel) == 3
    # Rows of an odd length are padded to split evenly: counted, and the one metric that differs.
    assert all(h["packing/pad_fraction"] == 0 for h in data_parallel)
    assert any(h["packing/pad_fraction"] > 0 for h in split)
    for a, b in zip(split, data_parallel, strict=True):
        assert set(a) == set(b)
        for key in set(a) - {"packing/pad_fraction"}:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    # Not vacuous: the policy trained, on responses that differ from step to step.
    assert all(abs(h["policy/loss"]) > 0 for h in split)
    assert len({h["reward/mean"] for h in split}) > 1 or len({h["response/length_mean"] for h in split}) > 1
