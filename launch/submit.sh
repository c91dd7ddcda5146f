#!/usr/bin/env bash
# Submits an rlhf entry point to a running Ray cluster as a Ray job, with this checkout as the
# job's working_dir (launch/runtime_env.yaml).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/submit.sh [--address URL] [--entry MODULE] [--no-wait] [-h] -- [hydra overrides...]

Runs `ray job submit --runtime-env launch/runtime_env.yaml -- python -m MODULE overrides...`.

  --address URL   Ray dashboard address (default: $RAY_ADDRESS, else http://127.0.0.1:8265)
  --entry MODULE  Python module to run (default: rlhf.ppo)
  --no-wait       return after submission instead of tailing the job's logs
  -h, --help      show this help

Everything after `--` is passed to the entry point unchanged, e.g.
  launch/submit.sh --address http://head:8265 -- cluster=gpu train.num_steps=10
EOF
}

ADDR=${RAY_ADDRESS:-http://127.0.0.1:8265}
ENTRY=rlhf.ppo
NO_WAIT=()

while (($#)); do
  case $1 in
    --address) ADDR=${2:?--address needs a value}; shift 2 ;;
    --address=*) ADDR=${1#*=}; shift ;;
    --entry) ENTRY=${2:?--entry needs a value}; shift 2 ;;
    --entry=*) ENTRY=${1#*=}; shift ;;
    --no-wait) NO_WAIT=(--no-wait); shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "submit.sh: unknown option '$1' (hydra overrides go after --)" >&2; usage >&2; exit 2 ;;
  esac
done

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if command -v ray >/dev/null 2>&1; then
  RAY=$(command -v ray)
elif [[ -x $REPO_ROOT/.venv/bin/ray ]]; then
  RAY=$REPO_ROOT/.venv/bin/ray
else
  echo "submit.sh: no 'ray' CLI on PATH or in $REPO_ROOT/.venv/bin (pip install 'ray[default]')" >&2
  exit 127
fi

# runtime_env.yaml's working_dir "." is resolved against the current directory, so submitting
# from anywhere else would upload the wrong tree.
cd "$REPO_ROOT"

# The ${arr[@]+...} form: bash before 4.4 treats an empty array as unset under `set -u`.
exec "$RAY" job submit \
  --address "$ADDR" \
  --runtime-env launch/runtime_env.yaml \
  ${NO_WAIT[@]+"${NO_WAIT[@]}"} \
  -- python -m "$ENTRY" "$@"
