"""Tool-call parsers: the policy's text -> the calls in it. The Hermes/Qwen format is built in;
another format is a function registered in ``PARSERS`` (``env.tool_parser``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARSERS", "ParsedTurn", "ToolCall", "parse_hermes"]


@dataclass
class ToolCall:
    name: str
    arguments: Any


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # why each unreadable call was refused


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5/3)."""
    out = ParsedTurn()
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            out.malformed.append("a <tool_call> without </tool_call>")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.malformed.append(f"not JSON ({e.msg} at {e.pos}): {body[:200]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.malformed.append(f'expected {{"name": ..., "arguments": {{...}}}}, got {body[:200]!r}')
            continue
        out.calls.append(ToolCall(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return out


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
