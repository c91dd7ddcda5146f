"""bench/lora.py runs end to end with its tiny config (real vLLM CPU engines, both variants)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_lora_bench_tiny_measures_both_variants(capsys):
    spec = importlib.util.spec_from_file_location("bench_lora", REPO / "bench" / "lora.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--tiny", "--threads", "1", "--steps", "1"])
    full, lora = results["full"], results["lora"]
    # The adapter is all LoRA ships and trains: 2 layers x 7 projections x r(in + out), fp32.
    r, h, i = 8, 128, 256
    adapter = 2 * r * (4 * (h + h) + 3 * (h + i))  # q, k, v, o: h -> h (kv heads = heads); gate, up, down
    assert lora["trainable_params"] == adapter
    assert lora["sync_bytes"] == 4 * adapter
    assert full["sync_bytes"] == 4 * full["trainable_params"]
    assert all(v["sync_s"] > 0 and v["step_s"] > 0 and v["peak_rss_bytes"] > 0 for v in (full, lora))
    table = capsys.readouterr().out
    assert "lora/full" in table and "sync_bytes" in table
