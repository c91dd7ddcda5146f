"""Agent rollouts in lockstep vs per trajectory: trajectories/s and engine idle fraction.

Run: ``.venv/bin/python bench/agent_loop.py`` (under a minute on 2 CPU cores; ``--help``).

The same multi-turn work runs through ``rlhf.agents.loop.AgentLoop`` on one real vLLM CPU
engine (continuously batched, ``rlhf.workers.continuous``), once with ``env.loop=lockstep``
(every turn of the batch waits for the slowest tool call of that turn) and once per
trajectory (a trajectory's next turn is submitted as soon as its own tool answered). Each
trajectory takes 1-4 tool turns; a tool call sleeps a latency drawn per (trajectory, turn):

- ``skewed``: most calls ``--fast-ms``, a ``--slow-frac`` share ``--slow-ms`` (a tool that
  usually answers from cache and sometimes does real work);
- ``equal``: every trajectory takes the same number of turns, every call ``--equal-ms``
  (nothing to overlap: the per-trajectory loop must not be slower).

Both modes draw the same turns and latencies and sample the same tokens (seeds depend on
trajectory and turn), so they do the same work. Engine idle fraction = 1 - (time the engine
spent in steps) / wall time, from the engine's own step counter.

Measured (2-core CI-like machine, 2026-12-05, tiny Llama hidden 128 x 2 layers, 8 new tokens a
turn, most calls 10 ms and 10% of them 300 ms; target >= 2x at the skewed setting, >= 1x at the
equal one), ``python bench/agent_loop.py``: 32 trajectories 1.80x (37.4 -> 67.3 traj/s, engine
idle 80% -> 40%), 128 trajectories (the agent demo's batch, 16 prompts x 8) 2.06x (75.6 -> 155.5
traj/s, idle 81% -> 29%); equal 1.06x. A sweep (``--slow-frac 0.05,0.1,0.2``) gave 1.69-1.93x at
32 trajectories and 1.73-2.09x at 128. The ideal speed-up (critical paths) is 1.77-1.96x: one batch
ends with its longest trajectory, so 2x is reached where lockstep also runs behind its own ideal.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Workload:
    """Per-(trajectory, turn) tool latencies and per-trajectory turn counts, drawn once."""

    name: str
    turns: tuple[int, ...]  # tool turns of each trajectory
    latency_s: tuple[tuple[float, ...], ...]  # [trajectory][turn]

    @classmethod
    def skewed(cls, n: int, fast_s: float, slow_s: float, slow_frac: float, seed: int) -> Workload:
        rng = random.Random(seed)
        turns = tuple(rng.randint(1, 4) for _ in range(n))
        lat = tuple(tuple(slow_s if rng.random() < slow_frac else fast_s for _ in range(k)) for k in turns)
        return cls(f"skewed n={n} slow={slow_frac:g}", turns, lat)

    @classmethod
    def equal(cls, n: int, turns: int, latency_s: float) -> Workload:
        return cls(f"equal n={n}", (turns,) * n, ((latency_s,) * turns,) * n)

    def critical_paths(self, step_s: float, new_tokens: int) -> tuple[float, float]:
        """Shortest possible wall time of one batch (lockstep, per trajectory): tool latencies
        plus ``new_tokens`` engine steps of ``step_s`` per policy turn, everything else free.
        Lockstep: every round waits for its slowest call; per trajectory: the longest trajectory."""
        gen = new_tokens * step_s
        rounds = max(self.turns) + 1  # the tool turns and the final answer
        lockstep = sum(
            max((lat[r] for lat in self.latency_s if len(lat) > r), default=0.0) for r in range(rounds)
        )
        per_traj = max(sum(lat) + (len(lat) + 1) * gen for lat in self.latency_s)
        return lockstep + rounds * gen, per_traj

    def env_factory(self):
        work = self

        class BenchTool:
            """A tool turn that takes the drawn latency (a sleep: the engine is free meanwhile)."""

            def reset(self, prompt: str, info: dict) -> None:
                self.i, self.turn = info["index"], 0

            def step(self, response: str):
                from rlhf.envs.base import StepResult, ToolStats

                if self.turn == work.turns[self.i]:  # the policy turn after the last tool: the answer
                    return StepResult(done=True, reward=1.0)
                delay = work.latency_s[self.i][self.turn]
                time.sleep(delay)
                self.turn += 1
                return StepResult(observation=" result 3", done=False, tools=ToolStats(calls=1, time_s=delay))

        return BenchTool


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=_ints, default=[32, 128], help="batch sizes, e.g. 32,128")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens per policy turn")
    p.add_argument("--fast-ms", type=float, default=10.0)
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--slow-frac", type=_floats, default=[0.1], help="shares of slow calls, e.g. 0.05,0.1")
    p.add_argument("--equal-ms", type=float, default=50.0)
    p.add_argument("--equal-turns", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per mode (after 1 warm-up)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _run(pool, tok, prompts, work: Workload, lockstep: bool, new_tokens: int, repeats: int):
    from rlhf.agents.loop import AgentLoop

    loop = AgentLoop(
        pool, tok, work.env_factory(), {"temperature": 1.0, "max_tokens": new_tokens}, seed=7,
        max_turns=8, max_model_len=512, max_observation_tokens=8, step_timeout_s=60,
        max_concurrency=len(prompts), lockstep=lockstep,
    )  # fmt: skip
    runs = []
    steps0 = _engine_steps(pool)
    for batch in range(repeats):
        samples, stats = loop.run(prompts, 1, batch=batch, group_base=0)
        if stats.env_errors or [s.turns for s in samples] != [k + 1 for k in work.turns]:
            raise RuntimeError("a trajectory ended early (max_model_len?): the two modes would differ")
        runs.append((stats, [s.input_ids.tolist() for s in samples]))
    loop.close()
    wall = sum(s.wall_s for s, _ in runs)
    busy = sum(s.engine_busy_s for s, _ in runs)
    step_s = busy / max(_engine_steps(pool) - steps0, 1)
    return len(prompts) * repeats / wall, 1.0 - busy / wall, [ids for _, ids in runs], step_s


def _engine_steps(pool) -> int:
    return int(pool.stats()[0]["steps"])


def workloads(args: argparse.Namespace) -> list[Workload]:
    """A skewed workload per (batch size, slow share), then the equal one at the first batch size."""
    skewed = [
        Workload.skewed(n, args.fast_ms / 1e3, args.slow_ms / 1e3, frac, args.seed)
        for n in args.trajectories
        for frac in args.slow_frac
    ]
    return [*skewed, Workload.equal(args.trajectories[0], args.equal_turns, args.equal_ms / 1e3)]


def measure(pool, tok, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every workload of :func:`workloads` in both modes on ``pool``'s first engine; prints the
    table and returns ``{workload name: {"lockstep", "per_trajectory" (traj/s), "*_idle",
    "speedup", "same_tokens", "ideal_speedup"}}``; ``ideal_speedup``: the ratio of the two modes'
    critical paths (``Workload.critical_paths``, each at the engine step time measured in that
    mode), the speed-up an ideally efficient engine and driver would show on this workload."""
    from rlhf.data.prompts import Prompt

    def prompts_for(work: Workload) -> list:
        return [
            Prompt(f"count {i}", tok(f"count {i}")["input_ids"], {"index": i}) for i in range(len(work.turns))
        ]

    works = workloads(args)
    _run(pool, tok, prompts_for(works[0]), works[0], False, args.new_tokens, 1)  # warm-up (compile, caches)
    width = max(len(w.name) for w in works) + 2
    print(f"{'workload':<{width}}{'mode':<16}{'traj/s':>9}{'engine idle':>13}")
    table = {}
    for work in works:
        row, ids, step_s = {}, {}, {}
        for mode, lockstep in (("lockstep", True), ("per_trajectory", False)):
            rate, idle, ids[mode], step_s[mode] = _run(
                pool, tok, prompts_for(work), work, lockstep, args.new_tokens, args.repeats
            )
            row[mode], row[f"{mode}_idle"] = rate, idle
            print(
                f"{work.name:<{width}}{mode:<16}{rate:>9.2f}{idle:>12.0%}"
                f"   ({step_s[mode] * 1e3:.1f} ms per engine step)"
            )
        lock_s = work.critical_paths(step_s["lockstep"], args.new_tokens)[0]
        per_s = work.critical_paths(step_s["per_trajectory"], args.new_tokens)[1]
        row["speedup"] = row["per_trajectory"] / row["lockstep"]
        row["ideal_speedup"] = lock_s / per_s
        row["same_tokens"] = float(ids["lockstep"] == ids["per_trajectory"])
        print(
            f"{work.name:<{width}}{'speed-up':<16}{row['speedup']:>8.2f}x   ideal {row['ideal_speedup']:.2f}x "
            f"(critical paths {lock_s:.2f} s vs {per_s:.2f} s a batch); same tokens in both modes: "
            f"{bool(row['same_tokens'])}"
        )
        table[work.name] = row
    return table


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = _parse(argv)
    import ray
    from transformers import AutoTokenizer

    from rlhf.envvars import cpu_env
    from rlhf.models.tiny import build_tiny_model
    from rlhf.workers.rollout import default_engine_env
    from rlhf.workers.rollout_pool import RolloutPool

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlhf-bench-")) / "model", arch="llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": cpu_env()})
    pool = RolloutPool(
        1,
        {"model_path": str(model_dir), "max_model_len": 512, "dtype": "float32"},
        num_cpus_per_engine=1,
        env_vars={**default_engine_env(0), "HF_HUB_OFFLINE": "1"},
    )
    try:
        return measure(pool, tok, args)
    finally:
        pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
