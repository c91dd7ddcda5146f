"""The DAPO and GSPO presets (and rollout correction) on real Ray + vLLM CPU + DeepSpeed CPU.

One engine and one actor rank are built for the module (the presets use no KL term, so no
reference group) and reused by every test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from rlhf.config import compose

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")


def _cfg(tmp_path, model_dir, *overrides):
    return compose(
        "ppo",
        [
            "experiment=toy_count",
            f"model.path={model_dir}",
            "train.num_steps=2",
            "train.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=1",
            "train.tensorboard=false",
            f"train.output_dir={tmp_path}",
            "data.num_toy_prompts=64",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_dir):
    from transformers import AutoTokenizer

    from rlhf.data.prompts import load_prompts
    from rlhf.trainer.setup import build_workers, init_ray

    out = tmp_path_factory.mktemp("algos")
    cfg = _cfg(out, tiny_llama_dir, "algorithm=dapo")
    assert cfg.algorithm.kl_coef == 0 and not cfg.algorithm.uses_critic
    started = not ray.is_initialized()
    init_ray(cfg.cluster)
    workers = build_workers(cfg, str(tiny_llama_dir))
    assert workers.reference is None and workers.critic is None
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts, _ = load_prompts("toy:count", tok, num_toy=64, max_len=cfg.data.max_prompt_len)
    yield {"workers": workers, "tok": tok, "prompts": prompts, "model_dir": str(tiny_llama_dir)}
    workers.shutdown()
    if started:
        ray.shutdown()


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(f"def reward(prompt, response, info):\n    return {body}\n")
    return f"{path}:reward"


def _fit(world, cfg):
    from rlhf.data.prompts import PromptLoader
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer

    loader = PromptLoader(world["prompts"], cfg.train.rollout_batch_size, seed=0)
    trainer = PPOTrainer(cfg, world["workers"], world["tok"], loader, load_reward_fn(cfg.reward.function))
    return trainer.fit()


def _weights(world):
    return {k: v.clone() for k, v in world["workers"].actor.get_weights().items()}


def _changed(before, after) -> bool:
    return any(not (before[k] == after[k]).all() for k in before)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_dapo_preset_fills_the_batch_with_informative_groups(world, tmp_path, max_staleness):
    # A binary reward leaves many groups of 2 with equal scores: dynamic sampling must top up,
    # also when the rounds of a step are generated ahead of the trainer.
    reward = _reward_file(tmp_path, "float(len(response.split()) % 2)")
    cfg = _cfg(
        tmp_path,
        world["model_dir"],
        "algorithm=dapo",
        f"reward.function={reward}",
        f"train.max_staleness={max_staleness}",
    )
    before = _weights(world)
    history = _fit(world, cfg)
    assert [h["step"] for h in history] == [1, 2]
    assert [h["rollout/staleness_mean"] for h in history] == [0.0, float(max_staleness)]
    for h in history:
        assert h["dynamic_sampling/groups_kept"] + h["dynamic_sampling/shortfall"] == 4
        assert h["dynamic_sampling/groups_generated"] == 4 * h["dynamic_sampling/rounds"]
        assert h["dynamic_sampling/groups_kept"] >= 1
        # only informative groups are trained on: every kept group holds a 0 and a 1
        assert h["reward/mean"] == pytest.approx(0.5, abs=1e-6) or h["reward/overlong_penalty_mean"] < 0
        assert h["reward/overlong_penalty_mean"] <= 0
        assert math.isfinite(h["policy/loss"])
    assert _changed(before, _weights(world))
    # The tiny model is too narrow for a second thread to pay off (RolloutEngine.threads_min_hidden):
    # it keeps the one CPU Ray gave the engine even in a synchronous run.
    assert [s["compute_threads"] for s in world["workers"].rollout.stats()] == [1]


def test_dapo_never_aborts_when_no_group_is_informative(world, tmp_path):
    reward = _reward_file(tmp_path, "1.0")
    cfg = _cfg(
        tmp_path,
        world["model_dir"],
        "algorithm=dapo",
        "algorithm.dynamic_sampling_max_rounds=2",
        "algorithm.overlong_buffer_frac=0",
        f"reward.function={reward}",
    )
    before = _weights(world)
    history = _fit(world, cfg)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["dynamic_sampling/skipped_update"] == 1.0
        assert (h["dynamic_sampling/rounds"], h["dynamic_sampling/shortfall"]) == (2, 4)
    assert not _changed(before, _weights(world))


def test_gspo_preset_with_rollout_correction(world, tmp_path):
    cfg = _cfg(
        tmp_path,
        world["model_dir"],
        "algorithm=gspo",
        "algorithm.rollout_correction=tis",
        "algorithm.rollout_correction_level=geometric",
    )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, actor_lr=1e-2))
    before = _weights(world)
    history = _fit(world, cfg)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        # fp32 CPU engine and trainer agree (~1e-7): nothing to truncate, tiny mismatch KL
        assert h["rollout_corr/truncated_fraction"] == 0.0
        assert abs(h["rollout_corr/kl_k3"]) < 1e-4
        assert h["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert 0.0 <= h["policy/clip_fraction"] <= 1.0 and math.isfinite(h["policy/loss"])
    assert _changed(before, _weights(world))
