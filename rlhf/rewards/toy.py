"""Rule-based rewards of the bundled toy tasks."""

from __future__ import annotations


def count_reward(prompt: str, response: str, info: dict) -> float:
    """Reward for continuing a count: ``"count 3 4 5"`` -> ``"6 7 8 ..."``.

    Half the score is the share of response words that are numbers at all (a random policy
    gets some of it, so the signal is dense), half is the share of positions that continue
    the count correctly. Markup tokens (``<|end|>``, ``<eos>``) are ignored. In [0, 1].
    """
    words = [w for w in response.split() if not (w.startswith("<") and w.endswith(">"))]
    if not words:
        return 0.0
    nums = [w for w in prompt.split() if w.isdigit()]
    start = int(nums[-1]) + 1 if nums else 0
    numeric = sum(w.isdigit() for w in words) / len(words)
    correct = sum(w == str(start + i) for i, w in enumerate(words)) / len(words)
    return 0.5 * numeric + 0.5 * correct


def always_raises(prompt: str, response: str, info: dict) -> float:
    """A broken reward function, for the error-path tests and docs."""
    raise RuntimeError("reward service unavailable")


def nan_reward(prompt: str, response: str, info: dict) -> float:
    """NaN for the samples of odd-numbered prompts, 1.0 otherwise (non-finite-reward tests)."""
    return float("nan") if info.get("index", 0) % 2 else 1.0
