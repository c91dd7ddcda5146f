"""What the benchmarks share: the model, tokenizer and toy prompts a run config names, and
the real workers (Ray, vLLM engines, DeepSpeed groups) placed per the config."""

from __future__ import annotations

NUM_TOY_PROMPTS = 512


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
