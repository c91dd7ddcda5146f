"""GRPO end to end with ``rollout.backend=hf``: real Ray, real DeepSpeed CPU, Hugging Face
engines instead of vLLM (the whole loop runs without vLLM)."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf.config import compose
from rlhf.envvars import cpu_env

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")


def test_grpo_with_hf_engines_trains_syncs_and_agrees_with_the_trainer(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.prompts import PromptLoader, load_prompts
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.trainer.setup import build_workers, init_ray

    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            "algorithm=grpo",
            "algorithm.kl_coef=0.01",
            "rollout.backend=hf",
            "train.num_steps=2",
            "train.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "train.tensorboard=false",
            f"train.output_dir={tmp_path}",
            f"model.path={tiny_llama_dir}",
            "data.num_toy_prompts=32",
        ],
    )
    started = not ray.is_initialized()
    init_ray(cfg.cluster)
    workers = build_workers(cfg, str(tiny_llama_dir))
    try:
        assert [s["backend"] for s in workers.rollout.stats()] == ["hf"]
        # the CPU env reaches the workers: libgomp's idle spin is bounded there (rlhf.envvars)
        spin = ray.get(ray.remote(lambda: os.environ.get("GOMP_SPINCOUNT")).remote(), timeout=60)
        assert spin == cpu_env()["GOMP_SPINCOUNT"] == "20000"
        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        prompts, _ = load_prompts("toy:count", tok, num_toy=32, max_len=cfg.data.max_prompt_len)
        loader = PromptLoader(prompts, cfg.train.rollout_batch_size, seed=0)
        trainer = PPOTrainer(cfg, workers, tok, loader, load_reward_fn(cfg.reward.function))
        history = trainer.fit()
        assert [h["step"] for h in history] == [1, 2]
        for h in history:
            assert all(torch.isfinite(torch.tensor(h[k])) for k in ("policy/loss", "reward/mean", "kl"))
            # the engine's logprobs are the trainer's own on the same weights (fp32, same model)
            assert h["rollout/logprob_gap"] < 1e-4, h["rollout/logprob_gap"]
        assert [s["weight_version"] for s in workers.rollout.stats()] == [2]
        # a synchronous run: the engine generated on every core (the ranks wait for it)
        assert [s["compute_threads"] for s in workers.rollout.stats()] == [len(os.sched_getaffinity(0))]
        # after the last sync the engine serves the trained weights
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        model.load_state_dict(workers.actor.get_weights())
        ids = [p.token_ids for p in prompts[:3]]
        outs = workers.rollout.generate(ids, {"n": 1, "temperature": 0.0, "max_tokens": 6})
        for prompt, comps in zip(ids, outs, strict=True):
            ref = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id
            )[0, len(prompt) :].tolist()
            assert comps[0]["token_ids"] == ref
    finally:
        workers.shutdown()
        if started:
            ray.shutdown()
