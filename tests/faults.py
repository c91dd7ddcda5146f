"""Faults injected into real runs (tests/test_ppo_resilience.py): reward functions the driver
calls, which at a chosen moment do to the run what an operator or the cluster would."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from rlhf.rewards.toy import count_reward

_calls = {"n": 0}


def _once_at_call() -> bool:
    """True at call number ``$RLHF_FAULT_AT_CALL`` of this process, the first time only
    (``$RLHF_FAULT_MARKER`` remembers it across recoveries)."""
    _calls["n"] += 1
    marker = Path(os.environ["RLHF_FAULT_MARKER"])
    if _calls["n"] < int(os.environ["RLHF_FAULT_AT_CALL"]) or marker.exists():
        return False
    marker.write_text(str(_calls["n"]))
    return True


def count_reward_then_kill_a_rank(prompt: str, response: str, info: dict) -> float:
    """Kill -9 one DeepSpeed rank process (what the OOM killer does)."""
    if _once_at_call():
        ranks = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "ray::ModelWorker" in " ".join(p.info["cmdline"] or [])
        ]
        assert ranks, "no DeepSpeed rank process found"
        ranks[0].kill()
    return count_reward(prompt, response, info)


def count_reward_then_sigterm(prompt: str, response: str, info: dict) -> float:
    """SIGTERM to this (the driver's) process while the step's batch is being rewarded."""
    if _once_at_call():
        os.kill(os.getpid(), signal.SIGTERM)
    return count_reward(prompt, response, info)
