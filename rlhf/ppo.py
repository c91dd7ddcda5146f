"""PPO / GRPO / REINFORCE++ / RLOO entry point.

python -m rlhf.ppo                                   # tiny run on the local CPU
python -m rlhf.ppo algorithm=grpo rollout.num_engines=2
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from rlhf.config import register_configs, to_object
from rlhf.config.schema import PPOConfig

register_configs()
log = logging.getLogger("rlhf")


def run(cfg: PPOConfig) -> list[dict]:
    """Build everything from a validated ``PPOConfig`` and train; returns the metric history."""
    from transformers import AutoTokenizer

    from rlhf.data.prompts import PromptLoader, load_prompts
    from rlhf.envs import load_env
    from rlhf.rewards import Reward
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.trainer.setup import build_workers, init_ray, prepare_model_dir

    reward_fn = Reward.from_config(cfg.reward) if cfg.reward.type == "function" else None
    env_factory = None
    if cfg.env.name:
        load_env(cfg.env.name)  # fail now, not mid-rollout, on a bad env.name
        env_factory = lambda: load_env(cfg.env.name)  # noqa: E731
    model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, skipped = load_prompts(
        cfg.data.prompts,
        tok,
        cfg.data.prompt_key,
        cfg.data.num_toy_prompts,
        cfg.data.seed,
        cfg.data.max_prompt_len,
        cfg.data.overlong_prompts,
        cfg.data.label_key,
    )
    if skipped:
        log.warning("skipped %d prompts longer than data.max_prompt_len=%d", skipped, cfg.data.max_prompt_len)
    eval_prompts = None
    if cfg.eval.prompts:
        eval_prompts, _ = load_prompts(
            cfg.eval.prompts,
            tok,
            cfg.data.prompt_key,
            max_len=cfg.data.max_prompt_len,
            overlong=cfg.data.overlong_prompts,
            label_key=cfg.data.label_key,
        )
        eval_prompts = eval_prompts[: cfg.eval.max_prompts or None]
    init_ray(cfg.cluster)
    workers = build_workers(cfg, model_dir)
    try:
        loader = PromptLoader(prompts, cfg.train.rollout_batch_size, seed=cfg.data.seed)
        return PPOTrainer(cfg, workers, tok, loader, reward_fn, env_factory, eval_prompts).fit()
    finally:
        workers.shutdown()


@hydra.main(config_path="../conf", config_name="ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    run(to_object(cfg))


if __name__ == "__main__":
    main()
