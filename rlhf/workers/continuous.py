"""Continuous batching for a vLLM engine that many threads call at once.

``RolloutEngine`` is a threaded Ray actor: each ``generate`` call (a whole batch, one prompt
group of a streaming run, or one turn of one trajectory from the agent loop) hands its requests
to one ``ContinuousBatcher``, whose thread steps vLLM's ``LLMEngine`` while any request is
unfinished. Requests of every call in flight share each engine step, and a call returns as soon
as its own requests finish, so a trajectory whose tool answered early is not held back by the
slowest one.

Requests stream their tokens (``RequestOutputKind.DELTA``): the batcher appends each step's new
tokens and log-probs to the request's ``Completion``, so it knows at any point how many tokens
each request has sampled. That is what makes per-token weight versions exact:

- ``exclusive()`` (weight loads with ``rollout.inflight_updates=false``, sleep/wake): new
  requests wait and requests in flight finish first, so no sample mixes two weight versions.
- ``between_steps(version)`` (in-flight updates): the block runs between two engine steps with
  the requests in flight paused where they are; tokens sampled after it are sampled under
  ``version`` and recorded so (``Completion.versions``). The KV cache those requests computed
  under older weights is kept (as PipelineRL does). With ``switch_in_flight=False`` (a LoRA
  adapter: a request keeps the adapter it started with) only new requests get ``version``.
- ``preempting(version)`` (partial rollouts, ``rollout.partial_rollouts``): the requests in
  flight are aborted, the block runs, and each unfinished completion goes on as a request of its
  own, its prompt plus its tokens so far, under ``version``. vLLM computes that prefix again under
  the new weights, so the prefix cache can stay on (verl's partial rollouts).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Completion", "ContinuousBatcher"]


@dataclass
class Completion:
    """One sampled completion as it grows.

    ``versions`` are ``(first token index, weight version)`` pairs in order: tokens
    ``[start_k, start_{k+1})`` were sampled under ``version_k``.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)

    def token_versions(self) -> list[int]:
        """The weight version of each sampled token."""
        out: list[int] = []
        bounds = [*self.versions[1:], (len(self.token_ids), -1)]
        for (start, version), (end, _) in zip(self.versions, bounds, strict=True):
            out += [version] * (end - start)
        return out


@dataclass
class _Request:
    """One request of a call: its ``n`` completions, fed by one engine request or, after a
    preemption, by one continuation per unfinished completion."""

    call: _Call
    index: int  # in the call's list of requests
    completions: list[Completion]
    prompt: Any  # the TokensPrompt it was sent with
    params: Any  # its SamplingParams
    feeds: int = 1  # engine requests still feeding it


@dataclass
class _Feed:
    """An engine request and the completions its outputs go to."""

    request: _Request
    slots: tuple[int, ...]  # output index -> completion index


@dataclass
class _Call:
    outputs: list[list[Completion] | None]
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _compute_threads(n: int) -> int:
    """Set the calling thread's intra-op threads to ``n`` (0: leave them) and return them. With
    OpenMP a thread keeps the count it had at its first parallel op, so only the step thread can
    change its own; vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op (for its own
    thread binding, which the in-process engine does not do), hence the builtin."""
    import torch

    if n:
        torch._C.set_num_threads(n)
    return torch.get_num_threads()


def _completions(feed: _Feed) -> Iterator[Completion]:
    return (feed.request.completions[k] for k in feed.slots)


