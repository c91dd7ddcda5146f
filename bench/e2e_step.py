"""End-to-end GRPO step time of the real stack, per phase, with the machine's CPU use;
optionally side by side with TRL's GRPOTrainer on the same model and the same work.

Run: ``.venv/bin/python bench/e2e_step.py`` (small and large, each with the vLLM and the hf
rollout backend, several minutes on 2 cores), or ``--sizes small --steps 6 --backends hf``.
``--trl`` also runs TRL's GRPOTrainer (HF generate, what a CPU TRL user gets) with the same
prompts, reward, model, batch and KL; TRL is not a dependency:
``pip install --no-deps --target /tmp/trlpkgs trl==1.16.0 accelerate==1.16.0`` and run with
``PYTHONPATH=/tmp/trlpkgs``.

Work per step: 16 prompts x 4 samples of the toy count task, GRPO with a KL loss term
(beta 0.01, so both compute reference logprobs), one optimizer step per batch, fp32. Per
step it prints each phase's time and the machine's CPU use during it (100% = every core
busy), then medians over the steps after the first (warm-up): ``orchestration`` is the rest
of the step, ``ideal`` the step if every phase kept all cores busy (CPU-seconds / cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _stack import NUM_TOY_PROMPTS, CpuSampler, model_and_prompts, start_workers  # noqa: E402 - bench/ is the script dir

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, new tokens
    "small": (128, 2, 2, 1, 256, 16),
    "large": (512, 8, 8, 2, 1024, 128),  # 18M parameters
}
PHASES = ("generate", "reward", "score", "advantage", "train", "sync")
PROMPTS, SAMPLES = 16, 4


def _config(size: str, steps: int, out: str, overrides: tuple[str, ...] = ()):
    from rlhf.config import compose

    hidden, layers, heads, kv, inter, new = SIZES[size]
    return compose(
        "ppo",
        [
            "experiment=toy_count",
            "algorithm=grpo",
            "algorithm.kl_coef=0.01",
            f"train.num_steps={steps}",
            f"train.rollout_batch_size={PROMPTS}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_new_tokens={new}",
            f"rollout.max_model_len={new + 64}",
            "data.max_prompt_len=32",
            "train.max_tokens_per_microbatch=4096",
            f"model.tiny.hidden_size={hidden}",
            f"model.tiny.num_layers={layers}",
            f"model.tiny.num_heads={heads}",
            f"model.tiny.num_kv_heads={kv}",
            f"model.tiny.intermediate_size={inter}",
            "train.tensorboard=false",
            "train.save_every_min=0",
            f"train.output_dir={out}",
            f"data.num_toy_prompts={NUM_TOY_PROMPTS}",
            *overrides,
        ],
    )


def run_rlhf(size: str, steps: int, tmp: str, overrides: tuple[str, ...] = ()) -> list[dict]:
    """Per step: phase seconds and CPU use, from the real trainer."""
    from rlhf.data.prompts import PromptLoader
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.trainer.timing import PhaseTimer

    cfg = _config(size, steps, tmp, overrides)
    model_dir, tok, prompts = model_and_prompts(cfg, tmp)
    workers = start_workers(cfg, model_dir)
    try:
        loader = PromptLoader(prompts, cfg.train.rollout_batch_size, seed=0)
        trainer = PPOTrainer(cfg, workers, tok, loader, load_reward_fn(cfg.reward.function))
        trainer.timer = PhaseTimer(keep_spans=True)
        with CpuSampler() as cpu:
            history = trainer.fit()
    finally:
        workers.shutdown()
    rows = []
    spans = trainer.timer.spans
    steps_spans = [s for s in spans if s[0] == "step"]
    for h, (_, s0, s1) in zip(history, steps_spans, strict=True):
        row = {
            "step_s": h["time/step_s"],
            "cpu_step": cpu.mean(s0, s1),
            "reward_mean": h["reward/mean"],
            "tokens": h["response/length_mean"],
        }
        cpu_s = 0.0
        for p in PHASES:
            inside = [(a, b) for name, a, b in spans if name == p and s0 - 1e-6 <= a and b <= s1 + 1e-6]
            dur = sum(b - a for a, b in inside)
            row[p] = dur
            row[f"cpu_{p}"] = (
                statistics.fmean([cpu.mean(a, b) for a, b in inside]) if inside else float("nan")
            )
            if inside:
                cpu_s += dur * row[f"cpu_{p}"] / 100
        row["orchestration"] = h["time/orchestration_s"]  # the trainer's: the step minus its phases and waits
        row["ideal"] = cpu_s + row["orchestration"] * cpu.mean(s0, s1) / 100
        rows.append(row)
    return rows


def run_trl(size: str, steps: int, tmp: str) -> list[tuple[float, float]]:
    """Per optimizer step of TRL's GRPOTrainer on the same work: (seconds, mean response tokens)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.rewards.toy import count_reward

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = _config(size, steps, tmp)
    model_dir, tok, prompts = model_and_prompts(cfg, tmp)
    data = Dataset.from_list([{"prompt": p.text} for p in prompts])

    def reward(prompts, completions, **kw):
        return [count_reward(p, c, {}) for p, c in zip(prompts, completions, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.lengths: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    clock = Clock()
    args = GRPOConfig(
        output_dir=str(Path(tmp) / "trl"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=cfg.rollout.max_new_tokens,
        beta=cfg.algorithm.kl_coef,
        num_iterations=1,
        loss_type="grpo",
        learning_rate=cfg.train.actor_lr,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model, reward, args, train_dataset=data, processing_class=tok, callbacks=[clock])
    trainer.train()
    return list(zip(clock.times, clock.lengths, strict=True))


def _fmt(x: float) -> str:
    return f"{x:7.3f}" if x < 10 else f"{x:7.2f}"


def report(size: str, backend: str, rows: list[dict], trl: list[tuple[float, float]] | None) -> float:
    """Print the per-step table; returns the median s/step after the first step."""
    h = SIZES[size]
    print(f"\n== {size}: hidden {h[0]} x {h[1]} layers, {h[5]} new tokens, rollout.backend={backend} ==")
    cols = (*PHASES, "orchestration", "step_s", "ideal", "tokens")
    print(
        "step " + " ".join(f"{c[:9]:>9}" for c in cols) + "   CPU% per phase (" + ",".join(PHASES) + ",step)"
    )
    for i, r in enumerate(rows, 1):
        cpu = ",".join(f"{r[f'cpu_{p}']:.0f}" for p in PHASES) + f",{r['cpu_step']:.0f}"
        print(f"{i:4d} " + " ".join(f"{_fmt(r[c]):>9}" for c in cols) + f"   {cpu}")
    measured = rows[1:] or rows
    med = {c: statistics.median(r[c] for r in measured) for c in cols}
    print("med  " + " ".join(f"{_fmt(med[c]):>9}" for c in cols))
    # Response lengths differ from step to step and between stacks: compare per generated token too.
    per_tok = sum(r["step_s"] for r in measured) / sum(r["tokens"] * PROMPTS * SAMPLES for r in measured)
    print(
        f"orchestration {med['orchestration'] / med['step_s']:.1%} of the step; step / ideal "
        f"{med['step_s'] / med['ideal']:.2f}; {per_tok * 1e3:.2f} ms per response token; "
        f"reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}"
    )
    if trl:
        t_measured = trl[1:] or trl
        t = statistics.median(s for s, _ in t_measured)
        t_tok = sum(s for s, _ in t_measured) / sum(n * PROMPTS * SAMPLES for _, n in t_measured)
        print(
            f"TRL GRPOTrainer: {t:.3f} s/step (median after step 1), {t_tok * 1e3:.2f} ms per response token, "
            f"mean response {statistics.fmean(n for _, n in t_measured):.1f} tokens\n"
            f"rlhf / TRL: {med['step_s'] / t:.2f} per step, {per_tok / t_tok:.2f} per response token"
        )
    return med["step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,large")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--backends", default="vllm,hf", help="rollout.backend values to run, one after the other")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (see the docstring)")
    p.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for rlhf's run, e.g. rollout.num_engines=2"
    )
    args = p.parse_args()
    backends = args.backends.split(",")
    for size in args.sizes.split(","):
        runs = {}
        for backend in backends:
            with tempfile.TemporaryDirectory() as tmp:
                runs[backend] = run_rlhf(
                    size, args.steps, tmp, (f"rollout.backend={backend}", *args.overrides)
                )
        trl = None
        if args.trl:
            with tempfile.TemporaryDirectory() as tmp:
                trl = run_trl(size, args.steps, tmp)
        step_s = {b: report(size, b, rows, trl) for b, rows in runs.items()}
        if len(step_s) > 1:
            first, *rest = backends
            print(", ".join(f"{b} / {first}: {step_s[b] / step_s[first]:.2f} s/step" for b in rest))


if __name__ == "__main__":
    main()
