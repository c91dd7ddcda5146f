"""Rule-based reward functions: loading by path, weighted composition, bounded and validated scoring.

A reward function has the signature ``fn(prompt: str, response: str, info: dict) -> float``
(``info`` holds the prompt row's own columns, e.g. ``info["answer"]``) and is named in config
as ``"package.module:fn"`` or ``"path/to/file.py:fn"``. A function decorated with
:func:`batched` is called once per batch instead, ``fn(prompts, responses, infos) -> list``
(for remote verifiers and reward services). Every call is bounded by ``reward.timeout_s``.
Built-in verifiers live in ``rlhf.rewards.verifiers``. Naming a function runs its module's
code in the driver: only name code you trust.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

RewardFn = Callable[[str, str, dict], float]
log = logging.getLogger("rlhf")


class RewardFunctionError(RuntimeError):
    """The reward function raised, hung, or returned something that is not a finite number."""


_counting = threading.local()  # the counts of the batch the current reward thread scores


def count(event: str, n: int = 1) -> None:
    """Count ``event`` for the batch being scored, logged as ``reward/<event>`` for the step.

    For reward functions: a function that lists the events it counts in a ``counts`` attribute
    (e.g. ``fn.counts = ("verify_timeouts",)``) has them logged every step, 0 included. A no-op
    when the function is called outside a scored batch.
    """
    counts = getattr(_counting, "counts", None)
    if counts is not None:
        counts[event] = counts.get(event, 0) + n


def batched(fn: Callable) -> Callable:
    """Mark ``fn(prompts, responses, infos) -> list[float]`` as called once per batch."""
    fn.batched = True
    return fn


def _call_each(
    fn: Callable,
    calls: Sequence[tuple],
    timeout_s: float,
    what: Callable[[int], str],
    keep_going: bool = False,
    counts: dict[str, int] | None = None,
) -> list[Any]:
    """``[fn(*args) for args in calls]`` on one daemon thread, each call bounded by ``timeout_s``.

    One thread for the batch, not one per call: starting a thread costs about as much as a
    rule-based reward. A call still running after ``timeout_s`` is an error naming it
    (``what(i)``); the thread is abandoned (Python cannot stop it, but it no longer blocks the
    run). A call that raises is re-raised here with ``_CallFailed`` telling which one; with
    ``keep_going`` its ``_CallFailed`` is its result instead and the next call runs. What the
    calls :func:`count` goes into ``counts``.
    """
    results: list[Any] = []
    failure: list[BaseException] = []
    cond = threading.Condition()

    def run() -> None:
        _counting.counts = counts
        for i, args in enumerate(calls):
            try:
                value = fn(*args)
            except BaseException as e:  # re-raised on the caller's thread
                if keep_going and isinstance(e, Exception):
                    value = _CallFailed(i, e)
                else:
                    with cond:
                        failure.append(_CallFailed(i, e))
                        cond.notify()
                    return
            with cond:
                results.append(value)
                cond.notify()

    threading.Thread(target=run, name="rlhf-reward", daemon=True).start()
    with cond:
        while len(results) < len(calls) and not failure:
            k, deadline = len(results), time.monotonic() + timeout_s  # call k is running now
            while len(results) == k and not failure:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardFunctionError(
                        f"{what(k)} did not return within reward.timeout_s={timeout_s:g} s; fix the function "
                        "(or its service), or raise reward.timeout_s"
                    )
                cond.wait(left)
    if failure:
        raise failure[0]
    return results


class _CallFailed(Exception):
    """Call ``index`` of ``_call_each`` raised ``error``."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(index, error)
        self.index, self.error = index, error


def _as_score(value: Any, what: str) -> float:
    # A numeric string is refused too: it usually means a parsing bug in the reward.
    if isinstance(value, numbers.Real) and not isinstance(value, str):
        return float(value)
    raise RewardFunctionError(f"{what} returned {value!r} ({type(value).__name__}); it must return a float")


@dataclass
class RewardComponent:
    """One weighted reward function; ``name`` labels its metric ``reward/<name>``."""

    name: str
    fn: Callable
    weight: float = 1.0

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        infos: Sequence[dict],
        timeout_s: float,
        keep_going: bool = False,
        counts: dict[str, int] | None = None,
    ) -> list[float | None]:
        """One float per sample. Raises ``RewardFunctionError`` naming the sample on failure;
        with ``keep_going`` a sample whose call raised gets None (and is logged) instead. The
        function's :func:`count` events go into ``counts``."""
        if getattr(self.fn, "batched", False):
            batch = [(list(prompts), list(responses), list(infos))]
            out = self._call(batch, timeout_s, prompts, responses, batch=True, counts=counts)[0]
            if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
                raise RewardFunctionError(
                    f"{self.name} (batched) returned {type(out).__name__} of length "
                    f"{len(out) if hasattr(out, '__len__') else '?'} for {len(prompts)} samples; return one float per sample"
                )
        else:
            calls = list(zip(prompts, responses, infos, strict=True))
            out = self._call(calls, timeout_s, prompts, responses, keep_going=keep_going, counts=counts)
        scores: list[float | None] = []
        for i, v in enumerate(out):
            if isinstance(v, _CallFailed):
                log.warning("%s", self._failure(v, prompts, responses).args[0])
                scores.append(None)
            else:
                scores.append(_as_score(v, f"{self.name} for sample {i}"))
        return scores

    def _call(
        self,
        calls: list[tuple],
        timeout_s: float,
        prompts,
        responses,
        batch: bool = False,
        keep_going: bool = False,
        counts: dict[str, int] | None = None,
    ) -> list:
        try:
            return _call_each(self.fn, calls, timeout_s, lambda i: self._what(i, batch), keep_going, counts)
        except _CallFailed as failed:
            raise self._failure(failed, prompts, responses, batch) from failed.error

    def _what(self, i: int, batch: bool = False) -> str:
        return f"{self.name} on {'batch' if batch else f'sample {i}'}"

    def _failure(self, failed: _CallFailed, prompts, responses, batch: bool = False) -> RewardFunctionError:
        e, i = failed.error, failed.index
        if isinstance(e, RewardFunctionError):
            return e
        p, r = (prompts[0], responses[0]) if batch else (prompts[i], responses[i])
        return RewardFunctionError(
            f"{self._what(i, batch)} raised ({type(e).__name__}: {e}); prompt={p[:80]!r} response={r[:80]!r}. "
            "Fix the function or make it return a float for this input (or set reward.on_error=zero|drop)."
        )


