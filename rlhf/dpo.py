"""Packed DPO entry point: (chosen, rejected) pairs against a frozen reference.

python -m rlhf.dpo                                   # tiny run on the local CPU (toy:count pairs)
python -m rlhf.dpo dpo.beta=0.2 data.path=prefs.jsonl model=hf model.path=runs/sft/final
"""

from __future__ import annotations

import logging

from rlhf.config import register_configs
from rlhf.config.trainers import DPOConfig

register_configs()
log = logging.getLogger("rlhf")


def run(cfg: DPOConfig) -> list[dict]:
    """Train from a validated ``DPOConfig``; the policy lands in ``<train.output_dir>/final``. Returns metrics."""
    from transformers import AutoTokenizer

    from rlhf.data.chat import load_pairs
    from rlhf.preflight import check_model_dirs
    from rlhf.trainer.dpo_trainer import DPOTrainer, fill_reference
    from rlhf.trainer.setup import init_ray, model_group, prepare_model_dir, prepare_nodes
    from rlhf.trainer.supervised import count_steps

    model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir)
    check_model_dirs(cfg, model_dir)  # before any worker: what the model dirs decide
    train, held_out = load_pairs(cfg.data, AutoTokenizer.from_pretrained(model_dir))
    init_ray(cfg.cluster)
    prepare_nodes(cfg.train.output_dir, [model_dir, cfg.dpo.ref_path], cfg.cluster.startup_timeout_s)
    budget = cfg.train.max_tokens_per_microbatch
    # The reference is only needed once: score everything, then give its resources to the policy.
    with model_group(cfg, "reference", cfg.dpo.ref_path or model_dir, cfg.cluster.ref_ranks) as reference:
        fill_reference(reference, [*train, *held_out], budget)
    steps = count_steps(len(train), cfg.train)
    with model_group(cfg, "actor", model_dir, cfg.cluster.actor_ranks, cfg.train.lr, steps) as policy:
        return DPOTrainer(cfg, policy, train, held_out).fit()


def main() -> None:
    from rlhf import cli

    cli.main("dpo", run)


if __name__ == "__main__":
    main()
