"""Held-out accuracy and training reward of several runs in one plot.

Run: ``.venv/bin/python bench/plot_runs.py OUT.png LABEL=RUN_DIR/metrics.jsonl ...`` (a label
may hold "=": the path follows the last one). The x axis is the sum of the runs' step times, so
a faster run ends further left.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(argv[0]), [a.rsplit("=", 1) for a in argv[1:]]
    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    for label, path in runs:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        t, clock = 0.0, {}
        for r in rows:
            t += r.get("time/step_s", 0.0)
            clock[r["step"]] = t
        ev = [(clock.get(r["step"], 0.0), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        tr = [(clock[r["step"]], r["reward/mean"]) for r in rows if "reward/mean" in r]
        acc.plot(*zip(*ev, strict=True), "o-", label=label)
        rew.plot(*zip(*tr, strict=True), label=label, alpha=0.7)
    acc.set(xlabel="seconds of GRPO steps", ylabel="held-out greedy accuracy", ylim=(0, 1))
    rew.set(xlabel="seconds of GRPO steps", ylabel="training reward (mean)", ylim=(0, 1))
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
