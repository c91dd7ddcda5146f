"""Every environment variable the framework sets, in one place.

``CLUSTER_ENV`` is what every process of a run needs on any cluster, CPU or GPU; it is also
written out in ``launch/runtime_env.yaml``, ``launch/k8s/rayjob.yaml``, ``docker/Dockerfile``
and ``scripts/env.sh`` (tests/test_envvars.py checks they agree). ``CPU_ENV`` adds what a
CPU-only host needs; it would break vLLM and DeepSpeed on GPUs, so it is set only when
``cluster.device=cpu``. A value already in the driver's environment wins for the variables
a user may tune (``TUNABLE``).
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "CLUSTER_ENV",
    "JOB_STOP_ENV",
    "CPU_ENV",
    "PASSTHROUGH",
    "TUNABLE",
    "cpu_env",
    "engine_env",
    "model_worker_env",
    "quiet_driver",
    "torch_extensions_dir",
]

CLUSTER_ENV = {
    # Cluster nodes usually have no route to the Hub: fail fast on a missing model instead of
    # hanging on retries.
    "HF_HUB_OFFLINE": "1",
    # Tokenizers' thread pool deadlocks in processes that Ray forks after it was used.
    "TOKENIZERS_PARALLELISM": "false",
    # The engine lives inside a Ray actor: vLLM's extra engine-core process would escape Ray's
    # resource accounting (and, on GPU, need a second CUDA context).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # transformers' "Loading weights" / "Writing model shards" bars, once per worker and checkpoint
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

CPU_ENV = {
    **CLUSTER_ENV,
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per CPU engine
    "DS_ACCELERATOR": "cpu",  # DeepSpeed would otherwise probe for CUDA
    # libgomp's idle threads spin 300,000 times before sleeping: when a phase ends in one process
    # (reference forward, generation) its threads keep burning the cores the next phase's process
    # needs. 20,000 still spans the gaps between the ops of one forward (small GRPO bench: 17%
    # fewer CPU-seconds per step, train phase 0.091 -> 0.080 s); OMP_WAIT_POLICY=PASSIVE (no
    # spin at all) made the train step slower.
    "GOMP_SPINCOUNT": "20000",
}

# `ray job stop` (and a deleted or retried RayJob) sends the driver SIGTERM and SIGKILLs it this
# many seconds later; Ray's default is 3 s, less than the driver needs to write its checkpoint
# (train.stop_grace_s, 25 s, is its own deadline). Ray's job supervisor reads it from the job's
# runtime_env, so launch/runtime_env.yaml carries it (and the KubeRay head, for RayJobs).
JOB_STOP_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": "60"}

# May be set by the user in the driver's environment; their value is kept.
TUNABLE = ("VLLM_CPU_KVCACHE_SPACE", "DS_ACCELERATOR", "GOMP_SPINCOUNT")

# Forwarded from the driver to the engines so that an offline cluster stays offline there.
PASSTHROUGH = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
)


def cpu_env() -> dict[str, str]:
    """``CPU_ENV`` with the driver's values of the ``TUNABLE`` variables."""
    return {k: os.environ.get(k, v) if k in TUNABLE else v for k, v in CPU_ENV.items()}


def engine_env(num_gpus: float) -> dict[str, str]:
    """Env of a rollout-engine actor: the CPU recipe without GPUs, plus ``PASSTHROUGH``."""
    if num_gpus > 0:
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": CLUSTER_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"]}
    else:
        env = {k: cpu_env()[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
        # vLLM's CPU worker binds memory to its NUMA node and torch's C++ side warns about it on
        # every engine start; C++ errors still print.
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env.update({k: os.environ[k] for k in PASSTHROUGH if k in os.environ})
    return env


def quiet_driver() -> None:
    """The driver's own process without the lines ``scripts/env.sh`` keeps off the console when
    it is started as ``python -m``: transformers' progress bars (the tiny model's "Writing model
    shards"), and DeepSpeed's "Setting accelerator to CPU" warning on import where no CUDA
    device is visible. A value the user set is kept; DS_ACCELERATOR is left alone where a GPU is
    visible, since a local Ray started by this driver passes its environment to the ranks."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", CLUSTER_ENV["HF_HUB_DISABLE_PROGRESS_BARS"])
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = CPU_ENV["DS_ACCELERATOR"]


def torch_extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops are cached: ``$TORCH_EXTENSIONS_DIR``, else a directory
    of this Python environment. torch keeps one build per op name and rebuilds it whenever the
    compile command changes, and the command holds the environment's include paths: two
    checkouts sharing ``~/.cache/torch_extensions`` rebuild each other's ops (60-70 s a time)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def model_worker_env(uses_gpu: bool, num_cpus: float) -> dict[str, str]:
    """Env of a DeepSpeed rank: one intra-op thread per CPU it was given."""
    env = {
        "TOKENIZERS_PARALLELISM": CLUSTER_ENV["TOKENIZERS_PARALLELISM"],
        "OMP_NUM_THREADS": str(max(1, int(num_cpus))),
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
    }
    if not uses_gpu:
        env["DS_ACCELERATOR"] = cpu_env()["DS_ACCELERATOR"]
    return env
