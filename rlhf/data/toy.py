"""Bundled toy data for the CPU defaults: continue a count ("count 3 4" -> "5 6 7")."""

from __future__ import annotations

import random


def count_prompt(rng: random.Random) -> tuple[str, int]:
    """``("count 3 4 5", 6)``: a prompt and the number that continues it."""
    start, k = rng.randint(0, 80), rng.randint(2, 4)
    return "count " + " ".join(str(start + i) for i in range(k)), start + k


def toy_sft_rows(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn chats: the assistant continues the count, is asked again, continues again."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, nxt = count_prompt(rng)
        first = " ".join(str(nxt + i) for i in range(3))
        second = " ".join(str(nxt + 3 + i) for i in range(3))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": first},
                    {"role": "user", "content": "next"},
                    {"role": "assistant", "content": second},
                ]
            }
        )
    return rows


def toy_preference_rows(n: int, seed: int = 0) -> list[dict]:
    """Chosen continues the count correctly; rejected uses letters or a wrong count."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, nxt = count_prompt(rng)
        chosen = " ".join(str(nxt + i) for i in range(3))
        if rng.random() < 0.5:
            rejected = " ".join(rng.choice("abcdefgh") for _ in range(3))
        else:
            rejected = " ".join(str(rng.randint(0, 99)) for _ in range(3))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def count_next_rows(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[dict], list[dict]]:
    """The count-next skill: every prompt ``"count a .. b"`` (start 0-80, 1-6 numbers) with its
    answer ``b + 1`` as ``{"prompt", "answer"}`` rows, split at random (seeded) into training
    and held-out prompts that never appear in training."""
    rows = [
        {"prompt": "count " + " ".join(str(start + i) for i in range(k)), "answer": str(start + k)}
        for start in range(81)
        for k in range(1, 7)
    ]
    random.Random(seed).shuffle(rows)
    n_eval = round(eval_fraction * len(rows))
    return rows[n_eval:], rows[:n_eval]


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana")
_ITEMS = ("apples", "books", "coins", "marbles", "pens", "stamps")


def arithmetic_word_problems(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-style rows ``{"question", "answer", "solution"}``: two-step word problems whose
    ``answer`` is the final number (the ``#### X`` of a GSM8K solution). The numbers are small
    (products of 2-5 and 1-9, sums below 70) so that a tiny model learns them on a CPU in minutes."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = rng.randint(2, 20), rng.randint(2, 5), rng.randint(1, 9)
        if rng.random() < 0.5:
            q = f"{name} has {a} {item} and buys {b} bags of {c} {item} each. How many {item} does {name} have now?"
            steps, ans = f"{b} * {c} = {b * c}\n{a} + {b * c} = {a + b * c}", a + b * c
        else:
            q = f"{name} has {a * b} {item} and shares them equally among {b} friends, then gets {c} more. How many {item} does {name} have?"
            steps, ans = f"{a * b} / {b} = {a}\n{a} + {c} = {a + c}", a + c
        rows.append({"question": q, "answer": str(ans), "solution": f"{steps}\n#### {ans}"})
    return rows
