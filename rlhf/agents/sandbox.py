"""Running model-written Python with limits: a separate process, its own temp dir, wall-clock,
CPU-time, memory, process-count and output-size limits, and no network where the OS allows it.

What it gives (Linux):
- ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (file size),
  ``RLIMIT_NPROC`` (processes; as root the child first drops to ``nobody``, since the limit does
  not bind root, and runs an interpreter ``nobody`` can execute: ``sys.executable`` if every
  directory above it is world-searchable, else the system's ``/usr/bin/python3``), output cut
  at ``max_output_bytes``, ``-I`` (no user site, no PYTHON* variables), an empty environment,
  cwd in a fresh temp dir that is deleted afterwards.
- New PID and network namespaces (only loopback, down) where the OS allows: as root directly,
  otherwise inside a user namespace of its own (unprivileged user namespaces). The call returns
  when the code's own process ends, and no process it started survives the call: the kernel
  kills the rest of the PID namespace, and without one the bootstrap (a child subreaper) kills
  every descendant, ``setsid`` or double-forked ones included. A background child that keeps
  stdout open does not turn a finished call into a wall-clock timeout.
- ``SandboxResult.isolation`` names the namespaces a call got; the first call of a process logs
  them, with a warning when there is no network namespace.

What it does not give: a filesystem jail (the code can read what ``nobody`` may read), seccomp,
or protection from kernel exploits. Run untrusted code at scale in a container or VM sandbox.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger("rlhf")

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 8192
    max_file_mb: int = 16
    # False: no namespaces, what a container that forbids unshare gives; the code's descendants
    # are still killed at the end of the call (subreaper tracking), but the network is reachable
    namespaces: bool = True


@dataclass
class SandboxResult:
    stdout: str
    returncode: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    truncated: bool  # output cut at max_output_bytes
    network_isolated: bool
    wall_s: float
    isolation: tuple[str, ...] = ()  # namespaces the code ran in: "user", "pid", "network"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs first in the child (a fresh, single-threaded interpreter: subprocess's preexec_fn may
# deadlock in a process with threads, as the agent loop's tool pool is). It keeps the clock and
# makes sure no process the code started outlives the call:
# - new PID (and network) namespaces where the OS allows (root, or a user namespace of its own
#   when not root): the code runs as PID 2 under a minimal init (PID 1); when the code's process
#   ends, init exits and the kernel kills everything else in the namespace, setsid'd or not;
# - always a child subreaper: an orphan (double fork, setsid) is re-parented to this process,
#   which kills every remaining descendant once the code's process ended or the wall clock ran out.
# What it got and how the code ended go to the report file as JSON.
_BOOTSTRAP = """
import ctypes, json, os, resource, signal, sys, time
exe, report, workdir, mem, cpu, fsize, nproc, wall, namespaces, code = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
uid, gid, root = os.getuid(), os.getgid(), os.getuid() == 0
isolation = []
for flags in ((NEWPID | NEWNET, NEWNET) if root else (NEWUSER | NEWPID | NEWNET, NEWUSER | NEWNET)) * (namespaces == "1"):
    if libc.unshare(flags) == 0:
        isolation = [n for bit, n in ((NEWUSER, "user"), (NEWPID, "pid"), (NEWNET, "network")) if flags & bit]
        break
if "user" in isolation:  # the same ids inside, so files and limits work as before
    for f, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{f}", "w") as fh:
            fh.write(text)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

def run_code():
    for res, v in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (v, v))
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
    if root:  # RLIMIT_NPROC does not bind root
        os.chown(workdir, 65534, 65534)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
    os.execv(exe, [exe, "-I", "-c", code])

r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    try:
        if "pid" not in isolation:
            run_code()
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: init dies with this process
        code_pid = os.fork()
        if code_pid == 0:
            run_code()
        status = os.waitpid(code_pid, 0)[1]
        os.write(w, str(status).encode())
    finally:
        os._exit(0)  # init's exit kills every process left in the namespace
os.close(w)
deadline, status, timed_out = time.monotonic() + float(wall), None, False
while True:
    pid, st = os.waitpid(child, os.WNOHANG)
    if pid:
        status = st
        break
    if time.monotonic() > deadline:
        timed_out = True
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        break
    time.sleep(0.005)
