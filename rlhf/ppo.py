"""PPO / GRPO / REINFORCE++ / RLOO entry point.

python -m rlhf.ppo experiment=toy_count                  # tiny run on the local CPU
python -m rlhf.ppo experiment=toy_count algorithm=grpo rollout.num_engines=2
python -m rlhf.ppo data.prompts=train.parquet reward.function=reward.py:score   # yours
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from rlhf.config import register_configs
from rlhf.config.schema import PPOConfig

register_configs()
log = logging.getLogger("rlhf")


def run(cfg: PPOConfig) -> list[dict]:
    """Build everything from a validated ``PPOConfig`` and train; returns the metric history."""
    from transformers import AutoTokenizer

    from rlhf.agents.tool_env import env_factory as env_factory_from
    from rlhf.data.prompts import PromptLoader, load_prompts
    from rlhf.preflight import check_model_dirs
    from rlhf.rewards import Reward
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.trainer.setup import build_workers, init_ray, prepare_model_dir, prepare_nodes

    reward_fn = (
        Reward.from_config(cfg.reward, cfg.label_key)
        if cfg.reward.type == "function" and cfg.reward.specs
        else None
    )
    env_factory = env_factory_from(cfg.env)
    tools = env_factory.tools if env_factory is not None else None
    model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir)
    check_model_dirs(cfg, model_dir)  # before any worker: what the model dirs decide
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
        tools=tools,
    )
    if skipped:
        log.warning("skipped %d prompts longer than data.max_prompt_len=%d", skipped, cfg.data.max_prompt_len)
    eval_prompts = None
    if cfg.eval.prompts:
        eval_prompts, _ = load_prompts(
            cfg.eval.prompts,
            tok,
            cfg.eval.prompt_key or cfg.data.prompt_key,
            max_len=cfg.data.max_prompt_len,
            overlong=cfg.data.overlong_prompts,
            label_key=cfg.eval.label_key or cfg.data.label_key,
            section="eval",
            tools=tools,
            label_as=cfg.label_key,
        )
        eval_prompts = eval_prompts[: cfg.eval.max_prompts or None]
    init_ray(cfg.cluster)
    prepare_nodes(
        cfg.train.output_dir,
        [model_dir, cfg.model.critic_path, cfg.reward.model_path],
        cfg.cluster.startup_timeout_s,
    )

    def attempt(cfg: PPOConfig, recoveries: int) -> list[dict]:
        workers = build_workers(cfg, model_dir)
        try:
            loader = PromptLoader(prompts, cfg.train.rollout_batch_size, seed=cfg.data.seed)
            trainer = PPOTrainer(cfg, workers, tok, loader, reward_fn, env_factory, eval_prompts)
            trainer.run_metrics = {
                "data/skipped_overlong_prompts": float(skipped),
                "run/recoveries": float(recoveries),
            }
            return trainer.fit()
        finally:
            workers.shutdown()

    return with_recovery(attempt, cfg)


def with_recovery(attempt: Callable[[PPOConfig, int], list[dict]], cfg: PPOConfig) -> list[dict]:
    """``attempt(cfg, recoveries)``; when a worker process died, again from the last
    checkpoint, at most ``train.max_recoveries`` times."""
    from rlhf.storage import redact
    from rlhf.trainer.checkpoint import latest_checkpoint
    from rlhf.workers.errors import WorkerDied, is_process_death

    t, recoveries = cfg.train, 0
    while True:
        try:
            return attempt(cfg, recoveries)
        except Exception as e:
            if not is_process_death(e):
                raise
            ckpt = latest_checkpoint(t.output_dir)
            if recoveries == t.max_recoveries:
                raise WorkerDied(
                    f"a worker died and train.max_recoveries={t.max_recoveries} recoveries are used up: {e}\n"
                    f"The last checkpoint is {redact(ckpt) if ckpt else 'none (the run would start over)'}; run the same command "
                    "again to continue from it (train.resume=auto)"
                ) from e
            log.error(
                "a worker died: %s\nrecovery %d of %d (train.max_recoveries): rebuilding all workers and "
                "continuing from %s",
                e,
                recoveries + 1,
                t.max_recoveries,
                redact(ckpt) if ckpt else "step 0 (no checkpoint yet)",
            )
            # From now on this run's own checkpoints are the ones to continue from.
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, resume="auto"))
            recoveries += 1


def main() -> None:
    from rlhf import cli

    cli.main("ppo", run)


if __name__ == "__main__":
    main()
