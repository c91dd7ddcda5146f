"""math-verify in a process of its own, so that a check that runs away can be stopped.

math-verify bounds its own work with ``signal.alarm``, which works only on a process's main
thread, and a reward runs on a thread of the driver. Some checks never finish in useful time
(sympy expanding ``9^{9^{9}}``, a pathological LaTeX parse), and Python cannot stop a thread:
in the driver such a check would hold the step until ``reward.timeout_s`` and then keep a core
busy for the rest of the run. So the checks run here, one at a time, in one child process: a
check that takes longer than its budget (``reward.verify_timeout_s``) gets the child killed,
scores 0 and is counted (``reward/verify_timeouts``); the next check starts a fresh child.

The child reads one JSON request per line on stdin and answers one line on stdout. It exits
when its stdin closes (the driver ended, however it ended), ignores SIGINT and SIGTERM sent to
the process group (the driver decides how the run stops), and is killed at the driver's exit.

    python -m rlhf.rewards.verify_process     # the child; the driver starts it itself
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

__all__ = ["VerifyProcess", "check"]

START_TIMEOUT_S = 120.0  # importing sympy and math-verify on a loaded machine


def check(label: str, answer: str) -> float:
    """1.0 when math-verify finds ``answer`` equivalent to ``label``, else 0.0 (no time limit)."""
    from math_verify import parse, verify

    # Both timeouts off: this process is bounded from outside (VerifyProcess kills it).
    gold = parse(label if "$" in label or "\\" in label else f"${label}$", parsing_timeout=None)
    if not gold:
        return 0.0
    pred = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))


def _serve() -> None:
    """The child's loop: a request line in, a result line out, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.disable(logging.WARNING)  # math-verify's notices would reach the driver's console
    import math_verify  # noqa: F401 - paid once, before the first budgeted check

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"score": check(req["label"], req["answer"])}
        except Exception as e:  # the driver raises it as the reward call's error
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class VerifyProcess:
    """One child process running :func:`check`, each call bounded by a budget in seconds.

    Thread-safe: calls from several threads (training and evaluation rewards) take turns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.timeouts = 0  # checks stopped at their budget, over this object's life
        atexit.register(self.close)

    def check(self, label: str, answer: str, budget_s: float) -> float | None:
        """The score, or None when the check ran past ``budget_s`` (the child is killed)."""
        request = json.dumps({"label": label, "answer": answer}) + "\n"
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except BrokenPipeError:  # the child died between calls: one fresh try
                proc = self._start()
                proc.stdin.write(request)
                proc.stdin.flush()
            line = self._read_line(proc, budget_s)
            if line is None and proc.poll() is not None:  # it died on this check: not a timeout
                code = proc.returncode
                self._kill()
                raise RuntimeError(f"the math-verify process exited (code {code}) checking {answer!r}")
            if line is None:
                self.timeouts += 1
                self._kill()
                return None
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(
                f"math-verify failed on answer {answer!r} against label {label!r}: {reply['error']}"
            )
        return float(reply["score"])

    def _start(self) -> subprocess.Popen:
        self._kill()
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf.rewards.verify_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._proc = proc
        if self._read_line(proc, START_TIMEOUT_S) is None:
            self._kill()
            raise RuntimeError(
                f"the math-verify process did not start within {START_TIMEOUT_S:g} s "
                f"({sys.executable} -m rlhf.rewards.verify_process); is math-verify installed?"
            )
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, budget_s: float) -> str | None:
        """The child's next line, or None if none came within ``budget_s`` or it exited."""
        deadline = time.monotonic() + budget_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                line = proc.stdout.readline()  # the child writes whole lines, then flushes
                return line or None

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()

    def close(self) -> None:
        with self._lock:
            self._kill()


if __name__ == "__main__":
    _serve()
