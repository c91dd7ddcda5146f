"""``python -m rlhf.ppo ... --check`` (also ``rlhf.sft``, ``rlhf.dpo``, ``rlhf.rm``): what the run
would use, checked in seconds without Ray or any worker.

It composes and validates the config (the entry point did), runs the model-dir checks of
``rlhf.preflight``, loads the tokenizer and model config, reads and tokenizes every data row
(train and eval) as the run will, reports prompt lengths (p50/p99/max against the limit) and
the tokenizer's unknown-token share, calls each reward function on a few rows with a
placeholder response, and prints model, data, reward, algorithm and placement. A mistake is
raised as the run would raise it (one ``error:`` line, exit 2); nothing is written but a tiny
model's files in a temp dir when no ``model.path`` is given.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["length_line", "run_check"]

# Reward functions are called on this many rows, with this response.
_REWARD_ROWS = 3
PLACEHOLDER_RESPONSE = "#### 0"


def length_line(lengths: Sequence[int], limit: int, what: str) -> str:
    """``p50/p99/max`` of ``lengths`` against ``limit``."""
    s = sorted(lengths)
    p50, p99 = s[len(s) // 2], s[min(len(s) - 1, (len(s) * 99) // 100)]
    over = sum(x > limit for x in s)
    return f"{what} tokens: p50 {p50}, p99 {p99}, max {s[-1]} (limit {limit}; {over} over)"


def run_check(config_name: str, cfg: Any) -> None:
    """Print what the run of ``cfg`` would use; raises the run's own errors."""
    from transformers import AutoConfig, AutoTokenizer

    from rlhf.preflight import check_model_dirs
    from rlhf.trainer.setup import prepare_model_dir

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlhf-check-") as tmp:
        model_dir = prepare_model_dir(cfg.model, cfg.train.output_dir if cfg.model.path else tmp)
        check_model_dirs(cfg, model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        mc = AutoConfig.from_pretrained(model_dir)
        lines = [
            f"model: {cfg.model.path or f'tiny random-init {cfg.model.tiny.arch} (model.tiny)'} "
            f"({mc.model_type}, {mc.num_hidden_layers} layers, hidden {mc.hidden_size}, vocab {mc.vocab_size})"
            + (f", LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.enabled else ""),
            *(_ppo_lines(cfg, tok) if config_name == "ppo" else _pair_or_chat_lines(config_name, cfg, tok)),
            _placement_line(cfg),
            f"output: {cfg.train.output_dir}",
        ]
    print("\n".join(lines))
    print(
        f"check passed in {time.perf_counter() - t0:.1f} s: no mistake found in the config, data, model or reward"
    )


def _ppo_lines(cfg: Any, tok: Any) -> list[str]:
    from rlhf.agents.tool_env import env_factory
    from rlhf.data.prompts import load_prompts, unknown_token_fraction
    from rlhf.rewards import Reward

    d, factory = cfg.data, env_factory(cfg.env)
    tools = factory.tools if factory is not None else None
    common = dict(max_len=None, tools=tools)
    train, _ = load_prompts(
        d.prompts, tok, d.prompt_key, d.num_toy_prompts, d.seed, label_key=d.label_key, **common
    )
    lines = [
        f"data: {d.prompts}: {len(train)} prompts; columns the reward sees {sorted(train[0].info)}",
        "  "
        + length_line([len(p.token_ids) for p in train], d.max_prompt_len, "prompt")
        + f"; unknown-token share {unknown_token_fraction(train, tok.unk_token_id):.1%}",
    ]
    _check_overlong(train, d.max_prompt_len, d.overlong_prompts, "data.prompts")
    rows = train
    if cfg.eval.prompts:
        evals, _ = load_prompts(
            cfg.eval.prompts, tok, cfg.eval.prompt_key or d.prompt_key, label_key=cfg.eval.label_key or d.label_key,
            section="eval", label_as=cfg.label_key, **common,
        )  # fmt: skip
        _check_overlong(evals, d.max_prompt_len, d.overlong_prompts, "eval.prompts")
        every = (
            f"every {cfg.eval.every} steps" if cfg.eval.every > 0 else "before the first step and at the end"
        )
        lines.append(f"eval: {cfg.eval.prompts}: {len(evals)} prompts, {every}")
        rows = [*train[:_REWARD_ROWS], *evals[:_REWARD_ROWS]]
    if cfg.reward.type == "function" and cfg.reward.specs:
        reward = Reward.from_config(cfg.reward, cfg.label_key)
        sample = rows[:_REWARD_ROWS] + ([rows[-1]] if len(rows) > _REWARD_ROWS else [])
        scores = reward(
            [p.text for p in sample], [PLACEHOLDER_RESPONSE] * len(sample), [p.info for p in sample]
        )
        lines.append(
            f"reward: {', '.join(cfg.reward.specs)} (label column {cfg.label_key!r}): scores of {len(sample)} rows "
            f"with the response {PLACEHOLDER_RESPONSE!r}: {[round(x, 3) for x in scores.totals]}"
        )
    else:
        lines.append(
            f"reward: {'model ' + cfg.reward.model_path if cfg.reward.type == 'model' else 'env ' + cfg.env.name}"
        )
    a, r, t = cfg.algorithm, cfg.rollout, cfg.train
    lines.append(
        f"algorithm: {a.advantage} advantages, {a.policy_loss} loss, kl {a.kl_coef:g} ({a.kl_kind}); "
        f"{t.num_steps} steps of {t.rollout_batch_size} prompts x {r.n_samples_per_prompt} samples, "
        f"max_new_tokens {r.max_new_tokens}, {r.backend} engines x {r.num_engines}"
    )
    return lines


def _check_overlong(prompts: list, limit: int, overlong: str, field: str) -> None:
    from rlhf.data.chat import DataRowError

    over = [i for i, p in enumerate(prompts) if len(p.token_ids) > limit]
    if over and overlong == "error":
        raise DataRowError(
            f"{field}: {len(over)} prompts are longer than data.max_prompt_len={limit} tokens (the first is row "
            f"{over[0]}, {len(prompts[over[0]].token_ids)} tokens): raise data.max_prompt_len (and "
            "rollout.max_model_len) or set data.overlong_prompts=skip"
        )


def _pair_or_chat_lines(config_name: str, cfg: Any, tok: Any) -> list[str]:
    d = cfg.data
    if config_name == "sft":
        from rlhf.sft import load_data

        train, held_out = load_data(cfg, tok)
        lengths = [len(s) for s in train]
    else:
        from rlhf.data.chat import load_pairs

        train, held_out = load_pairs(d, tok)
        lengths = [len(s) for pair in train for s in pair]
    return [
        f"data: {d.path}: {len(train)} {'rows' if config_name == 'sft' else 'pairs'} to train on, "
        f"{len(held_out)} held out (data.eval_size)",
        "  " + length_line(lengths, d.max_len, "sample"),
        f"training: lr {cfg.train.lr:g}, batch {cfg.train.batch_size}, epochs {cfg.train.epochs}",
    ]


def _placement_line(cfg: Any) -> str:
    c = cfg.cluster
    where = f"Ray at {c.address}" if c.address else f"a local Ray of {c.num_cpus} CPUs"
    return f"placement: {where}, device {c.device}, actor ranks {c.actor_ranks}"
