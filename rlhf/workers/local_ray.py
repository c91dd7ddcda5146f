"""A local Ray instance that a signal to the driver's process group does not kill.

Ctrl-C in a terminal, ``timeout``, ``kill -- -PGID`` and container runtimes signal the whole
process group. A Ray started by ``ray.init()`` in the driver is in that group: its GCS dies
with the SIGTERM the driver is still handling (checkpoint, then exit 143), and the driver's
next Ray call waits 60 s for a GCS that is gone. So the head is started by a small supervisor
in a session of its own (``start_new_session``), which the group's signal does not reach, and
the driver stops it when it is done.

The supervisor holds the read end of a pipe whose write end only the driver has: when the
driver closes it (``stop``) or dies in any way (SIGKILL included), the supervisor kills every
process of its session (the head and the workers it started), deletes the head's temp dir
(its own, so that a plain ``ray.init()`` elsewhere never finds this head) and exits. Nothing outlives the
driver and nothing touches another Ray on the machine (``ray stop`` would).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("rlhf")

__all__ = ["LocalRay", "session_pids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Every live process whose session id is ``sid`` (from /proc; zombies left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after "(comm)", which may hold spaces
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int, grace_s: float = 1.0, spare: int | None = None) -> None:
    """SIGTERM every process of session ``sid`` (but ``spare``), SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = [p for p in session_pids(sid) if p != spare]
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [p for p in session_pids(sid) if p != spare]
        if not pids:
            return


def _same_auth_as_ray_init() -> None:
    """Token authentication as a plain local ``ray.init()`` sets it up (on unless RAY_AUTH_MODE
    says otherwise; a token in ~/.ray/auth_token, made if missing), in this process's environment
    so that the head inherits it. ``ray start`` alone turns it on only when the token file exists,
    and a driver joining an explicit address never does: they would disagree."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    # Ray warns on the console that token auth is on, at every start: what ray.init does, as expected
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notices.level
    notices.setLevel(logging.ERROR)
    try:
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled({}, create_token_if_missing=True)
    finally:
        notices.setLevel(level)
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    log.info("starting a local Ray (token authentication %s)", "on" if mode == "token" else mode)


class LocalRay:
    """``start()`` a Ray head of ``num_cpus`` CPUs in a session of its own; ``stop()`` ends it."""

    def __init__(self, num_cpus: int):
        self.num_cpus = num_cpus
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout_s: float) -> str:
        """The head's address once it answers; ``TimeoutError`` (head stopped) if it does not
        within ``timeout_s``."""
        _same_auth_as_ray_init()
        cmd = [sys.executable, "-m", "rlhf.workers.local_ray", str(self.num_cpus)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        atexit.register(self.stop)  # runs before Ray's own exit hook (registered at import)
        deadline = time.monotonic() + timeout_s
        os.set_blocking(self.proc.stdout.fileno(), False)
        out = b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            out += self.proc.stdout.read() or b""
            if b"\n" in out:
                self.address = out.split(b"\n", 1)[0].decode().strip()
                return self.address
            time.sleep(0.05)
        rc = self.proc.poll()
        self.stop()
        raise TimeoutError(
            f"the local Ray head did not start within cluster.ray_start_timeout_s={timeout_s:g} s "
            f"(supervisor exit code {rc}; its error, if any, is above)"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Disconnect this process from Ray, close the supervisor's pipe and wait for it to take
        the head down (disconnecting first: Ray's own exit hook would wait for a head that is gone)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        import ray

        if ray.is_initialized():
            ray.shutdown()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid, grace_s=0.0)
        proc.stdout.close()


def _supervise(num_cpus: int) -> int:
    """The supervisor (``python -m rlhf.workers.local_ray N``): start the head, print its
    address, wait for stdin to close, kill this session."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver decides when the head stops
    port = _free_port()
    # A temp dir of its own: Ray writes its address to <temp dir>/ray_current_cluster, and a plain
    # ray.init() anywhere on the machine would join (or, once stopped, fail on) the default one.
    temp_dir = Path(tempfile.gettempdir()) / f"rlhf-ray-{os.getpid()}"  # short: socket paths < 108 bytes
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",  # the `ray` CLI of this interpreter's Ray
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        # Ray's fixed defaults collide with any other Ray on the machine (a test's own)
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
    ]
    try:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rc = done.returncode
        if rc != 0:
            print(f"`ray start --head` failed (exit code {rc}):\n{done.stderr[-4000:]}", file=sys.stderr)
        else:
            print(f"127.0.0.1:{port}", flush=True)
            sys.stdin.read()  # returns at EOF: the driver closed the pipe or died
    finally:
        kill_session(os.getsid(0), spare=os.getpid())
        shutil.rmtree(temp_dir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(_supervise(int(sys.argv[1])))