if "pid" in isolation:
    relayed = os.read(r, 64)
    status = int(relayed) if relayed else status
left = 0
while True:  # every descendant, re-parented to this subreaper as its parents die
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid:
        continue
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()[1] == str(os.getpid()):
                os.kill(int(entry), signal.SIGKILL)
                left += 1
        except (OSError, IndexError):
            pass
    time.sleep(0.005)
rc = None if status is None else (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
with open(report, "w") as fh:
    json.dump({"isolation": isolation, "returncode": rc, "timed_out": timed_out, "killed_descendants": left}, fh)
"""


def _world_executable(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(os.stat(real).st_mode & 0o001)


def interpreter() -> str:
    """The Python the sandbox runs (see the module docstring)."""
    if os.getuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return candidate
    raise RuntimeError(
        f"the python tool runs code as 'nobody', who cannot execute {sys.executable} (a directory above it "
        "is not world-searchable) and there is no /usr/bin/python3: install a system python3"
    )


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` with ``python -I -c`` under ``limits``; stdout and stderr together. Returns
    when the code's own process ends (or the wall clock runs out), with every process it started
    killed, whether or not one still holds its stdout."""
    workdir = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    report_dir = tempfile.mkdtemp(prefix="rlhf-sandbox-report-")
    report = os.path.join(report_dir, "report.json")
    t0 = time.perf_counter()
    exe = interpreter()
    args = (
        exe,
        report,
        workdir,
        limits.memory_mb << 20,
        limits.cpu_s,
        limits.max_file_mb << 20,
        limits.max_processes,
        limits.wall_s,
        int(limits.namespaces),
    )
    proc = subprocess.Popen(
        [exe, "-I", "-c", _BOOTSTRAP, *map(str, args), code],
        cwd=workdir,
        env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the backstop below kills it whole
    )
    out, truncated = bytearray(), False
    try:
        out, truncated = _read_until_exit(proc, limits, t0 + limits.wall_s + _BACKSTOP_S)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        try:
            with open(report) as f:
                got = json.load(f)
        except (OSError, ValueError):  # the bootstrap itself was killed (backstop)
            got = {"isolation": [], "returncode": None, "timed_out": True}
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(report_dir, ignore_errors=True)
    _log_isolation_once(got["isolation"])
    text = bytes(out[: limits.max_output_bytes]).decode("utf-8", errors="replace")
    return SandboxResult(
        stdout=text,
        returncode=None if got["timed_out"] else got["returncode"],
        timed_out=got["timed_out"],
        truncated=truncated,
        network_isolated="network" in got["isolation"],
        wall_s=time.perf_counter() - t0,
        isolation=tuple(got["isolation"]),
    )


# The bootstrap keeps the wall clock; this is the host's own bound in case it cannot.
_BACKSTOP_S = 2.0


def _read_until_exit(
    proc: subprocess.Popen, limits: SandboxLimits, deadline: float
) -> tuple[bytearray, bool]:
    """The code's output until the bootstrap exits (a background child that kept stdout open is
    dead by then), the output limit, or ``deadline``."""
    out, exited_at = bytearray(), None
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        try:
            chunk = proc.stdout.read(65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            out += chunk
            if len(out) > limits.max_output_bytes:
                return out, True
            continue
        now = time.perf_counter()
        if chunk == b"" or now > deadline or (exited_at is not None and now - exited_at > 0.5):
            return out, False
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        time.sleep(0.005)


_logged: list[tuple[str, ...]] = []


def _log_isolation_once(isolation: list[str]) -> None:
    """Say once per process which namespaces the python tool gets (and warn without a network one)."""
    key = tuple(isolation)
    if key in _logged:
        return
    _logged.append(key)
    got = ", ".join(isolation) or "none"
    if "network" in isolation:
        log.info("python tool sandbox: namespaces in force: %s", got)
    else:
        log.warning(
            "python tool sandbox: no network namespace (namespaces in force: %s): the code can reach this "
            "machine's network; allow user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as root",
            got,
        )
