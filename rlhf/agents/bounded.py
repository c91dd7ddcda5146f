"""Running user code (tools, environment steps) so that a call that never returns costs nothing
but its own thread.

``concurrent.futures.ThreadPoolExecutor`` is the wrong tool for code that may hang: its
workers are joined at interpreter exit (a hung tool kept a finished run's process alive until
it was killed), and a hung call holds its worker for good (once hung calls fill the pool, a
healthy call waits behind them and "times out" without ever running). Here:

- each call runs on a daemon thread, which never keeps the process alive;
- at most ``max_concurrency`` calls run at once; the rest wait in order;
- a call its caller gave up on (``abandon``) stops counting against that limit at once: the
  next waiting call starts, and the abandoned thread is left to end whenever it does (Python
  cannot stop a thread);
- a coroutine function runs on one shared event loop, and ``abandon`` cancels it for real.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("rlhf")

__all__ = ["BoundedCalls"]

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The event loop async calls share (started on first use, on a daemon thread)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rlhf-async-tools", daemon=True).start()
        return _loop


class BoundedCalls:
    """``submit(fn, ...)`` -> ``Future``; at most ``max_concurrency`` running (see the module docstring)."""

    def __init__(self, max_concurrency: int, name: str):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency, self.name = max_concurrency, name
        self.abandoned = 0  # calls given up on while running (their threads may still run)
        self._lock = threading.Lock()
        self._holding: set[Future] = set()  # calls that hold one of the max_concurrency slots
        self._waiting: collections.deque = collections.deque()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        if inspect.iscoroutinefunction(fn):
            return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), _event_loop())
        fut: Future = Future()
        with self._lock:
            start = len(self._holding) < self.max_concurrency
            if start:
                self._holding.add(fut)
            else:
                self._waiting.append((fut, fn, args, kwargs))
        if start:
            self._start(fut, fn, args, kwargs)
        return fut

    def abandon(self, fut: Future) -> None:
        """The caller stopped waiting for ``fut``: a waiting call is cancelled, a running one
        gives its slot to the next waiting call, an async one is cancelled."""
        if fut.cancel():  # not started yet (or an async call)
            with self._lock:
                self._waiting = collections.deque(w for w in self._waiting if w[0] is not fut)
            return
        with self._lock:
            if fut not in self._holding:
                return
            self._holding.discard(fut)
            self.abandoned += 1
            abandoned = self.abandoned
        if abandoned == self.max_concurrency:
            log.warning(
                "%d %s calls did not return in time and were abandoned; their threads still run (a hung "
                "call never blocks the run or its exit, but fix the code that hangs)",
                abandoned,
                self.name,
            )
        self._next()

    def _start(self, fut: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if not fut.set_running_or_notify_cancel():
            self._release(fut)
            return
        threading.Thread(
            target=self._run, args=(fut, fn, args, kwargs), name=f"rlhf-{self.name}", daemon=True
        ).start()

    def _run(self, fut: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the caller reports it
            fut.set_exception(e)
        else:
            fut.set_result(value)
        finally:
            self._release(fut)

    def _release(self, fut: Future) -> None:
        with self._lock:
            held = fut in self._holding
            self._holding.discard(fut)
        if held:
            self._next()

    def _next(self) -> None:
        with self._lock:
            if not self._waiting or len(self._holding) >= self.max_concurrency:
                return
            fut, fn, args, kwargs = self._waiting.popleft()
            self._holding.add(fut)
        self._start(fut, fn, args, kwargs)
