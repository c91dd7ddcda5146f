"""A toy tool-use environment for multi-turn rollouts."""

from __future__ import annotations

from rlhf.envs.base import StepResult


class EchoToolEnv:
    """After each assistant turn a "tool" echoes how many numbers the turn contained.

    It never ends a trajectory by itself unless ``max_turns`` is given: ``env.max_turns``
    (the experience maker's cap) decides. It gives no reward of its own, so the configured
    reward function or model scores the whole trajectory.
    """

    def __init__(self, max_turns: int | None = None):
        self.max_turns = max_turns
        self.turn = 0

    def reset(self, prompt: str, info: dict) -> None:
        self.turn = 0

    def step(self, response: str) -> StepResult:
        self.turn += 1
        if self.max_turns is not None and self.turn >= self.max_turns:
            return StepResult(done=True)
        n = sum(w.isdigit() for w in response.split())
        return StepResult(observation=f" <|tool|> result {n} <|end|> <|assistant|>", done=False)
