"""bench/streaming.py runs end to end at a tiny size (real Ray, vLLM CPU engine, DeepSpeed rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_streaming_bench_measures_every_mode_on_both_workloads(tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "bench/streaming.py", "--steps", "2", "--prompts", "4", "--samples-per-prompt", "2",
        "--long-tokens", "48", "--stream-staleness", "2", "--trajectories", "8", "--batches", "2",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["long_tail"]
    assert list(rows) == [
        "batch, synchronous",
        "batch, one-step-off",
        "streaming, drain at sync",
        "streaming, partial rollouts",
        "streaming, in-flight",
    ]
    for name, r in rows.items():
        assert r["samples_s"] > 0 and 0 <= r["engine_idle"] <= 1 and 0 <= r["trainer_idle"] <= 1, (name, r)
        # Measured, not assumed: the machine's share of busy cores and the engine process's CPU.
        assert 0 < r["machine_busy"] <= 1 and r["engine_cpu"] > 0, (name, r)
    assert rows["batch, synchronous"]["staleness"] == 0
    assert all(r["staleness"] <= 2 for r in rows.values())
    agent = result["agent"]
    assert agent["per_batch"] > 0 and agent["streaming"] > 0 and agent["per_batch_ideal"] > 0
    assert "x the per-batch ideal" in proc.stdout and "x one-step-off" in proc.stdout
    assert "ceilings (samples/s with every core busy" in proc.stdout
