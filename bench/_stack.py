"""What the benchmarks share: the model, tokenizer and toy prompts a run config names, and
the real workers (Ray, vLLM engines, DeepSpeed groups) placed per the config."""

from __future__ import annotations

NUM_TOY_PROMPTS = 512


def grpo_lr0_overrides(args, out: str) -> list[str]:
    """Overrides shared by the benchmarks that compare modes of the same GRPO run: one engine and
    one training rank (no reference), learning rate 0 (the full train step runs, the weights
    stay, so every mode samples the same responses and does the same work), the tiny model at
    ``args.hidden`` x ``args.layers``, ``args.prompts`` x ``args.samples_per_prompt`` a step, 2 CPUs."""
    return [
        "experiment=toy_count",
        "algorithm=grpo",
        "algorithm.kl_coef=0",
        "train.actor_lr=0",
        f"train.rollout_batch_size={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples_per_prompt}",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.num_layers={args.layers}",
        f"model.tiny.intermediate_size={2 * args.hidden}",
        "model.tiny.num_heads=4",
        "model.tiny.num_kv_heads=2",
        "cluster.num_cpus=2",
        "train.tensorboard=false",
        f"train.output_dir={out}",
        f"data.num_toy_prompts={NUM_TOY_PROMPTS}",
    ]


def model_and_prompts(cfg, tmp: str):
    """``(model_dir, tokenizer, prompts)``: ``cfg.model`` (the tiny model is built under ``tmp``)
    and the bundled count task tokenized with ``cfg.data.max_prompt_len``."""
    from transformers import AutoTokenizer

    from rlhf.data.prompts import load_prompts
    from rlhf.trainer.setup import prepare_model_dir

    model_dir = prepare_model_dir(cfg.model, tmp)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, _ = load_prompts("toy:count", tok, num_toy=NUM_TOY_PROMPTS, max_len=cfg.data.max_prompt_len)
    return model_dir, tok, prompts


def start_workers(cfg, model_dir: str):
    """Ray (local, per ``cfg.cluster``) and the run's ``Workers``; the caller shuts them down."""
    from rlhf.trainer.setup import build_workers, init_ray

    init_ray(cfg.cluster)
    return build_workers(cfg, model_dir)
