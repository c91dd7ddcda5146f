"""Packed supervised fine-tuning entry point (loss on the assistant turns only).

python -m rlhf.sft data.path=chats.jsonl model=hf model.path=/models/M train.epochs=3
python -m rlhf.sft experiment=toy_chat               # tiny run on the local CPU (toy:count chats)
"""

from __future__ import annotations

import logging

from rlhf.config import register_configs
from rlhf.config.trainers import SFTConfig

register_configs()
log = logging.getLogger("rlhf")


def load_data(cfg, tokenizer):
    """``(train, eval)`` samples from ``data.path``; a malformed row raises ``DataRowError`` naming it."""
    from rlhf.data.chat import ChatColumns, load_sft, split_eval

    d = cfg.data
    samples, skipped = load_sft(
        d.path, tokenizer, d.max_len, d.overlong, d.num_toy, d.seed, ChatColumns.of(d)
    )
    if skipped:
        log.warning("skipped %d rows longer than data.max_len=%d", skipped, d.max_len)
    return split_eval(samples, d.eval_size, d.seed)


def run(cfg: SFTConfig) -> list[dict]:
    """Train from a validated ``SFTConfig``; the model lands in ``<train.output_dir>/final``. Returns metrics."""
    from transformers import AutoTokenizer

    from rlhf.preflight import check_model_dirs
    from rlhf.trainer.setup import init_ray, model_group, prepare_model_dir, prepare_nodes
    from rlhf.trainer.sft_trainer import SFTTrainer
    from rlhf.trainer.supervised import count_steps

    model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir)
    check_model_dirs(cfg, model_dir)  # before any worker: what the model dirs decide
    train, held_out = load_data(cfg, AutoTokenizer.from_pretrained(model_dir))
    init_ray(cfg.cluster)
    prepare_nodes(cfg.train.output_dir, [model_dir], cfg.cluster.startup_timeout_s)
    steps = count_steps(len(train), cfg.train)
    with model_group(cfg, "actor", model_dir, cfg.cluster.actor_ranks, cfg.train.lr, steps) as group:
        return SFTTrainer(cfg, group, train, held_out).fit()


def main() -> None:
    from rlhf import cli

    cli.main("sft", run)


if __name__ == "__main__":
    main()
