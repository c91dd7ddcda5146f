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
