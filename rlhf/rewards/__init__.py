"""Rule-based reward functions: loading by path and safe, validated scoring.

A reward function has the signature ``fn(prompt: str, response: str, info: dict) -> float``
and is named in config as ``"package.module:fn"`` or ``"path/to/file.py:fn"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

RewardFn = Callable[[str, str, dict], float]


class RewardFunctionError(RuntimeError):
    """The reward function raised or returned something that is not a finite number."""


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


def score_with_function(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    infos: Sequence[dict],
    fn_name: str = "reward.function",
) -> list[float]:
    """Call ``fn`` on every sample. Raises ``RewardFunctionError`` naming the sample on failure.

    Non-finite scores are returned as ``nan`` only through the error path: the caller
    decides (``reward.non_finite``) whether a NaN fails the step or drops the sample.
    """
    scores = []
    for i, (p, r, info) in enumerate(zip(prompts, responses, infos, strict=True)):
        try:
            s = fn(p, r, info)
        except Exception as e:
            raise RewardFunctionError(
                f"{fn_name} raised on sample {i} ({type(e).__name__}: {e}); prompt={p[:80]!r} "
                f"response={r[:80]!r}. Fix the function or make it return a float for this input."
            ) from e
        try:
            scores.append(float(s))
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(
                f"{fn_name} returned {s!r} for sample {i}; it must return a float"
            ) from e
    return scores


def non_finite_indices(scores: Sequence[float]) -> list[int]:
    return [i for i, s in enumerate(scores) if not math.isfinite(s)]
