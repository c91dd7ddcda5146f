#!/usr/bin/env bash
# Check the vLLM interfaces we call against the vLLM of the [gpu] extra, which the CPU venv
# cannot install (it runs the CPU build, an older release). Downloads that vLLM's wheel
# (no dependencies, ~500 MB, once), puts its Python sources ahead of the venv's vLLM, and runs
# the tests that check those interfaces: engine arguments, worker methods, sampling params,
# and the WeightSource / trainer transfer engines of the nccl and ipc weight sync.
# Run after bumping either vLLM pin in pyproject.toml:  scripts/check_vllm_gpu_api.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(grep -oE '"vllm==[0-9][^"]*"' pyproject.toml | head -1 | tr -d '"' | cut -d= -f3)
[[ -n "$version" ]] || { echo "no vllm==X pin in pyproject.toml's [gpu] extra" >&2; exit 2; }
tree=${RLHF_VLLM_GPU_TREE:-$HOME/.cache/rlhf/vllm-$version}
if [[ ! -f "$tree/vllm/__init__.py" ]]; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    timeout 1200 .venv/bin/python -m pip download --no-deps --only-binary :all: -d "$wheels" "vllm==$version"
    mkdir -p "$tree"
    # Python sources only: the compiled kernels need CUDA and are never imported by these tests.
    .venv/bin/python - "$wheels"/vllm-*.whl "$tree" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
PY
fi
source scripts/env.sh
found=$(PYTHONPATH="$tree" .venv/bin/python -c "import vllm.engine.arg_utils as a; print(a.__file__)" 2>/dev/null)
[[ "$found" == "$tree"/* ]] || { echo "vLLM $version from $tree was not the one imported ($found)" >&2; exit 1; }
echo "checking against vLLM $version ($tree)"
# not e2e: those tests start Ray and exercise none of vLLM's code
PYTHONPATH="$tree" exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "not e2e" \
    tests/workers/test_vllm_api.py tests/workers/test_weight_sync.py "$@"
