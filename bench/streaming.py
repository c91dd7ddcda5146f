"""Batch vs one-step-off vs streaming RL, side by side on the same work.

Run: ``.venv/bin/python bench/streaming.py`` (about 10 minutes on 2 CPU cores; ``--help``).

(a) Long-tailed response lengths, the whole RL step (real Ray, one vLLM CPU engine, one
DeepSpeed CPU rank; GRPO with learning rate 0, so every mode samples from the same weights and
does the same work): a ``--long-frac`` share of the prompts (drawn per prompt, the same in every
mode) answer with ``--long-tokens`` tokens, the others with ``--short-tokens`` (``ignore_eos``:
the lengths are the workload, not the random model's). Modes: ``train.mode=batch`` with
``max_staleness`` 0 and 1, and ``train.mode=streaming`` (``--stream-staleness``) with weight
updates that wait for the requests in flight, abort and continue them (partial rollouts), or
land between two engine steps (in-flight updates). Per mode: trained samples/s, the engine's idle share (1 -
time in engine steps / wall time, from the engine's own counter) and the trainer's idle share
(time waiting for its batch / wall time); the machine's CPU use (every core = 100%), the engine
process's CPU in cores, and the mode's ceiling: samples/s over machine busy, the same work per
sample with every core busy, a bound on what scheduling alone can gain on this machine.

(b) The agent bench's skewed tool latency, rollouts only (``bench/agent_loop.py``'s workload:
1-4 tool turns a trajectory, most calls ``--fast-ms``, a ``--slow-frac`` share ``--slow-ms``):
``--batches`` batches of ``--trajectories`` trajectories per batch through the per-trajectory
agent loop (each batch ends with its longest trajectory) vs the same trajectories streamed
group by group (``StreamingRollouts`` with ``max_staleness=1``, the next batch's trajectories
admitted while this one's stragglers finish). The per-batch critical path (its longest
trajectory at the measured engine step time) bounds any per-batch loop: its trajectories/s is
printed as the ideal streaming has to beat.

A subclass of the engine (``LongTailEngine``, this file) sets each request's length; nothing
else differs from a real run.

Measured (2-core CI-like machine, 2026-12-06, defaults): (a) samples/s 37.4 synchronous, 49.6
one-step-off, 50.6 streaming draining at each sync, 62.1 streaming with in-flight updates:
1.66x synchronous, 1.25x one-step-off (``--stream-staleness 8``: 1.69x, 1.36x); no group
dropped. (b) per-batch loop 48.1 traj/s, per-batch ideal 59.6, streaming 78.9: 1.32x the ideal.
2026-12-07 with partial rollouts: (a) 39.7 synchronous, 34.1 one-step-off, 45.2 drain, 68.4
partial rollouts, 63.4 in-flight (1.72x and 1.60x synchronous); (b) 44.9, 55.2, 80.5 (1.46x).
Later that day, with the CPU columns: (a) 71.0, 73.4, 64.8, 89.6, 97.0; machine busy 62% synchronous,
71% in-flight; in-flight's ceiling (every core busy) 1.91x synchronous; (b) 55.6, 67.3, 107.3.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _stack import CpuSampler, grpo_lr0_overrides, model_and_prompts, start_workers  # noqa: E402 - bench/ is the script dir

from rlhf.workers.rollout import RolloutEngine, response_room, sampling_params  # noqa: E402

MODES = (  # (name, train.mode, max_staleness, how an update meets the requests in flight)
    ("batch, synchronous", "batch", 0, "drain"),
    ("batch, one-step-off", "batch", 1, "drain"),
    ("streaming, drain at sync", "streaming", None, "drain"),  # --stream-staleness
    ("streaming, partial rollouts", "streaming", None, "partial"),
    ("streaming, in-flight", "streaming", None, "inflight"),
)


class LongTailEngine(RolloutEngine):
    """A vLLM engine whose requests run to a length drawn per prompt (long for ``long_frac``)."""

    long_frac, short_tokens, long_tokens = 0.1, 16, 128

    def request_params(self, prompt, sampling, seed):
        digest = hashlib.sha256(str(list(prompt)).encode()).digest()
        long = int.from_bytes(digest[:4], "little") / 2**32 < self.long_frac
        room = response_room(prompt, sampling, self.max_model_len)
        n = min(self.long_tokens if long else self.short_tokens, room)
        return sampling_params({**sampling, "ignore_eos": True}, seed=seed, max_tokens=n)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode (after 2 warm-up steps)")
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--long-frac", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--stream-staleness", type=int, default=4, help="train.max_staleness of the streaming modes"
    )
    p.add_argument("--trajectories", type=int, default=32, help="(b): trajectories per batch")
    p.add_argument("--batches", type=int, default=6, help="(b): batches per mode")
    p.add_argument("--fast-ms", type=float, default=10.0)
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--slow-frac", type=float, default=0.1)
    p.add_argument("--skip-agent", action="store_true", help="run (a) only")
    p.add_argument("--json", default="", help="also write the results to this file")
    return p.parse_args(argv)


def _config(args: argparse.Namespace, out: str):
    from rlhf.config import compose

    return compose(
        "ppo",
        [
            *grpo_lr0_overrides(args, out),
            "train.mode=streaming",  # engines built for in-flight updates (no prefix cache) in every mode
            f"train.num_steps={args.steps + 2}",
            f"rollout.max_new_tokens={args.long_tokens}",
            f"rollout.max_model_len={args.long_tokens + 64}",
            f"train.max_tokens_per_microbatch={2 * (args.long_tokens + 64)}",
        ],
    )


def _run_mode(cfg, workers, tok, prompts, start: Path, mode: str, staleness: int, update: str) -> dict:
    from rlhf.data.prompts import PromptLoader
    from rlhf.rewards import load_reward_fn
    from rlhf.trainer.ppo_trainer import PPOTrainer

    workers.actor.load_checkpoint(str(start), tag="start")
    workers.rollout.update_weights(workers.actor.get_weights_ref())
    out = Path(cfg.train.output_dir) / f"{mode}_{staleness}_{update}"
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, mode=mode, max_staleness=staleness, output_dir=str(out)),
        rollout=dataclasses.replace(
            cfg.rollout, inflight_updates=update == "inflight", partial_rollouts=update == "partial"
        ),
    )
    loader = PromptLoader(prompts, cfg.train.rollout_batch_size, seed=0)
    trainer = PPOTrainer(cfg, workers, tok, loader, load_reward_fn(cfg.reward.function))
    trainer.save = lambda: None  # checkpoint writes are not what is measured
    engine = psutil.Process(workers.rollout.stats()[0]["pid"])  # one engine, on this machine
    marks: list[tuple[float, float, float]] = []  # (time, engine busy, engine CPU s) after each step
    log_step = trainer.step_once

    def step_once(tracker, stop):
        log_step(tracker, stop)
        cpu = engine.cpu_times()
        marks.append((time.perf_counter(), workers.rollout.busy_s(), cpu.user + cpu.system))

    trainer.step_once = step_once
    with CpuSampler() as machine:
        history = trainer.fit()
    (t0, busy0, cpu0), (t1, busy1, cpu1) = marks[1], marks[-1]  # steps 1-2 warm the engine and the rank up
    measured = history[2:]
    wall = t1 - t0
    samples_s = sum(h["rollout/num_samples"] for h in measured) / wall
    machine_busy = machine.mean(t0, t1) / 100
    return {
        "samples_s": samples_s,
        "tokens_s": sum(h["rollout/num_samples"] * h["response/length_mean"] for h in measured) / wall,
        "machine_busy": machine_busy,
        # The same work with every core busy: how far this mode can go on this machine.
        "ceiling_s": samples_s / machine_busy,
        "engine_cpu": (cpu1 - cpu0) / wall,
        "engine_idle": 1.0 - (busy1 - busy0) / wall,
        "trainer_idle": sum(h["time/trainer_wait_s"] for h in measured) / wall,
        "response": statistics.fmean(h["response/length_mean"] for h in measured),
        "staleness": statistics.fmean(h.get("async/staleness_mean", 0.0) for h in measured),
        "dropped": sum(h.get("async/dropped_stale", 0.0) for h in measured),
        "sync_s": statistics.fmean(h.get("time/sync_s", 0.0) for h in measured),
        "train_s": statistics.fmean(h.get("time/train_s", 0.0) for h in measured),
        "step_s": statistics.fmean(h["time/step_s"] for h in measured),
    }


def _long_tail_pool(pool):
    """``pool``'s engines replaced by ``LongTailEngine``s in the same placement."""
    from rlhf.workers.rollout_pool import RolloutPool

    pool.shutdown()
    return RolloutPool(
        pool.num_engines,
        pool.engine_kwargs,
        num_cpus_per_engine=pool.num_cpus_per_engine,
        num_gpus_per_engine=pool.num_gpus_per_engine,
        placement_group=pool.placement_group,
        bundle_indices=pool.bundle_indices,
        env_vars=pool.env_vars,
        engine_cls=LongTailEngine,
        startup_timeout_s=pool.startup_timeout_s,
        call_timeout_s=pool.call_timeout_s,
    )


