"""Multi-turn and tool-calling settings (``env.*``), read by ``rlhf.agents``."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config.model import _check

__all__ = ["EnvConfig"]


@dataclass
class EnvConfig:
    """Multi-turn environment (``rlhf.agents``); ``name`` and ``tools`` empty = single-turn generation."""

    name: str = ""  # "module:Class" implementing rlhf.envs.base.Env
    # Tool calling without an env of one's own: registered names (calculator, python) or
    # module:attribute of an rlhf.agents.tools.Tool; the final answer is scored by reward.function.
    tools: list[str] = field(default_factory=list)
    tool_parser: str = "hermes"  # <tool_call>{json}</tool_call>; rlhf.agents.parser.PARSERS
    max_turns: int = 3  # policy turns per trajectory
    max_observation_tokens: int = 32  # text observations (StepResult.observation) only
    max_tool_output_chars: int = 2000  # a tool result longer than this is cut
    max_calls_per_turn: int = 4  # more tool calls in one turn come back as an error message
    tool_timeout_s: float = 10.0  # one tool call
    step_timeout_s: float = 60.0  # one env.step (all of a turn's tool calls)
    max_concurrency: int = 16  # env steps and tool calls running at once (threads)
    loop: str = "per_trajectory"  # per_trajectory | lockstep (every turn waits for the whole batch)
    sandbox_wall_s: float = 5.0  # the python tool: wall-clock, CPU, memory limits
    sandbox_cpu_s: int = 5  # the python tool's CPU seconds
    sandbox_memory_mb: int = 512  # the python tool's address space
    # error | drop: a trajectory the chat template renders differently as a whole conversation
    # (rlhf.agents.chat_delta); error fails the step before any update, drop leaves out its group
    on_template_drift: str = "error"

    def __post_init__(self) -> None:
        _check(
            self.loop in ("per_trajectory", "lockstep"),
            f"env.loop must be per_trajectory or lockstep, got {self.loop!r}",
        )
        _check(
            not (self.name and self.tools),
            "set env.name (an environment of your own) or env.tools (the built-in tool environment), not both",
        )
        _check(self.max_turns >= 1, "env.max_turns must be >= 1")
        _check(
            self.on_template_drift in ("error", "drop"),
            f"env.on_template_drift must be error or drop, got {self.on_template_drift!r}",
        )
        _check(
            self.tool_timeout_s > 0 and self.step_timeout_s > 0,
            "env.tool_timeout_s and env.step_timeout_s must be > 0",
        )
        _check(self.max_concurrency >= 1, "env.max_concurrency must be >= 1")
        _check(
            self.sandbox_wall_s < self.tool_timeout_s,
            f"env.sandbox_wall_s={self.sandbox_wall_s:g} must be below env.tool_timeout_s={self.tool_timeout_s:g}: "
            "the python tool's process is killed at its own wall-clock limit, before the call times out",
        )

    @property
    def multi_turn(self) -> bool:
        return bool(self.name or self.tools)
