"""Keeping a run alive: when to checkpoint, whether to resume, stopping on SIGTERM/SIGINT.

Preemption (Kubernetes sends SIGTERM, then SIGKILL after the pod's grace period): the
handler only raises a flag. The driver checks it at safe points (a batch taken but not yet
trained on is set aside into the checkpoint; a step that has started training finishes),
saves, and raises ``Preempted``; the entry point shuts Ray down and exits with 128 + the
signal number. A watchdog bounds it all by ``train.stop_grace_s``: past it, the process
exits with the last complete checkpoint in force (``latest`` is replaced atomically, so a
half-written one is never used). A second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TypeVar

from rlhf.storage import redact
from rlhf.trainer.checkpoint import forget_latest, latest_checkpoint

log = logging.getLogger("rlhf")
T, R = TypeVar("T"), TypeVar("R")

__all__ = ["CheckpointPolicy", "GracefulStop", "Preempted", "exit_on_preemption", "resolve_resume"]


class Preempted(Exception):
    """The run stopped on a signal after saving ``checkpoint`` (None: nothing to save yet)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {redact(checkpoint)}" if checkpoint else "no checkpoint (nothing trained yet)"
        super().__init__(
            f"stopped by {name} after step {step}; {where}. To continue, run the same command again "
            "(train.resume=auto, the default, picks up <train.output_dir>/checkpoints/latest)"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """SIGTERM/SIGINT handlers for the span of a ``with`` block (main thread only).

    ``requested`` is the signal number once one arrived. The first signal also starts a
    watchdog that exits the process ``grace_s`` later unless ``finished()`` was called.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float, describe_fallback: Callable[[], str] = lambda: "no checkpoint yet"):
        self.grace_s = grace_s
        self.describe_fallback = describe_fallback  # names the checkpoint in force, for the log
        self.requested: int | None = None
        self._done = threading.Event()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            # Replaces Ray's driver handler (sys.exit on SIGTERM: no checkpoint, no cleanup).
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished()
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def finished(self) -> None:
        self._done.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait
            return
        self.requested = signum
        log.warning(
            "received %s: finishing the step in flight, saving a checkpoint and exiting within "
            "train.stop_grace_s=%.0f s",
            signal.Signals(signum).name,
            self.grace_s,
        )
        threading.Thread(
            target=self._watchdog, args=(signum,), name="rlhf-stop-watchdog", daemon=True
        ).start()

    def _watchdog(self, signum: int) -> None:
        if self._done.wait(self.grace_s):
            return
        log.error(
            "no checkpoint within train.stop_grace_s=%.0f s of %s (a step takes longer than the grace); "
            "exiting with %s in force. Run the same command again to continue from it",
            self.grace_s,
            signal.Signals(signum).name,
            self.describe_fallback(),
        )
        logging.shutdown()
        os._exit(128 + signum)


class CheckpointPolicy:
    """When a step ends with a checkpoint: every ``every_steps`` steps, when ``every_min``
    minutes passed since the last one, at the last step (unless both are 0: no periodic
    checkpoints wanted), and always on a stop request."""

    def __init__(self, every_steps: int, every_min: float, clock: Callable[[], float] = time.monotonic):
        self.every_steps, self.every_s, self.clock = every_steps, every_min * 60.0, clock
        self.last = clock()

    def due(self, step: int, last_step: bool, stopping: bool) -> bool:
        if stopping:
            return True
        if last_step:
            return bool(self.every_steps or self.every_s)
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_s) and self.clock() - self.last >= self.every_s

    def saved(self) -> None:
        self.last = self.clock()


def resolve_resume(output_dir: str | Path, mode: str) -> str | None:
    """The checkpoint to continue from under ``train.resume=mode``, or None to start at step 0.

    ``true`` without a checkpoint is an error (it would silently start over); ``false`` with
    one detaches it from ``latest`` (kept on disk), so that a later automatic recovery of
    this run cannot resume an older run's state.
    """
    found = latest_checkpoint(output_dir)
    if mode == "true" and found is None:
        raise FileNotFoundError(
            f"train.resume=true but {output_dir}/checkpoints/latest does not exist: nothing to "
            "resume from. Check train.output_dir, or use train.resume=auto to start fresh when there is none"
        )
    if mode == "false" and found is not None:
        log.warning(
            "train.resume=false: starting at step 0; the earlier checkpoint %s stays on disk but is no "
            "longer `latest`, and metrics.jsonl starts over",
            redact(found),
        )
        forget_latest(output_dir)
        return None
    if found is not None:
        log.info("resuming from %s (train.resume=%s)", redact(found), mode)
    return found


def exit_on_preemption(run: Callable[[T], R], cfg: T) -> R:
    """``run(cfg)`` for an entry point's ``main``: a ``Preempted`` run shuts Ray down and exits
    with 128 + the signal number (what a process killed by it would report), after saying how
    to resume."""
    try:
        return run(cfg)
    except Preempted as e:
        log.warning("%s", e)
        import ray

        if ray.is_initialized():
            ray.shutdown()
        raise SystemExit(e.exit_code) from None
