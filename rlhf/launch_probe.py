"""Smallest Ray job that exercises the whole submission path (launch/submit.sh).

It connects to the cluster the job was submitted to, runs one task on a worker and reports what
that worker saw, so a passing run shows that the working_dir upload made `rlhf` importable on
workers, that runtime_env env_vars reached them and that arguments after `--` were forwarded.

    launch/submit.sh --entry rlhf.launch_probe -- some.override=1
"""

from __future__ import annotations

import os
import sys

import ray

from rlhf.envvars import CLUSTER_ENV

# The names launch/runtime_env.yaml sets, whose values the probe echoes back.
_ENV_KEYS = tuple(CLUSTER_ENV)


@ray.remote(num_cpus=1)
def _probe() -> tuple[int, dict[str, str | None]]:
    return 41 + 1, {k: os.environ.get(k) for k in _ENV_KEYS}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Inside a Ray job the supervisor exports RAY_ADDRESS, so this joins that cluster rather than
    # starting a private one.
    ray.init()
    try:
        value, env = ray.get(_probe.remote(), timeout=120)
    finally:
        ray.shutdown()
    print(f"probe ok {value}", flush=True)
    print("probe env " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(f"probe argv {args}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
