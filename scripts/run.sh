#!/usr/bin/env bash
# Set up .venv (CPU recipe) if needed, then run an entry point on the local CPU.
# Usage: scripts/run.sh [rlhf.demo|rlhf.agent_demo|rlhf.ppo|rlhf.sft|rlhf.dpo|rlhf.rm] [arguments...]
# Default: the main job, rlhf.demo (SFT warm start, then GRPO judged by held-out accuracy).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
entry=rlhf.demo
case "${1:-}" in rlhf.*) entry=$1; shift ;; esac
exec .venv/bin/python -m "$entry" "$@"
