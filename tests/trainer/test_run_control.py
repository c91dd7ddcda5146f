"""Checkpoint policy, resume rules, signal handling and metrics bookkeeping (no Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlhf.trainer.checkpoint import latest_checkpoint, prune_checkpoints
from rlhf.trainer.run_control import CheckpointPolicy, GracefulStop, Preempted, resolve_resume
from rlhf.trainer.tracking import Tracker


def _fake_checkpoint(out, step, latest=True):
    d = out / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    if latest:
        (out / "checkpoints" / "latest").write_text(d.name)
    return d


def test_checkpoint_policy_steps_minutes_last_and_stop():
    now = [0.0]
    p = CheckpointPolicy(every_steps=3, every_min=2.0, clock=lambda: now[0])
    assert [s for s in range(1, 8) if p.due(s, False, False)] == [3, 6]
    now[0] = 119.0
    assert not p.due(1, False, False)
    now[0] = 120.0
    assert p.due(1, False, False)
    p.saved()
    assert not p.due(1, False, False)
    assert p.due(1, False, True) and p.due(1, True, False)
    # Nothing periodic wanted: no checkpoint at the end either, but a stop still saves.
    off = CheckpointPolicy(0, 0.0)
    assert not off.due(10, True, False) and off.due(10, False, True)


def test_resume_modes(tmp_path):
    assert resolve_resume(tmp_path, "auto") is None
    with pytest.raises(FileNotFoundError, match=r"train.resume=true but .*latest does not exist"):
        resolve_resume(tmp_path, "true")
    d = _fake_checkpoint(tmp_path, 4)
    assert resolve_resume(tmp_path, "auto") == str(d) == resolve_resume(tmp_path, "true")
    # false: start over, and never let a recovery of this run pick up the old state
    assert resolve_resume(tmp_path, "false") is None
    assert latest_checkpoint(tmp_path) is None and d.is_dir()


def test_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_7")
    with pytest.raises(FileNotFoundError, match="names step_7, which has no trainer_state.json"):
        latest_checkpoint(tmp_path)


def test_prune_keeps_the_newest_and_latest(tmp_path):
    for s in (2, 4, 10, 12):
        _fake_checkpoint(tmp_path, s, latest=False)
    (tmp_path / "checkpoints" / "latest").write_text("step_2")  # e.g. resumed from an older one
    prune_checkpoints(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert left == ["step_10", "step_12", "step_2"]
    prune_checkpoints(tmp_path, keep=0)  # 0 = keep all
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 3


def test_tracker_cuts_metrics_back_to_the_resumed_step(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1}] + [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')  # cut by a kill
    tr = Tracker(str(tmp_path), 6, tensorboard=False, start_step=2)
    tr.log(3, {"loss": 30.0})
    tr.close()
    written = [json.loads(x) for x in path.read_text().splitlines()]
    assert written == [*rows[:3], {"step": 3, "loss": 30.0}]
    assert tr.history == written
    # A fresh run (step 0) starts the file over.
    Tracker(str(tmp_path), 6, tensorboard=False, start_step=0).close()
    assert path.read_text() == ""


def test_preempted_says_how_to_resume(tmp_path):
    e = Preempted(signal.SIGTERM, 4, tmp_path / "checkpoints" / "step_4")
    assert e.exit_code == 143
    assert "stopped by SIGTERM after step 4" in str(e) and "run the same command again" in str(e)


def test_signal_sets_the_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop(grace_s=60) as stop:
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while stop.requested is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.requested == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is before


def test_watchdog_exits_when_no_checkpoint_comes_within_the_grace():
    script = textwrap.dedent(
        """
        import logging, os, signal, time
        from rlhf.trainer.run_control import GracefulStop
        logging.basicConfig(level=logging.INFO)
        with GracefulStop(grace_s=1.0, describe_fallback=lambda: "runs/x/checkpoints/step_3"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a step far longer than the grace
        """
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert time.monotonic() - t0 < 20
    assert "no checkpoint within train.stop_grace_s=1" in proc.stderr
    assert "runs/x/checkpoints/step_3 in force" in proc.stderr
