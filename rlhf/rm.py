"""Reward-model entry point: pairwise (Bradley-Terry) training on (chosen, rejected) pairs.

    python -m rlhf.rm                                    # tiny run on the local CPU (toy:count pairs)
    python -m rlhf.ppo experiment=toy_count reward.type=model reward.model_path=runs/rm_toy_count/final   # use it in PPO

The result, ``<train.output_dir>/final``, is an ``AutoModelForSequenceClassification``
(``num_labels=1``) directory with the tokenizer.
"""

from __future__ import annotations

from rlhf.config import register_configs
from rlhf.config.trainers import RMConfig

register_configs()


def run(cfg: RMConfig) -> list[dict]:
    """Train from a validated ``RMConfig``; returns the metric history."""
    from transformers import AutoTokenizer

    from rlhf.data.chat import load_pairs
    from rlhf.preflight import check_model_dirs
    from rlhf.trainer.rm_trainer import RMTrainer
    from rlhf.trainer.setup import init_ray, model_group, prepare_model_dir, prepare_nodes
    from rlhf.trainer.supervised import count_steps

    model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir)
    check_model_dirs(cfg, model_dir)  # before any worker: what the model dirs decide
    train, held_out = load_pairs(cfg.data, AutoTokenizer.from_pretrained(model_dir))
    init_ray(cfg.cluster)
    prepare_nodes(cfg.train.output_dir, [model_dir], cfg.cluster.startup_timeout_s)
    steps = count_steps(len(train), cfg.train)
    # A reward group with lr > 0 trains (train.lr > 0 is validated); from the causal-LM dir it
    # starts with a fresh score head (see rlhf.trainer.rm_trainer).
    with model_group(cfg, "reward", model_dir, cfg.cluster.reward_ranks, cfg.train.lr, steps) as group:
        return RMTrainer(cfg, group, train, held_out).fit()


def main() -> None:
    from rlhf import cli

    cli.main("rm", run)


if __name__ == "__main__":
    main()
