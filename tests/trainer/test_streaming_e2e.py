"""Streaming RL (``train.mode=streaming``) on real Ray + vLLM CPU engines (in-flight weight
updates on) + DeepSpeed CPU with a tiny random-init model.

One set of workers (2 engines, one actor rank, GRPO without a reference) serves the module; the
batch mode runs on the same engines for the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf.config import compose

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")
B, N = 4, 2


def _cfg(tmp_path, *overrides):
    return compose(
        "ppo",
        [
            "experiment=toy_count",
            "algorithm=grpo",
            "algorithm.kl_coef=0",  # no reference group
            "train.mode=streaming",
            "train.num_steps=3",
            f"train.rollout_batch_size={B}",
            f"rollout.n_samples_per_prompt={N}",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=2",
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

    out = tmp_path_factory.mktemp("streaming")
    cfg = _cfg(out, f"model.path={tiny_llama_dir}")
    started = not ray.is_initialized()
    init_ray(cfg.cluster)
    workers = build_workers(cfg, str(tiny_llama_dir))
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts, _ = load_prompts("toy:count", tok, num_toy=32, max_len=cfg.data.max_prompt_len)
    yield {"cfg": cfg, "workers": workers, "tok": tok, "prompts": prompts, "out": out}
    workers.shutdown()
    if started:
        ray.shutdown()


def _trainer(world, tmp_path, env: dict | None = None, rollout: dict | None = None, **train):
    from rlhf.data.prompts import PromptLoader
    from rlhf.envs import load_env
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer

    cfg = world["cfg"]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path), **train))
    if env:
        cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, **env))
    if rollout:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout))
    loader = PromptLoader(world["prompts"], cfg.train.rollout_batch_size, seed=0)
    tr = PPOTrainer(cfg, world["workers"], world["tok"], loader, load_reward_fn(cfg.reward.function))
    if env:
        tr.maker.env_factory = lambda: load_env(env["name"])
    return tr


def _restore_start(world, path, save: bool) -> None:
    actor = world["workers"].actor
    if save:
        actor.save_checkpoint(str(path), tag="start")
        return
    actor.load_checkpoint(str(path), tag="start")
    world["workers"].rollout.update_weights(actor.get_weights_ref())


STREAM_ONLY = (
    "time/",
    "perf/",
    "async/dropped_stale",
    "async/groups_",
    "async/engine_busy_fraction",
)


def _numbers(history, keys=None):
    return [
        {k: v for k, v in h.items() if not k.startswith(STREAM_ONLY) and (keys is None or k in keys)}
        for h in history
    ]


def test_staleness_zero_reproduces_the_batch_run_metric_by_metric(world, tmp_path):
    _restore_start(world, tmp_path / "start", save=True)
    batch = _numbers(_trainer(world, tmp_path / "batch", mode="batch").fit())
    _restore_start(world, tmp_path / "start", save=False)
    streamed = _trainer(world, tmp_path / "stream").fit()
    for got, want in zip(_numbers(streamed, batch[0].keys()), batch, strict=True):
        assert got == want, {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert all(h["async/dropped_stale"] == 0 and h["async/staleness_max"] == 0 for h in streamed)


def test_one_version_ahead_every_token_within_the_bound_and_counted(world, tmp_path):
    pool = world["workers"].rollout
    tr = _trainer(world, tmp_path, num_steps=4, max_staleness=1)
    history = tr.fit()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        assert h["rollout/num_samples"] == B * N
        assert 0 <= h["async/staleness_mean"] <= h["async/staleness_max"] <= 1
        assert 0 <= h["async/stale_token_fraction"] <= 1
        assert 0 <= h["async/engine_busy_fraction"] <= 1.05
        for key in ("policy/loss", "reward/mean", "time/trainer_wait_s", "async/groups_in_flight"):
            assert torch.isfinite(torch.tensor(h[key])), (key, h)
    assert history[0]["async/staleness_max"] == 0  # step 1 can only hold version-0 tokens
    assert any(h["async/staleness_mean"] > 0 for h in history[1:])  # later steps ran ahead
    assert sum(s["weight_version"] == 4 for s in pool.stats()) == pool.num_engines


def test_without_recomputing_every_sample_is_trained_against_its_engine_logprobs(world, tmp_path):
    """train.recompute_old_logprobs=false: no scoring forward of the actor, and the PPO ratio's
    denominator is the engines' log-probs of every sample, fresh ones included."""
    tr = _trainer(world, tmp_path, num_steps=3, max_staleness=1, recompute_old_logprobs=False)
    actor, scored, trained = tr.maker.actor, [], []
    forward_async, train = actor.forward_async, tr.train

    def counting_forward(*a, **k):
        scored.append(1)
        return forward_async(*a, **k)

    def keeping_train(samples):
        trained.append([(s.action_mask.clone(), s.old_logprobs.clone(), s.rollout_logprobs) for s in samples])
        return train(samples)

    actor.forward_async, tr.train = counting_forward, keeping_train
    try:
        history = tr.fit()
    finally:
        del actor.forward_async  # the instance attribute; the class's method is back
    assert [h["step"] for h in history] == [1, 2, 3] and not scored
    assert [len(step) for step in trained] == [B * N] * 3
    for step in trained:
        for mask, old, rollout in step:
            assert torch.equal(old[mask], rollout[mask])
    # Step 1 trains on version-0 samples with version-0 weights: the ratio is the engine/trainer
    # agreement of fp32 on CPU, 1 to within 1e-4.
    assert abs(history[0]["policy/ratio_mean"] - 1) < 1e-4


