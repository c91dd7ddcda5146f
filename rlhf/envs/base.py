"""The environment interface for multi-turn rollouts.

A trajectory is one unpadded sample: prompt, then alternating policy turns (action mask 1)
and observation turns (action mask 0), e.g. assistant -> tool -> assistant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class StepResult:
    """What the environment returns after a policy turn.

    observation: text appended after the policy's turn (tool output plus the opening of
        the next assistant turn); ignored when ``done``.
    done: the trajectory ends here.
    reward: optional environment reward for the whole trajectory (used when ``done``;
        ``None`` = score with the configured reward function/model instead).
    """

    observation: str = ""
    done: bool = True
    reward: float | None = None


@runtime_checkable
class Env(Protocol):
    def reset(self, prompt: str, info: dict) -> None:
        """Start a trajectory for ``prompt`` (chat-formatted text)."""

    def step(self, response: str) -> StepResult:
        """React to the policy's latest turn (decoded text of that turn only)."""


def load_env(spec: str, **kwargs) -> Env:
    """Instantiate ``"module:Class"`` (config ``env.name``)."""
    module_name, sep, cls_name = spec.rpartition(":")
    if not sep:
        raise ValueError(f"env.name={spec!r} must look like 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name={spec!r}: cannot load it ({e})") from e
    env = cls(**kwargs)
    if not isinstance(env, Env):
        raise ValueError(f"env.name={spec!r}: {cls_name} must define reset(prompt, info) and step(response)")
    return env
