"""Synchronous vs one-step-off training: samples per second at equal samples and equal model.

Run: ``.venv/bin/python bench/async.py`` (a few minutes on 2 CPU cores; ``--help`` for sizes).

The real stack (Ray, one vLLM CPU engine, one DeepSpeed CPU training rank, each on its own
core) runs GRPO steps twice from the same weights, with ``train.max_staleness=0`` (generate
-> train -> sync in turn) and ``=1`` (the engine generates batch s+1 while the rank trains on
batch s). The learning rate is 0 so that both modes sample the same responses (seeded) and
do the same work: learning changes response lengths, and with them the cost of a step.
Per mode it prints samples/s over the measured steps and the mean time of the two
phases measured in the synchronous run; the ideal speed-up of overlapping two phases is
``(generate + train) / max(generate, train)``.

Measured (2-core CI-like machine, 2026-12, hidden 256 x 4 layers, 8 prompts x 4 samples):
up to 96 new tokens (defaults; generate 0.69 s, score+train+sync 0.94 s a step): 19.7 ->
30.3 samples/s, 1.54x (ideal 1.73x); up to 48 new tokens: 30.5 -> 50.3 samples/s, 1.65x
(ideal 1.57x). Equal mean response length in both modes (75.8 and 42.7 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _stack import grpo_lr0_overrides, model_and_prompts, start_workers  # noqa: E402 - bench/ is the script dir


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="measured steps per mode (after 1 warm-up step)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    return p.parse_args()


def _config(args: argparse.Namespace, out: str):
    from rlhf.config import compose

    return compose(
        "ppo",
        [
            *grpo_lr0_overrides(args, out),
            f"train.num_steps={args.steps + 1}",
            f"rollout.max_new_tokens={args.new_tokens}",
            "rollout.max_model_len=128",
            "train.max_tokens_per_microbatch=1024",
        ],
    )


def _run(cfg, workers, tok, prompts, start: Path, max_staleness: int) -> tuple[float, list[dict]]:
    import dataclasses

    from rlhf.data.prompts import PromptLoader
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer

    workers.actor.load_checkpoint(str(start), tag="start")
    workers.rollout.update_weights(workers.actor.get_weights_ref())
    out = Path(cfg.train.output_dir) / f"staleness_{max_staleness}"
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, max_staleness=max_staleness, output_dir=str(out))
    )
    trainer = PPOTrainer(
        cfg,
        workers,
        tok,
        PromptLoader(prompts, cfg.train.rollout_batch_size, seed=0),
        load_reward_fn(cfg.reward.function),
    )
    trainer.save = lambda: None  # checkpoint writes are not what is measured
    t0 = time.perf_counter()
    history = trainer.fit()
    return time.perf_counter() - t0, history


def main() -> None:
    args = _parse()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, tmp)
        model_dir, tok, prompts = model_and_prompts(cfg, tmp)
        workers = start_workers(cfg, model_dir)
        try:
            start = Path(tmp) / "start"
            workers.actor.save_checkpoint(str(start), tag="start")
            results = {}
            for k in (0, 1):
                _, history = _run(cfg, workers, tok, prompts, start, k)
                measured = history[1:]  # step 1 warms the engine and the rank up
                wall = sum(h["time/step_s"] for h in measured)
                results[k] = (len(measured) * args.prompts * args.samples_per_prompt / wall, measured)
        finally:
            workers.shutdown()
    sync_hist = results[0][1]
    gen = statistics.fmean(h["time/generate_s"] for h in sync_hist)
    train = statistics.fmean(h["time/step_s"] - h["time/generate_s"] for h in sync_hist)
    print(
        f"model hidden {args.hidden} x {args.layers} layers; {args.prompts} prompts x {args.samples_per_prompt} "
        f"samples, up to {args.new_tokens} new tokens; {args.steps} measured steps per mode"
    )
    print(f"synchronous phases: generate {gen:.2f} s, score+train+sync {train:.2f} s per step")
    lengths = {k: statistics.fmean(h["response/length_mean"] for h in results[k][1]) for k in results}
    print(f"max_staleness=0: {results[0][0]:.1f} samples/s (mean response {lengths[0]:.1f} tokens)")
    s1, h1 = results[1]
    print(
        f"max_staleness=1: {s1:.1f} samples/s (mean response {lengths[1]:.1f} tokens, "
        f"staleness {statistics.fmean(h['rollout/staleness_mean'] for h in h1):.2f}, "
        f"generate {statistics.fmean(h['time/generate_s'] for h in h1):.2f} s/step, "
        f"trainer waited {statistics.fmean(h['time/trainer_wait_s'] for h in h1):.2f} s/step, "
        f"sync waited {statistics.fmean(h['time/sync_wait_s'] for h in h1):.2f} s/step, "
        f"engines idle {statistics.fmean(h['time/engine_wait_s'] for h in h1):.2f} s/step)"
    )
    print(
        f"speed-up: {s1 / results[0][0]:.2f}x   ideal (generate + train) / max: {(gen + train) / max(gen, train):.2f}x"
    )


if __name__ == "__main__":
    main()
