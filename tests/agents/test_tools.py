"""Tools and the tool environment: every failure of a tool comes back as an observation the model
sees, within its limits, and the environment goes on (real sandbox processes, no mocks)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlhf.agents.bounded import BoundedCalls
from rlhf.agents.parser import ToolCall, parse_hermes
from rlhf.agents.sandbox import SandboxLimits, run_python
from rlhf.agents.tool_env import ToolEnv, ToolRunner
from rlhf.agents.tools import TOOLS, Tool, calculate, python_tool

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=16, max_output_bytes=4096)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env() -> ToolEnv:
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
    return ToolEnv(ToolRunner(tools, timeout_s=5.0, max_output_chars=300, calls=BoundedCalls(8, "tool")))


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


def _hang_forever() -> str:
    threading.Event().wait()
    return "never"


def _tool(name: str, fn) -> Tool:
    return Tool(name, name, {"type": "object", "properties": {}}, fn)


def test_hung_calls_do_not_starve_a_healthy_one():
    """Two hung calls on a 2-slot runner: each times out, and a healthy call after them runs
    (with a 2-thread pool it waited behind them and "timed out" without running)."""
    tools = {"hang": _tool("hang", _hang_forever), "ok": _tool("ok", lambda: "fine")}
    runner = ToolRunner(tools, timeout_s=0.5, max_output_chars=100, calls=BoundedCalls(2, "tool"))
    for _ in range(2):
        text, stats = runner.call(ToolCall("hang", {}))
        assert text == "error: hang timed out after 0.5 s" and stats.timeouts == 1
    t0 = time.perf_counter()
    text, stats = runner.call(ToolCall("ok", {}))
    assert (text, stats.timeouts, stats.errors) == ("fine", 0, 0)
    assert time.perf_counter() - t0 < 0.5
    assert runner.calls.abandoned == 2


def test_a_process_with_a_hung_tool_exits_when_its_work_is_done(tmp_path):
    """A tool that never returns must not keep the run's process alive after its summary
    (``concurrent.futures`` joins its workers at exit: the process hung until killed)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import threading\n"
        "from rlhf.agents.bounded import BoundedCalls\n"
        "from rlhf.agents.parser import ToolCall\n"
        "from rlhf.agents.tool_env import ToolRunner\n"
        "from rlhf.agents.tools import Tool\n"
        "def hang():\n    threading.Event().wait()\n"
        "t = Tool('hang', 'h', {'type': 'object', 'properties': {}}, hang)\n"
        "r = ToolRunner({'hang': t}, 0.5, 100, BoundedCalls(2, 'tool'))\n"
        "print(r.call(ToolCall('hang', {}))[0])\n"
        "print('summary', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "error: hang timed out after 0.5 s"
    assert proc.stdout.readline().strip() == "summary"
    t0 = time.monotonic()
    try:
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 5


def test_an_async_tool_is_cancelled_at_its_timeout():
    cancelled = threading.Event()

    async def slow() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    async def quick(x: int) -> dict:
        return {"x": x}

    tools = {
        "slow": _tool("slow", slow),
        "quick": Tool("quick", "q", {"type": "object", "properties": {"x": {"type": "integer"}}}, quick),
    }
    runner = ToolRunner(tools, timeout_s=0.3, max_output_chars=100, calls=BoundedCalls(1, "tool"))
    assert runner.call(ToolCall("slow", {}))[0] == "error: slow timed out after 0.3 s"
    assert cancelled.wait(5)
    assert runner.call(ToolCall("quick", {"x": 3}))[0] == '{"x": 3}'


@pytest.mark.parametrize(
    "value, seen",
    [
        ("text", "text"),
        ({"a": [1, 2], "b": "é"}, '{"a": [1, 2], "b": "é"}'),
        ([1, "two"], '[1, "two"]'),
        (None, "error: TypeError: r returned NoneType (None); a tool returns a str, or a dict or list"),
        (b"raw", "error: TypeError: r returned bytes (b'raw'); a tool returns a str, or a dict or list"),
        ({"s": {1, 2}}, "error: TypeError: r returned a dict that is not JSON"),
    ],
    ids=["str", "dict", "list", "none", "bytes", "unserialisable"],
)
def test_a_tools_return_value_is_text_json_or_an_error(value, seen):
    runner = ToolRunner({"r": _tool("r", lambda: value)}, 2.0, 1000, BoundedCalls(1, "tool"))
    text, stats = runner.call(ToolCall("r", {}))
    assert text.startswith(seen), text
    assert stats.errors == (1 if seen.startswith("error:") else 0)


def _processes_with(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]


@pytest.mark.parametrize("namespaces", [True, False], ids=["pid_namespace", "subreaper"])
def test_no_process_the_code_started_outlives_the_call(namespaces):
    """setsid'd and double-forked children are killed at the end of the call, and a background
    child holding stdout open does not turn a finished call into a wall-clock timeout."""
    marker = f"{time.time_ns() % 10**9}"  # sleep's argument: finds exactly this test's children
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}1'], start_new_session=True, stdout=subprocess.DEVNULL)\n"
        f"subprocess.Popen(['sleep', '{marker}2'])\n"  # keeps stdout open
        f"if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '{marker}3'])\n"
        "print('done', flush=True)\n"
    )
    limits = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256, namespaces=namespaces)
    r = run_python(code, limits)
    assert r.stdout == "done\n" and r.returncode == 0 and not r.timed_out, r
    assert r.wall_s < 2.0, f"took {r.wall_s:.1f} s"
    assert _processes_with(marker) == []
    if namespaces:
        assert "pid" in r.isolation and "network" in r.isolation, r.isolation
    else:
        assert r.isolation == () and not r.network_isolated


def test_without_root_the_sandbox_still_gets_its_namespaces():
    """As a non-root user (nobody) the sandbox gets network and PID namespaces through a user
    namespace of its own (unshare(CLONE_NEWNET) alone needs root), so loopback is unreachable."""
    import os
    import shutil
    import tempfile

    if os.getuid() != 0:
        pytest.skip("the test drops to nobody, which needs root")
    system_python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if system_python is None:
        pytest.skip("no system python3 that nobody can run")
    tmp_path = Path(tempfile.mkdtemp(prefix="rlhf-nobody-"))  # pytest's tmp dirs are root's only
    module = tmp_path / "sandbox_copy.py"  # nobody may not read the checkout
    shutil.copy(Path(run_python.__code__.co_filename), module)
    script = tmp_path / "as_nobody.py"
    script.write_text(
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(module)!r})\n"
        "sb = importlib.util.module_from_spec(spec); sys.modules['sb'] = sb; spec.loader.exec_module(sb)\n"
        "code = 'import os, socket\\nprint(os.getuid())\\nsocket.create_connection((\"127.0.0.1\", 22), timeout=1)'\n"
        "r = sb.run_python(code, sb.SandboxLimits(wall_s=5.0))\n"
        "print(json.dumps({'isolation': r.isolation, 'out': r.stdout}))\n"
    )
    os.chmod(tmp_path, 0o755)
    for f in (module, script):
        os.chmod(f, 0o644)

    def as_nobody() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    try:
        done = subprocess.run(
            [system_python, str(script)], preexec_fn=as_nobody, capture_output=True, text=True, cwd="/tmp",
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, timeout=60,
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    if "user" not in got["isolation"]:
        pytest.skip(f"user namespaces are not allowed here: {got}")
    assert got["isolation"] == ["user", "pid", "network"]
    assert "65534\n" in got["out"] and "Network is unreachable" in got["out"], got