class ContinuousBatcher:
    """Steps ``engine`` (a ``vllm.v1.engine.llm_engine.LLMEngine``) for every caller.

    Args:
        engine: the vLLM engine; requests are added with ``RequestOutputKind.DELTA`` params.
        sampled_logprobs: ``(token_ids, vllm logprobs) -> [float]``, the log-prob of each new
            token (the engine module's parser of vLLM's logprob formats).
        threads: intra-op threads of the engine steps (``threads`` may change it; 0: torch's).
            Set it before the first request: vLLM's CPU GEMMs (oneDNN handlers, one primitive
            per shape) keep the thread count a shape was first run with, so a step thread that
            ran on one thread gains little from two later (measured 1.5 cores busy against 1.85).
    """

    def __init__(
        self, engine: Any, sampled_logprobs: Callable[[list[int], Any], list[float]], threads: int = 0
    ):
        self.engine = engine
        self._logprobs_of = sampled_logprobs
        # Only the step thread touches the engine while it runs: callers queue their requests
        # and wait on flags, so nobody waits for the lock through a whole engine step.
        self._cv = threading.Condition()
        self._requests: dict[str, _Feed] = {}  # by engine request id
        self._adds: list[tuple[str, Any, Any, Any]] = []  # (id, prompt, params, lora) not added yet
        self._exclusive = 0
        self._paused = 0
        self._stepping = False
        self._broken: BaseException | None = None
        self.version = 0  # the weights new tokens are sampled under
        self.busy_s = 0.0  # time spent in engine steps
        self.steps = 0
        self.max_in_flight = 0
        self.inflight_updates = 0  # updates that landed with requests in flight
        self.threads = threads  # intra-op threads the steps compute with; 0 = torch's default
        self.continued = 0  # completions aborted by a weight update and continued (partial rollouts)
        self._preempted: list[str] = []  # engine requests aborted by preempt(), to continue
        self.compute_threads = 0  # what the step thread computes with (read back after setting it)
        self._thread = threading.Thread(target=self._loop, name="rlhf-engine-steps", daemon=True)
        self._thread.start()

    def run(self, requests: Sequence[tuple[Any, Any, Any]]) -> list[list[Completion]]:
        """``(prompt, sampling_params, lora_request)`` each -> its ``n`` finished completions, in order."""
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
                comps = [Completion(versions=[(0, self.version)]) for _ in range(params.n)]
                self._requests[rid] = _Feed(_Request(call, i, comps, prompt, params), tuple(range(params.n)))
                self._adds.append((rid, prompt, params, lora))
            self.max_in_flight = max(self.max_in_flight, len(self._requests))
            self._cv.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(f"vLLM engine step failed: {call.error!r}") from call.error
        return call.outputs  # type: ignore[return-value]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No request in flight for the span of the block (new ones wait)."""
        with self._cv:
            self._exclusive += 1
            while self._requests and self._broken is None:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def between_steps(self, version: int, switch_in_flight: bool = True) -> Iterator[None]:
        """Run the block between two engine steps (requests in flight stay where they are);
        after it, new tokens are sampled under ``version``."""
        self.pause()
        try:
            yield
        finally:
            self.resume(version, switch_in_flight)

    def pause(self) -> None:
        """Stop stepping after the step under way (requests in flight stay where they are);
        ``resume`` may come from another thread (a transfer spans several engine calls)."""
        with self._cv:
            self._paused += 1
            while self._stepping:
                self._cv.wait()

    def resume(self, version: int | None = None, switch_in_flight: bool = True) -> None:
        """Step again; with ``version``, tokens sampled from now on are sampled under it."""
        with self._cv:
            if version is not None:
                if self._requests:
                    self.inflight_updates += 1
                self._switch(version, switch_in_flight)
            self._paused -= 1
            self._cv.notify_all()

    def _switch(self, version: int, in_flight: bool = True) -> None:
        """Tokens sampled from now on (of the requests in flight too, ``in_flight``) are ``version``'s."""
        if in_flight:
            for c in self._unfinished():
                c.versions.append((len(c.token_ids), version))
        self.version = version

    @contextlib.contextmanager
    def preempting(self, version: int, lora_of: Callable[[], Any] = lambda: None) -> Iterator[None]:
        """Abort the requests in flight, run the block, then continue each of their unfinished
        completions under ``version`` (see ``preempt``); the block may reset the prefix cache."""
        self.preempt()
        try:
            yield
        finally:
            self.continue_preempted(version, lora_of())

    def preempt(self) -> None:
        """Stop stepping after the step under way and abort every request the engine holds; their
        tokens so far stay. ``continue_preempted`` (from any thread) sends them on."""
        self.pause()
        with self._cv:
            queued = {rid for rid, *_ in self._adds}
            self._preempted = [rid for rid in self._requests if rid not in queued]
            if self._preempted:
                self.engine.abort_request(self._preempted)

    def continue_preempted(self, version: int, lora: Any = None) -> None:
        """Each unfinished completion of the aborted requests goes on as a request of its own:
        its prompt plus its tokens so far, the tokens it has left, under the weights loaded now
        (``version``, ``lora``). vLLM computes that prefix again, under these weights (verl's
        partial rollouts; ``between_steps`` keeps the old weights' cache instead)."""
        with self._cv:
            for rid in self._preempted:
                feed = self._requests.pop(rid)
                for k in feed.slots:
                    if feed.request.completions[k].finish_reason is None:
                        self._continue(feed.request, k, lora)
                self._fed(feed.request)
            self._preempted = []
            self._switch(version)  # not an in-flight update: nothing kept its old cache
            self._paused -= 1
            self._cv.notify_all()

    def _continue(self, req: _Request, k: int, lora: Any) -> None:
        comp, params = req.completions[k], req.params.clone()
        done = len(comp.token_ids)
        params.n, params.max_tokens = 1, params.max_tokens - done
        params.min_tokens = max(0, params.min_tokens - done)
        if params.seed is not None:  # its own draws, the same on every run
            params.seed = (params.seed * 1_000_003 + k * 10_007 + done) % 2**63
        prompt = {**req.prompt, "prompt_token_ids": [*req.prompt["prompt_token_ids"], *comp.token_ids]}
        rid = uuid.uuid4().hex
        self._requests[rid] = _Feed(req, (k,))
        self._adds.append((rid, prompt, params, lora))
        req.feeds += 1
        self.continued += 1

    def _unfinished(self) -> Iterator[Completion]:
        """Completions of the requests in flight that have not finished."""
        for feed in self._requests.values():
            for c in _completions(feed):
                if c.finish_reason is None:
                    yield c

    def versions_in_use(self) -> set[int]:
        """The versions requests in flight started under (with LoRA: their adapters)."""
        with self._cv:
            live = (f for rid, f in self._requests.items() if rid not in self._preempted)
            return {c.versions[0][1] for f in live for c in _completions(f)}

    def set_version(self, version: int) -> None:
        """The weights loaded while nothing was in flight (``exclusive``) are ``version``."""
        with self._cv:
            self.version = version

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._requests or self._paused:
                    self._cv.wait()
                adds, self._adds = self._adds, []
                self._stepping = True
                threads = self.threads
            try:
                if threads != self.compute_threads:
                    self.compute_threads = _compute_threads(threads)
                for rid, prompt, params, lora in adds:
                    self._add(rid, prompt, params, lora)
                t0 = time.perf_counter()
                outs = self.engine.step() if self.engine.has_unfinished_requests() else []
                busy = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - handed to every waiting call
                with self._cv:
                    self._fail_all(e)
                return
            with self._cv:
                self._stepping = False
                self.busy_s += busy
                self.steps += 1
                for out in outs:
                    self._take(out)
                self._cv.notify_all()  # pause() and exclusive() waiters

    def _add(self, rid: str, prompt: Any, params: Any, lora: Any) -> None:
        """Hand one request to the engine; a request vLLM refuses fails its own call only."""
        try:
            self.engine.add_request(rid, prompt, params, lora_request=lora)
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread
            with self._cv:
                call = self._requests.pop(rid).request.call
                call.error = e
                call.done.set()

    def _take(self, out: Any) -> None:
        """Append one step's new tokens of a request; hand the request over when it finished."""
        feed = self._requests.get(out.request_id)
        if feed is None:
            return
        req = feed.request
        for c in out.outputs:
            comp = req.completions[feed.slots[c.index]]
            new = list(c.token_ids)
            comp.token_ids += new
            if c.logprobs is not None:
                comp.logprobs += self._logprobs_of(new, c.logprobs)
            if c.finish_reason is not None:
                comp.finish_reason = c.finish_reason
        if not out.finished:
            return
        del self._requests[out.request_id]
        self._fed(req)

    @staticmethod
    def _fed(req: _Request) -> None:
        """One engine request feeding ``req`` is gone; the last hands ``req`` to its call."""
        req.feeds -= 1
        if req.feeds:
            return
        req.call.outputs[req.index] = req.completions
        req.call.left -= 1
        if req.call.left == 0:
            req.call.done.set()

    def _fail_all(self, e: BaseException) -> None:
        self._broken, self._stepping = e, False
        for feed in self._requests.values():
            feed.request.call.error = e
            feed.request.call.done.set()
        self._requests.clear()
        self._cv.notify_all()
