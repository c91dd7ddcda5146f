"""Continuous batching for a vLLM engine that many threads call at once.

``RolloutEngine`` is a threaded Ray actor: each ``generate`` call (a whole batch, or one turn of
one trajectory from the agent loop) hands its requests to one ``ContinuousBatcher``, whose
thread steps vLLM's ``LLMEngine`` while any request is unfinished. Requests of every call in
flight share each engine step, and a call returns as soon as its own requests finish, so a
trajectory whose tool answered early is not held back by the slowest one.

Weight updates, sleep/wake and adapter loads run ``exclusive()``: new requests wait, requests in
flight finish first, so no sample mixes two weight versions.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ContinuousBatcher"]


@dataclass
class _Call:
    outputs: list[Any]
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class ContinuousBatcher:
    def __init__(self, engine: Any):
        self.engine = engine  # vllm.v1.engine.llm_engine.LLMEngine
        self._cv = threading.Condition()
        self._owner: dict[str, tuple[_Call, int]] = {}
        self._exclusive = 0
        self._broken: BaseException | None = None
        self.busy_s = 0.0  # time spent in engine steps
        self.steps = 0
        self.max_in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="rlhf-engine-steps", daemon=True)
        self._thread.start()

    def run(self, requests: Sequence[tuple[Any, Any, Any]]) -> list[Any]:
        """``(prompt, sampling_params, lora_request)`` each -> their finished ``RequestOutput``s, in order."""
        call = _Call([None] * len(requests), len(requests))
        if not requests:
            return []
        with self._cv:
            while self._exclusive and self._broken is None:
                self._cv.wait()
            if self._broken is not None:
                raise RuntimeError(f"the engine loop failed earlier: {self._broken!r}") from self._broken
            for i, (prompt, params, lora) in enumerate(requests):
                rid = uuid.uuid4().hex  # outputs carry this id (add_request returns an internal one)
                self.engine.add_request(rid, prompt, params, lora_request=lora)
                self._owner[rid] = (call, i)
            self.max_in_flight = max(self.max_in_flight, len(self._owner))
            self._cv.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(f"vLLM engine step failed: {call.error!r}") from call.error
        return call.outputs

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No request in flight for the span of the block (new ones wait)."""
        with self._cv:
            self._exclusive += 1
            while self._owner and self._broken is None:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive -= 1
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._owner:
                    self._cv.wait()
                t0 = time.perf_counter()
                try:
                    outs = self.engine.step()
                except BaseException as e:  # noqa: BLE001 - handed to every waiting call
                    self._fail_all(e)
                    return
                self.busy_s += time.perf_counter() - t0
                self.steps += 1
                for out in outs:
                    if not out.finished or out.request_id not in self._owner:
                        continue
                    call, i = self._owner.pop(out.request_id)
                    call.outputs[i] = out
                    call.left -= 1
                    if call.left == 0:
                        call.done.set()
                if not self._owner:
                    self._cv.notify_all()  # exclusive() waiters

    def _fail_all(self, e: BaseException) -> None:
        self._broken = e
        for call, _ in self._owner.values():
            call.error = e
            call.done.set()
        self._owner.clear()
        self._cv.notify_all()
