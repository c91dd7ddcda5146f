"""The environment interface for multi-turn rollouts.

A trajectory is one unpadded sample: prompt, then alternating policy turns (action mask 1)
and observation turns (action mask 0), e.g. assistant -> tool -> assistant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class ToolStats:
    """What a turn's tool calls did (summed into the ``agent/*`` metrics)."""

    calls: int = 0
    errors: int = 0  # raised, unknown tool, bad arguments
    timeouts: int = 0  # past env.tool_timeout_s
    malformed: int = 0  # a call the parser could not read
    time_s: float = 0.0

    def add(self, other: ToolStats) -> None:
        for f in ("calls", "errors", "timeouts", "malformed", "time_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class StepResult:
    """What the environment returns after a policy turn.

    messages: chat messages that answer the turn (``{"role": "tool" | "user", "content": ...}``),
        turned into tokens through the tokenizer's chat template (``rlhf.agents.chat_delta``):
        the preferred form.
    observation: text appended after the policy's turn as it is tokenized (the text path, for
        environments written before ``messages``; it must carry the template's markup itself).
    done: the trajectory ends here (messages/observation are ignored then).
    reward: optional environment reward for the whole trajectory (used when ``done``;
        ``None`` = score with the configured reward function/model instead).
    tools: what the turn's tool calls did, for the metrics.
    """

    observation: str = ""
    done: bool = True
    reward: float | None = None
    messages: list[dict] | None = None
    tools: ToolStats | None = None


@runtime_checkable
class Env(Protocol):
    def reset(self, prompt: str, info: dict) -> None:
        """Start a trajectory for ``prompt`` (chat-formatted text)."""

    def step(self, response: str) -> StepResult:
        """React to the policy's latest turn (decoded text of that turn only). Runs on a worker
        thread of the agent loop, bounded by ``env.step_timeout_s``."""


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
