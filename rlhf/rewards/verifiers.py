"""Built-in verifiable rewards: plain reward functions ``fn(prompt, response, info) -> float``.

Each reads the ground truth from the dataset row's own column, ``info["answer"]`` by default
(a prompt file's other columns reach the reward untouched, see ``rlhf.data.prompts``). Name
one in config as ``reward.function=rlhf.rewards.verifiers:math_verify_reward``, or combine
several with weights (``reward.functions`` / ``reward.weights``).

- :func:`math_verify_reward`: answer equivalence by the ``math-verify`` library (LaTeX,
  fractions, sets, ``\\boxed{}``), 1.0 or 0.0.
- :func:`exact_match_reward`: the extracted final answer equals the label as a string.
- :func:`numeric_match_reward`: the extracted final answer equals the label as a number.
- :func:`format_reward`: 1.0 when the response states a final answer in a recognised form.

Final-answer extraction (:func:`extract_answer`), first match wins: ``#### X`` (GSM8K),
``\\boxed{X}`` (MATH), else the last number in the response.
"""

from __future__ import annotations

import math
import re
import threading

from rlhf.rewards import count
from rlhf.rewards.verify_process import VerifyProcess

__all__ = [
    "exact_match_reward",
    "extract_answer",
    "format_reward",
    "math_verify_reward",
    "numeric_match_reward",
]


_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_MARKUP = re.compile(r"<\|?[A-Za-z_/]+\|?>")  # chat-template tokens such as <eos> or <|im_end|>


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                return text[i:j].strip()
            depth -= 1
    return None


def extract_answer(response: str) -> str | None:
    """The response's final answer (``#### X``, ``\\boxed{X}``, or the last number), or None."""
    text = _MARKUP.sub(" ", response)
    m = _HASHES.findall(text)
    if m:
        return m[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _label(info: dict, key: str) -> str:
    if key not in info or info[key] is None:
        raise KeyError(
            f"the verifier needs the label column {key!r} in the prompt data (info has {sorted(info)}); "
            "name the label column with reward.label_key (default: data.label_key, else 'answer'), and set "
            "data.label_key to check every row up front"
        )
    label = info[key]
    # GSM8K stores the whole solution: its final answer follows '####'.
    return extract_answer(label) or str(label) if isinstance(label, str) and "####" in label else str(label)


def _to_number(text: str | None) -> float | None:
    if text is None:
        return None
    text = text.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        return float(text)
    except ValueError:
        return None


def exact_match_reward(prompt: str, response: str, info: dict, key: str = "answer") -> float:
    """1.0 when the extracted final answer equals ``info[key]`` (whitespace-trimmed), else 0.0."""
    answer = extract_answer(response)
    return float(answer is not None and answer.strip() == _label(info, key).strip())


def numeric_match_reward(
    prompt: str, response: str, info: dict, key: str = "answer", rel_tol: float = 1e-6
) -> float:
    """1.0 when the extracted final answer and ``info[key]`` are the same number, else 0.0."""
    got, want = _to_number(extract_answer(response)), _to_number(_label(info, key))
    if want is None:
        raise ValueError(f"label {info[key]!r} in column {key!r} is not a number; use exact_match_reward")
    return float(got is not None and math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9))


def math_verify_reward(
    prompt: str, response: str, info: dict, key: str = "answer", timeout_s: float = 5.0
) -> float:
    """1.0 when ``math-verify`` finds the response's answer equivalent to ``info[key]``, else 0.0.

    The check runs in a process of its own (``rlhf.rewards.verify_process``), bounded by
    ``timeout_s`` (``reward.verify_timeout_s``): one that runs longer is stopped, scores 0.0 and
    counts in ``reward/verify_timeouts``.
    """
    label = _label(info, key)
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    score = _verify_process().check(label, answer, timeout_s)
    if score is None:
        count("verify_timeouts")
        return 0.0
    return score


math_verify_reward.counts = ("verify_timeouts",)
_PROCESS: list[VerifyProcess] = []  # started on the first check, shared by every caller
_PROCESS_LOCK = threading.Lock()


def _verify_process() -> VerifyProcess:
    with _PROCESS_LOCK:
        if not _PROCESS:
            _PROCESS.append(VerifyProcess())
        return _PROCESS[0]


def format_reward(prompt: str, response: str, info: dict) -> float:
    """1.0 when the response states its final answer as ``#### X`` or ``\\boxed{X}``, else 0.0."""
    text = _MARKUP.sub(" ", response)
    return float(bool(_HASHES.search(text)) or _boxed(text) is not None)
