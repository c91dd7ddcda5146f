"""Tools and the tool environment: every failure of a tool comes back as an observation the model
sees, within its limits, and the environment goes on (real sandbox processes, no mocks)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf.agents.parser import parse_hermes
from rlhf.agents.sandbox import SandboxLimits, run_python
from rlhf.agents.tool_env import ToolEnv, ToolRunner
from rlhf.agents.tools import TOOLS, Tool, calculate, python_tool

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=16, max_output_bytes=4096)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    def hang() -> str:
        time.sleep(8)  # past the runner's timeout; the thread is left to finish
        return "never"

    def crash() -> str:
        raise KeyError("the tool's own bug")

    tools = {
        "calculator": TOOLS["calculator"],
        "python": python_tool(LIMITS),
        "hang": Tool("hang", "sleeps", {"type": "object", "properties": {}}, hang),
        "crash": Tool("crash", "raises", {"type": "object", "properties": {}}, crash),
    }
    pool = ThreadPoolExecutor(8)
    yield ToolEnv(ToolRunner(tools, timeout_s=5.0, max_output_chars=300, pool=pool))
    pool.shutdown(wait=False, cancel_futures=True)


def test_calculator_is_arithmetic_only():
    assert (
        calculate("123 * 4567") == "561741"
        and calculate("(7 - 2) / 2") == "2.5"
        and calculate("2**10") == "1024"
    )
    for bad in ("__import__('os').system('true')", "open('/etc/passwd')", "9**9**9", "x + 1", "[1] * 10**9"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


@pytest.mark.parametrize(
    "code, expect",
    [
        ("while True: pass", "CPU-time limit (2 s)"),
        ("import time\ntime.sleep(60)", "killed after 3 s"),
        ("x = bytearray(2 * 1024**3)", "MemoryError"),
        (
            "import os\nwhile True:\n    os.fork()",
            "",
        ),  # the fork loop dies on the process limit or the wall clock
        ("print('y' * 10**7)", "[cut at 300 characters]"),
        ("raise SystemExit(3)", "exit code 3"),
    ],
    ids=["infinite_loop", "sleeper", "memory_hog", "fork_loop", "huge_print", "crash"],
)
def test_each_python_failure_is_an_error_observation_within_its_limits(env, code, expect):
    t0 = time.perf_counter()
    res = env.step(_call("python", code=code))
    took = time.perf_counter() - t0
    assert not res.done and len(res.messages) == 1 and res.tools.calls == 1
    text = res.messages[0]["content"]
    assert expect in text, text[:500]
    assert took < LIMITS.wall_s + 3, f"took {took:.1f} s"
    if expect != "[cut at 300 characters]":  # a cut output is an answer, not an error
        assert text.startswith("error:") and res.tools.errors + res.tools.timeouts == 1
    assert len(text) <= 300 + 40  # env.max_tool_output_chars


def test_the_sandbox_has_no_network_and_a_private_dir():
    r = run_python(
        "import os, socket\nprint(os.getcwd())\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        LIMITS,
    )
    assert "rlhf-sandbox-" in r.stdout and r.returncode != 0
    if r.network_isolated:  # a new network namespace: not even loopback is up
        assert "Network is unreachable" in r.stdout or "Cannot assign" in r.stdout, r.stdout


def test_hanging_crashing_unknown_and_malformed_calls(env):
    t0 = time.perf_counter()
    res = env.step(
        _call("hang") + _call("crash") + _call("nope") + _call("calculator", expression="6 * 7", extra=1)
        + "<tool_call>{not json}</tool_call>" + _call("calculator", expression="6 * 7")
    )  # fmt: skip
    assert time.perf_counter() - t0 < 8
    texts = [m["content"] for m in res.messages]
    assert texts[0].startswith("error: malformed tool call: not JSON")
    assert texts[1] == "error: hang timed out after 5 s"
    assert texts[2].startswith("error: KeyError")
    assert texts[3].startswith("error: ToolArgumentError: no tool named 'nope'")
    # max_calls_per_turn=4: the fifth call is refused, not run
    assert "unknown extra" in texts[4] and texts[5] == "error: more than 4 calls in one turn"
    s = res.tools
    assert (s.calls, s.timeouts, s.malformed, s.errors) == (4, 1, 1, 3 + 1)
    # and the environment still works
    ok = env.step(_call("calculator", expression="6 * 7"))
    assert ok.messages == [{"role": "tool", "name": "calculator", "content": "42"}]


def test_a_turn_without_calls_is_the_final_answer(env):
    res = env.step("the answer is 42")
    assert res.done and res.reward is None and res.tools.calls == 0


def test_parser_reads_hermes_calls_and_names_what_is_malformed():
    p = parse_hermes(
        'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>{"x": 1}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"x": 1})] and "expected" in p.malformed[0]
    assert parse_hermes("<tool_call>{}").malformed == ["a <tool_call> without </tool_call>"]
