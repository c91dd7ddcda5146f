"""The local Ray head a driver starts lives in a session of its own: a signal to the driver's
process group does not reach it, and it goes away with the driver however the driver ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.workers.local_ray import session_pids

pytestmark = pytest.mark.e2e

DRIVER = """
import sys, time, ray
from rlhf.workers.local_ray import LocalRay
head = LocalRay(1)
address = head.start(120)
ray.init(address=address, logging_level="ERROR")
print(head.proc.pid, flush=True)
try:
    time.sleep(600)
finally:
    print("driver still talks to ray:", ray.get(ray.put(7)) == 7, flush=True)
"""


def _wait_gone(sid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not session_pids(sid)


def test_a_group_signal_leaves_the_head_up_for_the_driver_and_sigkill_takes_it_down():
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        sid = int(proc.stdout.readline())
        assert len(session_pids(sid)) > 2  # supervisor, GCS, raylet, ...
        # SIGTERM to the driver's whole group: the driver's own cleanup still reaches Ray
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "driver still talks to ray: True" in out, out
        assert _wait_gone(sid, 30), "the head outlived its driver"
        assert not (os.path.exists(f"/tmp/rlhf-ray-{sid}"))
    finally:
        proc.kill()
    # a driver killed outright (no cleanup at all) takes its head with it too
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        sid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(10)
        assert _wait_gone(sid, 30), "the head outlived a SIGKILLed driver"
    finally:
        proc.kill()
