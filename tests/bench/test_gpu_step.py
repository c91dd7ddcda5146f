"""bench/gpu_step.py runs end to end on CPU with its tiny config (the GPU run is the same code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
# The lent GPU machine has torch and transformers (and accelerate, peft) but none of these:
# an import of one of them anywhere on the bench's path fails there, after the device is started.
NOT_ON_THE_DEVICE = {"ray", "vllm", "deepspeed", "hydra", "omegaconf", "math_verify", "datasets"}
# Runs the bench as __main__ and prints, at exit, every top-level package it imported.
RUN_AND_LIST_IMPORTS = (
    "import atexit, json, runpy, sys\n"
    "atexit.register(lambda: print('TOP_LEVEL_MODULES=' + json.dumps(sorted({m.split('.')[0] for m in sys.modules}))))\n"
    "sys.argv = ['bench/gpu_step.py'] + sys.argv[1:]\n"
    "runpy.run_path('bench/gpu_step.py', run_name='__main__')\n"
)


def test_gpu_step_bench_tiny_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-c",
        RUN_AND_LIST_IMPORTS,
        "--tiny",
        "--samples",
        "12",
        "--repeats",
        "1",
        "--decode-prompts",
        "4",
        "--decode-tokens",
        "8",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["auto_attn_impl"] == "packed_sdpa"
    # The bench model and the windowed / soft-capped configs, each checked against per-sample;
    # a row split over 2 sequence-parallel processes against one.
    models = {"bench", "mistral_window16", "gemma2_window16_softcap", "mistral_sp2"}
    assert {c["model"] for c in r["checks"]} == models
    assert all(c["ok"] and c["max_diff"] < 1e-4 for c in r["checks"]), r["checks"]
    # the hf rollout sampler's logprobs against a full forward, and its throughput
    assert [c["impl"] for c in r["checks"]].count("hf_decode") == 1
    assert r["decode"]["rows"] == 16 and r["decode"]["tokens"] == 16 * 8 and r["decode"]["tokens_per_s"] > 0
    packed, padded = r["timings"][0], r["timings"][-1]
    assert packed["name"] == "packed/packed_sdpa" and padded["name"].startswith("padded/")
    # Packed rows compute only real tokens; padded micro-batches compute pads too.
    assert packed["computed_tokens"] == r["real_tokens"] < padded["computed_tokens"]
    assert all(t["step_s"] > 0 and t["tokens_per_s"] > 0 for t in r["timings"])
    assert "packed == per-sample" in proc.stdout and "vs padded" in proc.stdout
    imported = json.loads(proc.stdout.rsplit("TOP_LEVEL_MODULES=", 1)[1].splitlines()[0])
    assert "torch" in imported and "transformers" in imported
    extra = sorted(NOT_ON_THE_DEVICE & set(imported))
    assert not extra, f"bench/gpu_step.py imports {extra}, which the GPU machine does not have"