def long_tail(args: argparse.Namespace) -> dict[str, dict]:
    """Part (a): every mode of ``MODES`` on the same workers; prints the table, returns the rows."""
    LongTailEngine.long_frac, LongTailEngine.short_tokens = args.long_frac, args.short_tokens
    LongTailEngine.long_tokens = args.long_tokens
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, tmp)
        model_dir, tok, prompts = model_and_prompts(cfg, tmp)
        workers = start_workers(cfg, model_dir)
        try:
            workers.rollout = _long_tail_pool(workers.rollout)
            start = Path(tmp) / "start"
            workers.actor.save_checkpoint(str(start), tag="start")
            for name, mode, staleness, update in MODES:
                staleness = args.stream_staleness if mode == "streaming" else staleness
                rows[name] = _run_mode(cfg, workers, tok, prompts, start, mode, staleness, update)
        finally:
            workers.shutdown()
    print(
        f"(a) long-tailed lengths: {args.long_frac:.0%} of prompts answer {args.long_tokens} tokens, the rest "
        f"{args.short_tokens}; {args.prompts} prompts x {args.samples_per_prompt} samples a step, "
        f"{args.steps} measured steps; model hidden {args.hidden} x {args.layers} layers"
    )
    print(
        f"{'mode':<28}{'samples/s':>10}{'tokens/s':>10}{'engine idle':>13}{'trainer idle':>14}{'staleness':>11}{'dropped':>9}"
        f"{'train s':>9}{'sync s':>8}{'machine busy':>14}{'engine cores':>14}{'ceiling':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<28}{r['samples_s']:>10.1f}{r['tokens_s']:>10.0f}{r['engine_idle']:>12.0%}{r['trainer_idle']:>13.0%}"
            f"{r['staleness']:>11.2f}{r['dropped']:>9.0f}{r['train_s']:>9.2f}{r['sync_s']:>8.2f}"
            f"{r['machine_busy']:>13.0%}{r['engine_cpu']:>14.2f}{r['ceiling_s']:>9.1f}"
        )
    cores = os.cpu_count() or 1
    print(
        f"machine busy: every core's use over the measured steps ({cores} cores = 100%); engine cores: the "
        "engine process's CPU use (1.00 = one core all the time); ceiling: samples/s / machine busy, the "
        "same work with every core busy"
    )
    for unit in ("samples_s", "tokens_s"):
        base, off = rows[MODES[0][0]][unit], rows[MODES[1][0]][unit]
        for name, *_ in MODES[2:]:
            r = rows[name][unit]
            print(
                f"{name} ({unit.replace('_s', '/s')}): {r / base:.2f}x synchronous (target >= 2x), "
                f"{r / off:.2f}x one-step-off (target >= 1.3x)"
            )
    base = rows[MODES[0][0]]["samples_s"]
    print(
        "ceilings (samples/s with every core busy on the same work per sample): "
        + ", ".join(f"{name} {rows[name]['ceiling_s'] / base:.2f}x" for name, *_ in MODES)
        + " synchronous"
    )
    return rows


