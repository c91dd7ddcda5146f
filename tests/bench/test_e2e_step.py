"""bench/e2e_step.py runs the real stack (Ray, DeepSpeed, hf engines) for two steps and reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_e2e_step_bench_reports_every_phase_with_the_hf_backend():
    cmd = [sys.executable, "bench/e2e_step.py", "--sizes", "small", "--steps", "2", "--backends", "hf"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "rollout.backend=hf" in out
    med = next(line for line in out.splitlines() if line.startswith("med "))
    # generate, reward, score, advantage, train, sync, orchestration, step_s, ideal, tokens
    values = [float(v) for v in med.split()[1:]]
    assert len(values) == 10 and all(v >= 0 for v in values)
    generate, train, step = values[0], values[4], values[7]
    assert 0 < generate < step and 0 < train < step
    assert "orchestration" in out and "of the step" in out
