"""The agent demo: RL teaches a tiny model to use a calculator tool.

    python -m rlhf.agent_demo                          # ~5 min on 2 CPU cores
    python -m rlhf.agent_demo --rl-steps 80 --output-dir runs/agent_demo2

Task: ``"what is 473 * 281 ?"`` -> ``132913``. A random-init tiny model cannot multiply two
3-digit numbers; it can learn to ask the ``calculator`` tool (``rlhf.agents.tools``) with a
Hermes/Qwen ``<tool_call>{"name": "calculator", "arguments": {"expression": "473 * 281"}}</tool_call>``,
read the ``<tool_response>`` and state the result. The job

1. builds the model: a byte-level BPE tokenizer (digits are single tokens, as in Qwen's) with
   the ChatML tool template (``rlhf.agents.templates.CHATML_TOOLS``, ``<|im_end|>`` ends a
   turn) and a random-init tiny Qwen2;
2. writes its data as ordinary files (``<out>/data/sft.jsonl``: tool-call transcripts with a
   ``tools`` column; ``train.parquet``, ``eval.parquet``: prompts and answers, the held-out
   pairs never trained on);
3. runs a short SFT warm start on the transcripts (the format and a little of the copying);
4. runs GRPO with the tool in the loop (``conf/experiment/calc_tool.yaml``: ``env.tools=[calculator]``,
   per-trajectory agent loop, exact-match verifier on the final answer), with held-out greedy
   accuracy (and the tool-call counts of that pass) before the first step and every 10 steps;
5. ends with a plot (``<out>/progress.png``) and a summary.

Measured (2-core CI-like machine, 2026-12-05, defaults): held-out greedy accuracy 67% after the
SFT warm start -> 85% after 40 GRPO steps (100 held-out products), tool-call success 99% ->
100%, 300 s wall (model + SFT 122 s). Short of +30 points or 90%; what stops it, from greedy
answers per product length on the same held-out set:

- 14 of the 15 wrong answers after RL are the 5-digit products (14 of the 100, all wrong;
  6-digit 85/86 right): the model copies the tool's result at the distance it learned on
  6-digit results (``67626`` -> ``66762``). RL moves that one copy distance towards the length
  most of its prompts have, instead of learning both. From a longer warm start (300 SFT steps,
  ``train.lr_schedule=cosine``: 91%, 5-digit 10/14, 6-digit 81/86), 40 GRPO steps end at
  (5-digit, 6-digit right): ``actor_lr`` 3e-4: 85% (0/14, 85/86); 1e-4: 86% (0/14, 86/86);
  1e-4 on prompts 50/50 by length: 73% (14/14, 59/86); 1e-4, ``kl_coef`` 0.05, 30/70 prompts:
  81% (14/14, 67/86); 5e-5, ``kl_coef`` 0.1: 89% (10/14, 79/86), held by the KL term but no
  gain. A warm start balanced 50/50 by length (140 steps) gives 69% and GRPO does not raise it
  (68%).
- ``--min-factor 317`` (6-digit products only) leaves RL nothing to do: the warm start alone
  reaches 100% (140 SFT steps) or 99% (90; 97% after GRPO) but 3% at 80, and GRPO from 3% gets
  no reward in 40 steps: the copy is learned abruptly between 80 and 90 SFT steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

log = logging.getLogger("rlhf")

SYSTEM = "Use the calculator for arithmetic."


def calc_rows(seed: int, n_train: int, n_eval: int, low: int = 100) -> tuple[list[dict], list[dict]]:
    """``{"prompt", "answer"}`` rows: products of two 3-digit numbers from ``low`` to 999; no pair
    in both splits. From 100 about 17% of the products have 5 digits, the rest 6; from 317
    (317 * 317 = 100489) all have 6 (see the module docstring for what that changes)."""
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < n_train + n_eval:
        pairs.add((rng.randint(low, 999), rng.randint(low, 999)))
    rows = [
        {"prompt": f"what is {a} * {b} ?", "answer": str(a * b), "expression": f"{a} * {b}"} for a, b in pairs
    ]
    rng.shuffle(rows)
    return rows[:n_train], rows[n_train:]


def tool_call(expression: str) -> str:
    return json.dumps({"name": "calculator", "arguments": {"expression": expression}})


def transcript(row: dict) -> list[dict]:
    """The conversation the policy should produce: call, read the result, answer."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": f"<tool_call>{tool_call(row['expression'])}</tool_call>"},
        {"role": "tool", "name": "calculator", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]},
    ]


def calculator_schemas() -> list[dict]:
    from rlhf.agents.tools import get_tool

    return [get_tool("calculator").schema()]