def agent_skew(args: argparse.Namespace) -> dict[str, float]:
    """Part (b): per-batch agent loop vs streamed groups on one engine, rollouts only."""
    import ray
    from agent_loop import Workload
    from transformers import AutoTokenizer

    from rlhf.agents.loop import AgentLoop
    from rlhf.data.prompts import Prompt
    from rlhf.models.tiny import build_tiny_model
    from rlhf.trainer.experience import RolloutStats
    from rlhf.trainer.streaming import FinishedGroup, StreamingRollouts
    from rlhf.workers.rollout import default_engine_env
    from rlhf.workers.rollout_pool import RolloutPool

    n, k = args.trajectories, args.batches
    work = Workload.skewed(n * k, args.fast_ms / 1e3, args.slow_ms / 1e3, args.slow_frac, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", arch="llama")
        tok = AutoTokenizer.from_pretrained(model_dir)
        if not ray.is_initialized():  # (a) left its local Ray up
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        engine = {"model_path": str(model_dir), "max_model_len": 512, "log_dir": str(Path(tmp) / "logs")}
        pool = RolloutPool(1, engine, env_vars=default_engine_env(0))
        try:
            prompts = [
                Prompt(f"count {i}", tok(f"count {i}")["input_ids"], {"index": i}) for i in range(n * k)
            ]
            loop = AgentLoop(
                pool, tok, work.env_factory(), {"temperature": 1.0, "max_tokens": 8}, seed=7, max_turns=8,
                max_model_len=512, max_observation_tokens=8, step_timeout_s=60, max_concurrency=4 * n,
            )  # fmt: skip
            loop.run(prompts[:n], 1, batch=0, group_base=0)  # warm-up
            busy0, steps0, t0 = pool.busy_s(), pool.stats()[0]["steps"], time.perf_counter()
            for b in range(k):
                loop.run(prompts[b * n : (b + 1) * n], 1, batch=b * n, group_base=b * n)
            per_batch_s = time.perf_counter() - t0
            step_s = (pool.busy_s() - busy0) / max(pool.stats()[0]["steps"] - steps0, 1)
            batches = iter(prompts[b * n : (b + 1) * n] for b in range(k))
            # no training here, so versions only count batches: no bound (a real run sets one)

            def run_group(t):
                samples, _ = loop.run_group(
                    t.prompt, 1, batch=t.batch_base, group_id=t.index, first_index=0, engine=0
                )
                return FinishedGroup(t, samples, RolloutStats(num_samples=len(samples)))

            stream = StreamingRollouts(
                run_group, lambda: next(batches), n, k, 2 * n, 1, 0, k, timeout_s=600
            ).start()
            t0 = time.perf_counter()
            for step in range(k):
                stream.get(step)
                stream.sync(lambda: None, step + 1)
            streamed_s = time.perf_counter() - t0
            stream.close()
            loop.close()
        finally:
            pool.shutdown()
    ideal_s = sum(
        Workload(
            work.name, work.turns[b * n : (b + 1) * n], work.latency_s[b * n : (b + 1) * n]
        ).critical_paths(step_s, 8)[1]
        for b in range(k)
    )
    row = {
        "per_batch": n * k / per_batch_s,
        "streaming": n * k / streamed_s,
        "per_batch_ideal": n * k / ideal_s,
    }
    print(
        f"(b) agent, skewed tool latency ({args.slow_frac:.0%} of calls {args.slow_ms:.0f} ms, the rest "
        f"{args.fast_ms:.0f} ms), {k} batches of {n} trajectories, rollouts only:"
    )
    print(
        f"per-batch loop {row['per_batch']:.1f} traj/s; its ideal (critical paths at {step_s * 1e3:.1f} ms a step) "
        f"{row['per_batch_ideal']:.1f} traj/s; streaming {row['streaming']:.1f} traj/s "
        f"({row['streaming'] / row['per_batch_ideal']:.2f}x the per-batch ideal, target > 1x)"
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    result = {"long_tail": long_tail(args)}
    if not args.skip_agent:
        result["agent"] = agent_skew(args)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
