"""End to end: launch/submit.sh against a private local Ray head, with the real runtime_env.yaml.

The head runs in its own session (setsid) with its own temp dir and ports, and teardown kills
exactly that session: `ray stop` would also take down Ray instances that other tests, or other
people, run on the same machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "launch" / "submit.sh"
RUNTIME_ENV = REPO / "launch" / "runtime_env.yaml"
STARTUP_TIMEOUT_S = 60
JOB_TIMEOUT_S = 120


def _ray_cli() -> str | None:
    # Prefer the ray next to the running interpreter so the head, the job driver (`python` from
    # the head's PATH) and this test all share one environment.
    beside = Path(sys.executable).with_name("ray")
    if beside.exists():
        return str(beside)
    return shutil.which("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except OSError:  # exited meanwhile
            continue
    return pids


def _kill_session(sid: int, grace_s: float = 5.0) -> None:
    """Stops every process of one session: Ray re-parents idle workers to init and gives them their
    own process group, so neither the child tree nor the process group covers them; the session does."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_pids(sid):
            with contextlib.suppress(OSError):  # exited meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            alive = [p for p in _session_pids(sid) if not _is_zombie(p)]
            if not alive:
                return
            time.sleep(0.2)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the parenthesised command name, which may itself hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class RayHead:
    dashboard_url: str
    env: dict[str, str]
    log: Path


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    ray = _ray_cli()
    if ray is None:
        pytest.skip("`ray` CLI not found beside the interpreter or on PATH (pip install 'ray[default]')")
    # Unix socket paths under the session dir must stay below ~107 bytes, which pytest's tmp_path
    # can exceed; a short /tmp prefix keeps them valid.
    temp_dir = Path(tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"))
    dash_port = _free_port()
    env = dict(os.environ)
    env["PATH"] = f"{Path(ray).parent}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    # Workers inherit the head's environment; without runtime_env.yaml's variables there (the
    # test conftest exports some), the probe can only see them through the runtime_env.
    for var in yaml.safe_load(RUNTIME_ENV.read_text())["env_vars"]:
        env.pop(var, None)
    # Ray 2.60 turns token auth on by itself once ~/.ray/auth_token exists (any local ray.init()
    # writes one), which would make this test depend on other runs. Token mode with a private token
    # pins it down and covers the auth Ray now defaults to: the head and the `ray job submit` inside
    # submit.sh both read RAY_AUTH_TOKEN.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # Every port is chosen here: Ray's defaults (10001, 52365, ...) would collide with another
    # head on the same machine.
    cmd = [
        ray, "start", "--head", "--block", "--num-cpus=2", "--include-dashboard=true",
        "--disable-usage-stats", "--temp-dir", str(temp_dir),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
        "--port", str(_free_port()),
        "--ray-client-server-port", str(_free_port()),
        "--dashboard-agent-listen-port", str(_free_port()),
        "--dashboard-agent-grpc-port", str(_free_port()),
        "--runtime-env-agent-port", str(_free_port()),
        "--metrics-export-port", str(_free_port()),
        "--node-manager-port", str(_free_port()),
        "--object-manager-port", str(_free_port()),
    ]  # fmt: skip
    log = temp_dir / "ray-start.log"
    with open(log, "w") as out:
        # --block keeps `ray start` in the foreground, so every Ray process it spawns inherits this
        # new session and teardown can find them all.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{log.read_text()}")
            request = urllib.request.Request(
                f"{url}/api/version", headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=2) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:
                pytest.fail(f"Ray dashboard answered {e.code} to /api/version:\n{log.read_text()}")
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"Ray dashboard not up after {STARTUP_TIMEOUT_S}s:\n{log.read_text()}")
            time.sleep(0.5)
        yield RayHead(dashboard_url=url, env=env, log=log)
    finally:
        _kill_session(proc.pid)
        proc.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submit_probe_through_runtime_env(ray_head: RayHead) -> None:
    # Run from elsewhere: submit.sh has to find the repo root itself for working_dir "." to work.
    result = subprocess.run(
        [str(SUBMIT), "--address", ray_head.dashboard_url, "--entry", "rlhf.launch_probe",
         "--", "trainer.seed=7", "note=two words"],
        cwd=tempfile.gettempdir(), env=ray_head.env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "probe ok 42" in out, out
    # Proves runtime_env.yaml's env_vars reached a worker, not just the driver.
    assert (
        "probe env HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0" in out
    ), out
    assert "probe argv ['trainer.seed=7', 'note=two words']" in out, out


def test_submit_failing_entry_exits_nonzero(ray_head: RayHead) -> None:
    # A failed job must fail the wrapper, or CI and schedulers would report success.
    result = subprocess.run(
        [str(SUBMIT), "--address", ray_head.dashboard_url, "--entry", "rlhf.no_such_module_for_probe"],
        env=ray_head.env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout + result.stderr
    assert "No module named rlhf.no_such_module_for_probe" in result.stdout + result.stderr


# The real entry point as a Ray Job (init_ray joining the job's cluster and runtime_env) runs in
# tests/launch/test_local_cluster.py: GRPO jobs through submit.sh on a cluster of four nodes.
