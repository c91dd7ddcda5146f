"""A 32k-token response through the whole pipeline, its rows split over 2 sequence-parallel ranks.

Real Ray + vLLM CPU engine + DeepSpeed CPU, a tiny random-init Llama with 40k positions. An
environment answers the first turn of one trajectory per batch with a 32,768-token observation,
so that sample's response (policy turn + observation + policy turn) is over 32k tokens:
generation (the engine prefills it as the next turn's prompt), packing (a row of its own),
scoring (the actor's log-probs of the last turn, computed over the whole split row, equal the
engine's), training with k = 2 and a checkpoint.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from rlhf.config import compose
from rlhf.envs.base import StepResult

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")
LONG = 32768


class LongObservationEnv:
    """One trajectory of every two gets a ``LONG``-token observation after its first turn."""

    _count = itertools.count()

    def reset(self, prompt: str, info: dict) -> None:
        self.turn, self.long = 0, next(LongObservationEnv._count) % 2 == 0

    def step(self, response: str) -> StepResult:
        self.turn += 1
        if self.turn > 1:
            return StepResult(done=True)
        words = LONG // 2 if self.long else 2
        # The tiny tokenizer reads "1" and "2" as one token each.
        return StepResult(observation=" " + " ".join(["1", "2"] * words), done=False)


def test_a_32k_response_generates_packs_scores_trains_and_checkpoints(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    from rlhf.data.prompts import PromptLoader, load_prompts
    from rlhf.models.tiny import build_tiny_model
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.trainer.setup import build_workers, init_ray

    model_dir = build_tiny_model(tmp_path / "model", arch="llama", max_position_embeddings=40000)
    length = LONG + 1024
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            f"model.path={model_dir}",
            "algorithm=reinforce_pp",
            "algorithm.kl_coef=0",  # the actor alone
            "model.sequence_parallel_size=2",
            "cluster.actor_ranks=2",
            "rollout.num_engines=1",
            "rollout.n_samples_per_prompt=1",
            "train.rollout_batch_size=2",
            "train.num_steps=1",
            "train.save_every=1",
            "rollout.max_new_tokens=8",
            f"rollout.max_model_len={length}",
            f"train.max_tokens_per_microbatch={length}",
            f"env.name={__name__}:LongObservationEnv",
            "env.max_turns=2",
            f"env.max_observation_tokens={LONG + 8}",
            "train.tensorboard=false",
            f"train.output_dir={tmp_path / 'run'}",
            "data.num_toy_prompts=8",
        ],
    )
    started = not ray.is_initialized()
    init_ray(cfg.cluster)
    workers = build_workers(cfg, str(model_dir))
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts, _ = load_prompts("toy:count", tok, num_toy=8, max_len=cfg.data.max_prompt_len)
        reward = load_reward_fn(cfg.reward.function)
        tr = PPOTrainer(
            cfg, workers, tok, PromptLoader(prompts, 2, seed=0), reward, env_factory=LongObservationEnv
        )
        samples, stats = tr.maker.generate(prompts[:2], step=0)
        samples = tr.maker.score(samples, stats)
        (long,) = [s for s in samples if len(s) > LONG]
        assert int((~long.action_mask[long.response_start :]).sum()) >= LONG  # the observation
        last_turn = long.action_mask.clone()
        last_turn[: long.response_start + LONG] = False
        assert last_turn.any(), "no policy turn after the long observation"
        # The actor's log-probs over the split 32k row are the engine's, after the observation too.
        (actor_lp,) = workers.actor.forward([long], length)
        torch.testing.assert_close(
            actor_lp[last_turn], long.rollout_logprobs[last_turn], atol=2e-3, rtol=1e-3
        )
        before = workers.actor.get_weights()
        history = tr.fit()
        after = workers.actor.get_weights()
    finally:
        workers.shutdown()
        if started:
            ray.shutdown()
    assert [h["step"] for h in history] == [1]
    h = history[0]
    assert h["rollout/observation_tokens_mean"] >= LONG / 2
    # Both samples share one row of the budget; an odd row length gets one pad to split in two.
    assert h["packing/micro_batches"] == 1 and 0 <= h["packing/pad_fraction"] < 1e-4
    assert all(torch.isfinite(torch.tensor(v)) for k, v in h.items() if isinstance(v, float))
    assert any(not torch.equal(after[k], before[k]) for k in before), "the actor did not train"
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_1"
    state = json.loads((ckpt / "step_1" / "trainer_state.json").read_text())
    assert state["step"] == 1
