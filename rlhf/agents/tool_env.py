"""The tool-calling environment: the policy's turn is parsed for tool calls; each runs with a
timeout on a thread of its own (``BoundedCalls``) and its result (or the error) becomes a ``tool`` message; a turn
without calls is the final answer, scored by the reward function (a verifier).

Every failure is an observation the model sees, never a dead run: an unknown tool, arguments
that do not fit the schema, a tool that raises, one past ``env.tool_timeout_s`` (its daemon thread is
abandoned and counted, its slot freed; the ``python`` tool's process is killed by its own limits), a
return value that is not a str, dict or list, output over
``env.max_tool_output_chars`` (cut), a call the parser cannot read (counted as malformed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from rlhf.agents.bounded import BoundedCalls
from rlhf.agents.parser import PARSERS, ParsedTurn, ToolCall
from rlhf.agents.tools import Tool, ToolArgumentError
from rlhf.envs.base import StepResult, ToolStats

__all__ = ["EnvFactory", "ToolEnv", "ToolRunner", "env_factory"]


@dataclass
class ToolRunner:
    """Runs tool calls with a timeout, at most ``env.max_concurrency`` at once (``BoundedCalls``:
    a call that hangs is abandoned at its timeout and blocks neither other calls nor the exit)."""

    tools: dict[str, Tool]
    timeout_s: float
    max_output_chars: int
    calls: BoundedCalls

    def call(self, call: ToolCall) -> tuple[str, ToolStats]:
        stats = ToolStats(calls=1)
        t0 = time.perf_counter()
        try:
            tool = self.tools.get(call.name)
            if tool is None:
                raise ToolArgumentError(
                    f"no tool named {call.name!r}; available: {', '.join(sorted(self.tools))}"
                )
            future = self.calls.submit(tool.fn, **tool.check(call.arguments))
            try:
                text = tool_text(call.name, future.result(timeout=self.timeout_s))
            except FutureTimeout:
                if future.done():
                    raise  # the tool's own TimeoutError (the same class since Python 3.11)
                stats.timeouts += 1
                self.calls.abandon(future)
                return f"error: {call.name} timed out after {self.timeout_s:g} s", stats
        except Exception as e:  # noqa: BLE001 - the model sees every failure as an observation
            stats.errors += 1
            text = f"error: {type(e).__name__}: {e}"
        finally:
            stats.time_s = time.perf_counter() - t0
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"\n[cut at {self.max_output_chars} characters]"
        return text, stats


def tool_text(name: str, value: Any) -> str:
    """What the model sees of a tool's return value: a str as it is, a dict or list as JSON;
    anything else is the tool's mistake (``TypeError``, an error observation)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} returned a {type(value).__name__} that is not JSON ({e})") from e
    raise TypeError(
        f"{name} returned {type(value).__name__} ({value!r:.80}); a tool returns a str, or a dict or list "
        "(sent as JSON)"
    )


class ToolEnv:
    """``Env`` whose observations are the results of the tool calls in the policy's turn."""

    def __init__(self, runner: ToolRunner, parser: str = "hermes", max_calls_per_turn: int = 4):
        if parser not in PARSERS:
            raise ValueError(f"env.tool_parser={parser!r}: known parsers are {sorted(PARSERS)}")
        self.runner, self.parse, self.max_calls = runner, PARSERS[parser], max_calls_per_turn

    def reset(self, prompt: str, info: dict) -> None:
        self.info = info

    def step(self, response: str) -> StepResult:
        parsed: ParsedTurn = self.parse(response)
        stats = ToolStats(malformed=len(parsed.malformed))
        if not parsed.calls and not parsed.malformed:
            return StepResult(done=True, tools=stats)  # the final answer: the reward scores it
        messages = [
            {"role": "tool", "content": f"error: malformed tool call: {why}"} for why in parsed.malformed
        ]
        for call in parsed.calls[: self.max_calls]:
            text, s = self.runner.call(call)
            stats.add(s)
            messages.append({"role": "tool", "name": call.name, "content": text})
        for call in parsed.calls[self.max_calls :]:
            stats.errors += 1
            messages.append(
                {
                    "role": "tool",
                    "name": call.name,
                    "content": f"error: more than {self.max_calls} calls in one turn",
                }
            )
        return StepResult(done=False, messages=messages, tools=stats)


@dataclass
class EnvFactory:
    """Makes one environment per trajectory; ``tools`` are the schemas the prompts are rendered with."""

    make: Callable[[], Any]
    tools: list[dict] | None = None

    def __call__(self) -> Any:
        return self.make()


def env_factory(env: Any) -> EnvFactory | None:
    """The run's environments from ``env.*`` (``EnvConfig``): ``env.name`` (one's own class),
    ``env.tools`` (``ToolEnv`` over those tools), or None (single-turn)."""
    from rlhf.agents.sandbox import SandboxLimits
    from rlhf.agents.tools import get_tool, python_tool
    from rlhf.envs.base import load_env

    if env.name:
        load_env(env.name)  # fail now, not mid-rollout, on a bad env.name
        return EnvFactory(lambda: load_env(env.name))
    if not env.tools:
        return None
    limits = SandboxLimits(
        wall_s=env.sandbox_wall_s, cpu_s=env.sandbox_cpu_s, memory_mb=env.sandbox_memory_mb
    )
    tools = {}
    for name in env.tools:
        tool = python_tool(limits) if name == "python" else get_tool(name)
        tools[tool.name] = tool
    runner = ToolRunner(
        tools,
        env.tool_timeout_s,
        env.max_tool_output_chars,
        BoundedCalls(env.max_concurrency, "tool"),
    )
    return EnvFactory(
        lambda: ToolEnv(runner, env.tool_parser, env.max_calls_per_turn), [t.schema() for t in tools.values()]
    )
