"""Where a step's time goes: named phases timed into ``time/<phase>_s`` metrics.

Phases of an RL step: ``generate``, ``reward`` (both in the rollout, possibly on the producer
thread ahead of the trainer), ``score`` (old/reference logprobs, values), ``advantage``,
``train``, ``sync`` (weights to the engines); ``time/orchestration_s`` is the rest of the
step: waits, packing and shipping samples, bookkeeping. ``keep_spans`` also records each
phase's start and end (``time.perf_counter``) for benchmarks that attribute the machine's
CPU use to phases (``bench/e2e_step.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseTimer"]


class PhaseTimer:
    def __init__(self, keep_spans: bool = False) -> None:
        self.keep_spans = keep_spans
        self.spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()  # the producer thread times generate/reward

    @contextmanager
    def phase(self, name: str, metrics: dict[str, float]) -> Iterator[None]:
        """Add the time spent in the block to ``metrics["time/<name>_s"]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            key = f"time/{name}_s"
            metrics[key] = metrics.get(key, 0.0) + (t1 - t0)
            if self.keep_spans:
                with self._lock:
                    self.spans.append((name, t0, t1))