def build_model(out: Path, rows: list[dict], hidden: int, layers: int) -> Path:
    """A tokenizer trained on rendered transcripts (ChatML tool template) and a tiny Qwen2."""
    from rlhf.agents.templates import CHATML_SPECIAL, CHATML_TOOL_TOKENS, CHATML_TOOLS
    from rlhf.models.tiny import build_task_model

    tools = calculator_schemas()
    return build_task_model(
        out,
        lambda draft: [
            draft.apply_chat_template(transcript(r), tools=tools, tokenize=False) for r in rows[:200]
        ],
        hidden,
        layers,
        chat_template=CHATML_TOOLS,
        extra_special_tokens=CHATML_SPECIAL,
        added_tokens=CHATML_TOOL_TOKENS,
        eos_token="<|im_end|>",
    )


def _prompt_rows(rows: list[dict]) -> list[dict]:
    """RL prompt rows: the system and user turns of the transcript, and the answer to verify."""
    return [{"prompt": transcript(r)[:2], "answer": r["answer"]} for r in rows]


def write_data(out: Path, train: list[dict], held_out: list[dict]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    files = {"sft": out / "sft.jsonl", "train": out / "train.parquet", "eval": out / "eval.parquet"}
    tools = calculator_schemas()
    files["sft"].write_text(
        "".join(json.dumps({"messages": transcript(r), "tools": tools}) + "\n" for r in train)
    )
    pq.write_table(pa.Table.from_pylist(_prompt_rows(train)), files["train"])
    pq.write_table(pa.Table.from_pylist(_prompt_rows(held_out)), files["eval"])
    return files


def plot(history: list[dict], path: Path) -> None:
    """Training reward per step, held-out accuracy and tool-call success per evaluation."""
    from rlhf.demo import plot as plot_progress

    def success(h: dict) -> float | None:
        return tool_success(h, "eval/agent") if "eval/agent/tool_calls" in h else None

    plot_progress(
        history, path, "calculator tool: RL after SFT warm start", ("held-out tool-call success", success)
    )


def tool_success(metrics: dict, prefix: str) -> float:
    """Share of tool calls (well-formed or not) that returned a result."""
    calls = metrics[f"{prefix}/tool_calls"] + metrics[f"{prefix}/malformed_calls"]
    bad = (
        metrics[f"{prefix}/tool_errors"]
        + metrics[f"{prefix}/tool_timeouts"]
        + metrics[f"{prefix}/malformed_calls"]
    )
    return (calls - bad) / calls if calls else 0.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/agent_demo")
    p.add_argument("--sft-steps", type=int, default=140, help="optimizer steps of the SFT warm start")
    p.add_argument("--rl-steps", type=int, default=40, help="GRPO steps")
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--eval-rows", type=int, default=100)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--min-factor", type=int, default=100, help="smallest factor (317: 6-digit products only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides of the GRPO phase")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Build, SFT, GRPO with the tool; returns the summary numbers."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    from rlhf.demo import sft_then_grpo

    t0 = time.perf_counter()
    out = Path(args.output_dir)
    if not 100 <= args.min_factor <= 999:
        raise ValueError(f"--min-factor must be a 3-digit number (100..999), got {args.min_factor}")
    train, held_out = calc_rows(args.seed, args.train_rows, args.eval_rows, args.min_factor)
    model = build_model(out, train, args.hidden, args.layers)
    files = write_data(out / "data", train, held_out)
    history, t_sft = sft_then_grpo(
        out,
        [f"model.path={model}", "train.lr=0.001", "data.max_len=256", "train.max_tokens_per_microbatch=4096"],
        ["experiment=calc_tool", *args.overrides],
        files,
        args,
    )
    return _report(history, out, args, t0, t_sft)


def _report(
    history: list[dict], out: Path, args: argparse.Namespace, t0: float, t_sft: float
) -> dict[str, float]:
    evals = [h for h in history if "eval/accuracy" in h]
    png = out / "progress.png"
    plot(history, png)
    wall = time.perf_counter() - t0
    summary = {
        "accuracy_before": evals[0]["eval/accuracy"],
        "accuracy_after": evals[-1]["eval/accuracy"],
        "tool_success_before": tool_success(evals[0], "eval/agent"),
        "tool_success_after": tool_success(evals[-1], "eval/agent"),
        "sft_s": t_sft - t0,
        "wall_s": wall,
        "eval_prompts": args.eval_rows,
    }
    print(
        f"\nheld-out greedy accuracy {summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%} "
        f"over {args.rl_steps} GRPO steps, on {args.eval_rows} held-out products never trained on\n"
        f"tool-call success {summary['tool_success_before']:.1%} -> {summary['tool_success_after']:.1%}\n"
        f"wall time {wall:.0f} s (model + SFT {summary['sft_s']:.0f} s)\n"
        f"model: {out / 'grpo' / 'final'}\nmetrics: {out / 'grpo' / 'metrics.jsonl'}\nplot: {png}",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    from rlhf.envvars import quiet_driver

    quiet_driver()  # before anything imports transformers or DeepSpeed
    from rlhf.trainer.run_control import exit_on_preemption

    exit_on_preemption(main, None)
