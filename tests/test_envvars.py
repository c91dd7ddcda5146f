"""One source for environment variables: every file that writes them agrees with rlhf.envvars."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rlhf.envvars import CLUSTER_ENV, CPU_ENV, JOB_STOP_ENV, TUNABLE, cpu_env, engine_env, model_worker_env

ROOT = Path(__file__).resolve().parents[1]


def _env_sh() -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^export (\w+)=(\S+)$", (ROOT / "scripts/env.sh").read_text(), re.M):
        value = m.group(2)
        default = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
        out[m.group(1)] = default.group(1) if default else value
    return out


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "docker/Dockerfile").read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            out.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return out


def _rayjob_env() -> dict[str, str]:
    docs = list(yaml.safe_load_all((ROOT / "launch/k8s/rayjob.yaml").read_text()))
    job = next(d for d in docs if d and d.get("kind") == "RayJob")
    return yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]


def test_scripts_env_sh_sets_the_cpu_env():
    sh = _env_sh()
    assert {k: sh.get(k) for k in CPU_ENV} == CPU_ENV
    # the tunable ones keep a value the user exported
    text = (ROOT / "scripts/env.sh").read_text()
    for k in TUNABLE:
        assert f"{k}=${{{k}:-" in text


def test_cluster_files_set_exactly_the_cluster_env():
    runtime_env = yaml.safe_load((ROOT / "launch/runtime_env.yaml").read_text())["env_vars"]
    # the jobs' runtime_env also carries the stop wait Ray's job supervisor reads (JOB_STOP_ENV)
    assert runtime_env == {**CLUSTER_ENV, **JOB_STOP_ENV}
    assert _rayjob_env() == {**CLUSTER_ENV, **JOB_STOP_ENV}
    docker = _dockerfile_env()
    assert {k: docker.get(k) for k in CLUSTER_ENV} == CLUSTER_ENV
    # CPU-only settings would break vLLM and DeepSpeed on a GPU cluster.
    assert not (set(CPU_ENV) - set(CLUSTER_ENV)) & (set(runtime_env) | set(docker))


def test_env_helpers(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("HF_HOME", "/tmp/hf")
    assert cpu_env()["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert engine_env(0)["VLLM_CPU_KVCACHE_SPACE"] == "3" and engine_env(0)["HF_HOME"] == "/tmp/hf"
    assert "DS_ACCELERATOR" not in engine_env(1) and engine_env(1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert model_worker_env(False, 2) == {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "2",
        "DS_ACCELERATOR": "cpu",
        # one JIT-op cache per Python environment: checkouts must not rebuild each other's ops
        "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),
    }
    assert "DS_ACCELERATOR" not in model_worker_env(True, 1)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/opt/ext")  # the image's, or the user's
    assert model_worker_env(True, 1)["TORCH_EXTENSIONS_DIR"] == "/opt/ext"


def _driver(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "HF_HUB_DISABLE_PROGRESS_BARS")
    }
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_a_driver_started_as_python_m_keeps_deepspeeds_and_transformers_noise_off_the_console():
    # what `python -m rlhf.ppo` prints without scripts/env.sh: DeepSpeed's import-time warning
    noisy = _driver("import deepspeed.accelerator")
    assert "Setting accelerator to CPU" in noisy.stderr + noisy.stdout  # the noise is real here
    quiet = _driver(
        "from rlhf.envvars import quiet_driver; quiet_driver(); import os, deepspeed.accelerator; "
        "from transformers.utils import logging; "
        "print(os.environ['DS_ACCELERATOR'], logging.is_progress_bar_enabled())"
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "Setting accelerator" not in quiet.stderr + quiet.stdout
    assert quiet.stdout.split() == ["cpu", "False"]
    kept = _driver(
        "from rlhf.envvars import quiet_driver; quiet_driver(); import os; "
        "print(os.environ['DS_ACCELERATOR'], os.environ['HF_HUB_DISABLE_PROGRESS_BARS'])",
        DS_ACCELERATOR="cuda",
        HF_HUB_DISABLE_PROGRESS_BARS="0",
    )
    assert kept.stdout.split() == ["cuda", "0"]  # the user's values win