def test_partial_rollouts_continue_what_an_update_interrupts(world, tmp_path):
    pool = world["workers"].rollout
    before = sum(s["continued"] for s in pool.stats())
    partial = {"inflight_updates": False, "partial_rollouts": True, "max_new_tokens": 32}
    history = _trainer(world, tmp_path, rollout=partial, num_steps=4, max_staleness=1).fit()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        assert h["rollout/num_samples"] == B * N
        assert 0 <= h["async/staleness_mean"] <= h["async/staleness_max"] <= 1
    # groups generating for the next step were in flight at the updates and went on after them
    assert sum(s["continued"] for s in pool.stats()) > before
    assert any(h["async/stale_token_fraction"] > 0 for h in history[1:])


def test_the_agent_loop_streams_its_groups(world, tmp_path):
    tr = _trainer(
        world,
        tmp_path,
        env={"name": "rlhf.envs.toy:EchoToolEnv", "max_turns": 2},
        num_steps=2,
        max_staleness=1,
    )
    history = tr.fit()
    assert [h["agent/turns_mean"] for h in history] == [2.0, 2.0]
    assert all(h["rollout/observation_tokens_mean"] > 0 for h in history)
    assert all(h["rollout/num_samples"] == B * N for h in history)


def test_an_engine_killed_mid_stream_is_restarted_and_its_groups_sent_again(world, tmp_path):
    pool = world["workers"].rollout
    before = list(pool.restarts)
    tr = _trainer(world, tmp_path, num_steps=2, max_staleness=1)
    ray.kill(pool.engines[1])
    history = tr.fit()
    assert [h["step"] for h in history] == [1, 2]
    assert pool.restarts == [before[0], before[1] + 1]  # one restart, however many groups were on it
    assert all(h["rollout/num_samples"] == B * N for h in history)


def test_a_checkpoint_of_the_wrong_mode_is_a_clear_error(world, tmp_path):
    tr = _trainer(world, tmp_path / "run", num_steps=1, save_every=1)
    tr.fit()
    assert (tmp_path / "run/checkpoints/step_1/pending_rollouts.pt").is_file()  # the stream's state
    (tmp_path / "run/checkpoints/latest").write_text("step_1")
    again = _trainer(world, tmp_path / "run", num_steps=2, mode="batch", resume="true")
    with pytest.raises(
        RuntimeError, match="rollouts of train.mode=streaming; resume it with train.mode=streaming"
    ):
        again.fit()
