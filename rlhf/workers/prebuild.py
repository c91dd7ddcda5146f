"""Build the DeepSpeed JIT op a CPU rank compiles on its first start (the shared-memory
allreduce, 35-70 s on 2 cores), ahead of the first run and into the cache the ranks use
(``rlhf.envvars.torch_extensions_dir``). ``scripts/setup.sh`` runs it; a no-op when built.

python -m rlhf.workers.prebuild
"""

from __future__ import annotations

import os
import time

from rlhf.envvars import cpu_env, torch_extensions_dir


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", cpu_env()["DS_ACCELERATOR"])
    os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("prebuild: this DeepSpeed accelerator has no shm comm op; nothing to build")
        return
    builder.load(verbose=False)
    print(
        f"prebuild: {builder.absolute_name()} ready in {os.environ['TORCH_EXTENSIONS_DIR']} ({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
