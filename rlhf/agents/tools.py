"""Tools the policy can call: typed Python callables with an OpenAI-format JSON schema,
registered by name, and the two built-ins (``calculator``, ``python``).

    from rlhf.agents.tools import Tool, register_tool

    def lookup(city: str) -> str:
        return {"paris": "18 C"}.get(city.lower(), "unknown city")

    register_tool(Tool("weather", "Current temperature of a city", {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, lookup))

A tool returns text (what the model sees); raising is fine: the caller (``ToolRunner``) turns
any error, a timeout or a malformed call into an error message for the model.
"""

from __future__ import annotations

import ast
import operator
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.agents.sandbox import SandboxLimits, run_python

__all__ = ["TOOLS", "Tool", "ToolArgumentError", "calculate", "get_tool", "python_tool", "register_tool"]


class ToolArgumentError(ValueError):
    """The call's arguments do not match the tool's schema."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """OpenAI function format, what ``apply_chat_template(tools=...)`` takes."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check(self, arguments: Any) -> dict:
        """The arguments as keyword arguments, or ``ToolArgumentError`` naming what is wrong."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}"
            )
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        unknown = [k for k in arguments if k not in props]
        if missing or unknown:
            raise ToolArgumentError(
                f"{self.name}: " + "; ".join(
                    [*(["missing " + ", ".join(missing)] if missing else []),
                     *(["unknown " + ", ".join(unknown)] if unknown else [])]
                ) + f" (parameters: {', '.join(props)})"
            )  # fmt: skip
        types = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
        for k, v in arguments.items():
            want = types.get(props[k].get("type", ""))
            if want is not None and not isinstance(v, want):
                raise ToolArgumentError(f"{self.name}: {k} must be a {props[k]['type']}, got {v!r}")
        return arguments


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    """Make ``tool`` callable by name (``env.tools=[name, ...]``)."""
    TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    """A registered tool; ``module:attribute`` imports a ``Tool`` defined elsewhere."""
    if name in TOOLS:
        return TOOLS[name]
    module, sep, attr = name.rpartition(":")
    if sep:
        import importlib

        try:
            tool = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"env.tools: cannot load {name!r} ({e})") from e
        if not isinstance(tool, Tool):
            raise ValueError(f"env.tools: {name!r} is a {type(tool).__name__}, not an rlhf.agents.tools.Tool")
        return tool
    raise ValueError(
        f"env.tools: no tool named {name!r}; registered: {sorted(TOOLS)} (or give module:attribute)"
    )


# ---------------------------------------------------------------- calculator: arithmetic, no eval
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 100  # results and exponents stay small: "9**9**9" would take the machine


def calculate(expression: str) -> str:
    """Evaluate ``+ - * / // % **`` and parentheses over numbers; anything else is refused."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    tree = ast.parse(expression.strip(), mode="eval")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
                raise ValueError("exponent or base too large")
            out = _BINARY[type(node.op)](a, b)
            if isinstance(out, int) and len(str(abs(out))) > MAX_DIGITS:
                raise ValueError(f"result longer than {MAX_DIGITS} digits")
            return out
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    value = ev(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


register_tool(
    Tool(
        "calculator",
        "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the result",
        {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        calculate,
    )
)


# ---------------------------------------------------------------- python: a sandboxed process
def python_tool(limits: SandboxLimits) -> Tool:
    """The ``python`` tool with ``limits`` (``env.sandbox``)."""

    def run_code(code: str) -> str:
        r = run_python(code, limits)
        if r.timed_out:
            raise RuntimeError(
                f"killed after {limits.wall_s:g} s (wall-clock limit); output so far: {r.stdout[-500:]!r}"
            )
        text = r.stdout + (f"\n[output cut at {limits.max_output_bytes} bytes]" if r.truncated else "")
        if r.returncode is not None and r.returncode < 0 and not r.truncated:
            sig = signal.Signals(-r.returncode).name
            limit = {"SIGXCPU": f"the CPU-time limit ({limits.cpu_s} s)", "SIGXFSZ": "the file-size limit"}
            raise RuntimeError(
                f"killed by {sig}" + (f": {limit[sig]}" if sig in limit else "") + f"\n{text[-2000:]}"
            )
        if r.returncode not in (0, None) and not r.truncated:
            raise RuntimeError(f"exit code {r.returncode}\n{text[-2000:]}")
        return text

    return Tool(
        "python",
        "Run Python 3 code in a sandbox (no network, limited time and memory) and return what it prints",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run_code,
    )


register_tool(python_tool(SandboxLimits()))
