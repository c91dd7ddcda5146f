"""Running model-written Python with limits: a separate process, its own temp dir, wall-clock,
CPU-time, memory, process-count and output-size limits, and no network where the OS allows it.

What it gives (Linux):
- ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (file size),
  ``RLIMIT_NPROC`` (processes; as root the child first drops to ``nobody``, since the limit does
  not bind root, and runs an interpreter ``nobody`` can execute: ``sys.executable`` if every
  directory above it is world-searchable, else the system's ``/usr/bin/python3``), a wall-clock timeout that kills the child's whole process group, output cut
  at ``max_output_bytes``, ``-I`` (no user site, no PYTHON* variables), an empty environment,
  cwd in a fresh temp dir that is deleted afterwards.
- A new network namespace (only loopback, down) when the process may create one (root, or
  unprivileged user namespaces); ``SandboxLimits.network`` says which one a run got.

What it does not give: a filesystem jail (the code can read what ``nobody`` may read), seccomp,
or protection from kernel exploits. Run untrusted code at scale in a container or VM sandbox.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 8192
    max_file_mb: int = 16


@dataclass
class SandboxResult:
    stdout: str
    returncode: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    truncated: bool  # output cut at max_output_bytes
    network_isolated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs first in the child (a fresh, single-threaded interpreter: subprocess's preexec_fn may
# deadlock in a process with threads, as the agent loop's tool pool is), then execs the code.
_BOOTSTRAP = """
import ctypes, os, resource, sys
exe, flag, workdir, mem, cpu, fsize, nproc, code = sys.argv[1:]
try:
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:  # CLONE_NEWNET
        os.close(os.open(flag, os.O_CREAT | os.O_WRONLY))
except (OSError, AttributeError):
    pass
for res, v in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (v, v))
resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
if os.getuid() == 0:  # RLIMIT_NPROC does not bind root
    os.chown(workdir, 65534, 65534)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
os.execv(exe, [exe, "-I", "-c", code])
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
    """Run ``code`` with ``python -I -c`` under ``limits``; stdout and stderr together."""
    workdir = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    flag = os.path.join(tempfile.mkdtemp(prefix="rlhf-sandbox-flag-"), "net")
    t0 = time.perf_counter()
    exe = interpreter()
    args = (
        exe,
        flag,
        workdir,
        limits.memory_mb << 20,
        limits.cpu_s,
        limits.max_file_mb << 20,
        limits.max_processes,
    )
    proc = subprocess.Popen(
        [exe, "-I", "-c", _BOOTSTRAP, *map(str, args), code],
        cwd=workdir,
        env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killed whole, forks included
    )
    out, truncated, timed_out = bytearray(), False, False
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        deadline = t0 + limits.wall_s
        while True:
            try:
                chunk = proc.stdout.read(65536)
            except BlockingIOError:
                chunk = None
            if chunk:
                out += chunk
                if len(out) > limits.max_output_bytes:
                    truncated = True
                    break
            elif chunk == b"" and proc.poll() is not None:
                break
            if time.perf_counter() > deadline:
                timed_out = True
                break
            time.sleep(0.005)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        isolated = os.path.exists(flag)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(flag), ignore_errors=True)
    text = bytes(out[: limits.max_output_bytes]).decode("utf-8", errors="replace")
    return SandboxResult(
        stdout=text,
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        truncated=truncated,
        network_isolated=isolated,
        wall_s=time.perf_counter() - t0,
    )