class Scores(NamedTuple):
    """What ``Reward`` gives for a batch: the weighted total per sample (NaN for a sample whose
    call raised under ``on_error=drop``), each component's own scores, and the samples whose
    call raised (``on_error`` zero or drop), and the events the functions counted (``count``)."""

    totals: list[float]
    parts: dict[str, list[float]]
    errors: list[int]
    counts: dict[str, int]


class Reward:
    """The weighted sum of reward components, each call bounded by ``timeout_s``.

    ``on_error`` (``reward.on_error``) is what a call that raises does: ``fail`` ends the step
    with an error naming the sample (the default: a broken reward should not train quietly);
    ``zero`` scores that component 0 for the sample; ``drop`` leaves the sample out (its total
    is NaN, which the experience maker drops with its group). Both count in ``reward/errors``.
    A call that hangs past ``timeout_s`` always fails the step.
    """

    ON_ERROR = ("fail", "zero", "drop")

    def __init__(
        self, components: Sequence[RewardComponent], timeout_s: float = 60.0, on_error: str = "fail"
    ):
        if not components:
            raise ValueError("a reward needs at least one function")
        if on_error not in self.ON_ERROR:
            raise ValueError(f"reward.on_error={on_error!r}: choose one of {self.ON_ERROR}")
        self.components, self.timeout_s, self.on_error = list(components), timeout_s, on_error

    @classmethod
    def from_config(cls, reward_cfg, label_key: str = "answer") -> Reward:
        """``reward.functions`` with ``reward.weights`` (default 1 each), else ``reward.function``.
        The built-in verifiers read their label from column ``label_key``."""
        specs, verify_timeout = reward_cfg.specs, reward_cfg.verify_timeout_s
        weights = list(reward_cfg.weights) or [1.0] * len(specs)
        comps = [
            RewardComponent(
                _short_name(s), _bind_builtin(load_reward_fn(s), label_key, verify_timeout), float(w)
            )
            for s, w in zip(specs, weights, strict=True)
        ]
        return cls(comps, reward_cfg.timeout_s, reward_cfg.on_error)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], infos: Sequence[dict]) -> Scores:
        """Total score per sample, each component's own scores (unweighted), the failed samples."""
        keep_going = self.on_error != "fail"
        counts = {event: 0 for c in self.components for event in getattr(c.fn, "counts", ())}
        raw = {
            c.name: c.score(prompts, responses, infos, self.timeout_s, keep_going, counts)
            for c in self.components
        }
        errors = sorted({i for scores in raw.values() for i, v in enumerate(scores) if v is None})
        parts = {k: [0.0 if v is None else v for v in scores] for k, scores in raw.items()}
        totals = [
            math.nan
            if self.on_error == "drop" and i in errors
            else math.fsum(c.weight * parts[c.name][i] for c in self.components)
            for i in range(len(prompts))
        ]
        return Scores(totals, parts, errors, dict(counts))


def _bind_builtin(fn: Callable, label_key: str, verify_timeout_s: float) -> Callable:
    """A built-in verifier with its label column (``reward.label_key``) and, for math-verify,
    its per-check budget (``reward.verify_timeout_s``) bound; any other function as it is (it
    reads ``info`` itself)."""
    if getattr(fn, "__module__", "") != "rlhf.rewards.verifiers":
        return fn
    params = inspect.signature(fn).parameters
    kwargs = {"key": label_key, "timeout_s": verify_timeout_s}
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    if not kwargs:
        return fn
    bound = functools.partial(fn, **kwargs)
    functools.update_wrapper(bound, fn)
    return bound


def _short_name(spec: str) -> str:
    return spec.rpartition(":")[2]


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``"module:fn"`` or ``"file.py:fn"``; errors name ``reward.function``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"reward.function={spec!r} must look like 'module:fn' or 'path/to/file.py:fn'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"reward.function={spec!r}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"rlhf_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"reward.function={spec!r}: cannot import module {target!r} ({e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r}: {target!r} has no callable named {name!r}")
    return fn


def non_finite_indices(scores: Sequence[float]) -> list[int]:
    return [i for i, s in enumerate(scores) if not math.isfinite(s)]
