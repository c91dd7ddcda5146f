"""bench/e2e_step.py runs the real stack (Ray, DeepSpeed, hf engines) for two steps and reports."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cpu
def test_cpu_sampler_covers_every_span_however_short(monkeypatch):
    """A span shorter than the sampling period, or one the busy machine kept the sampler from
    seeing on time, still gets the sample that covers it (a NaN broke the bench's `ideal` once)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("e2e_step_bench", REPO / "bench" / "e2e_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cpu = bench.CpuSampler(every_s=0.05)
    cpu.samples = [(1.00, 10.0), (1.05, 20.0), (1.30, 40.0), (1.35, 80.0)]  # a 0.25 s gap at 1.05-1.30
    assert cpu.mean(1.10, 1.101) == 40.0  # inside the gap: the sample that ends it
    assert cpu.mean(1.01, 1.02) == 20.0
    assert cpu.mean(1.01, 1.31) == pytest.approx((20 + 40 + 80) / 3)  # up to the first at or after the end
    assert cpu.mean(0.90, 1.00) == 10.0
    assert math.isnan(cpu.mean(1.40, 1.50))  # after the last sample: NaN, not a guess


@pytest.mark.e2e
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
