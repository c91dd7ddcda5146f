"""Prompt sources: the bundled toy task, JSONL, Parquet and Hugging Face datasets, tokenized
with the chat template. Every column of a row other than the prompt travels untouched to the
reward and the environment as ``Prompt.info`` (e.g. ``info["answer"]``), plus ``index``."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field


@dataclass
class Prompt:
    """One prompt: chat-formatted text, its token ids and free-form info for the reward."""

    text: str
    token_ids: list[int]
    info: dict = field(default_factory=dict)
    messages: list[dict] | None = None  # the chat it was rendered from (the agent loop's drift check)


def toy_count_messages(n: int, seed: int) -> list[list[dict]]:
    """The toy count task's prompts, as one-message chats (same prompts as the SFT/DPO toy rows)."""
    from rlhf.data.toy import count_prompt

    rng = random.Random(seed)
    return [[{"role": "user", "content": count_prompt(rng)[0]}] for _ in range(n)]


def read_prompt_rows(
    source: str, key: str, label_key: str = "", section: str = "data"
) -> list[tuple[list[dict], dict]]:
    """``(messages, other columns)`` per row of a JSONL/Parquet file or ``hf:NAME[:SPLIT]``: the
    prompt column holds ``"text"`` or ``[{"role": ..., "content": ...}, ...]``. Errors name the
    file:line (or row), the column and the ``<section>.*`` keys to set (``data`` or ``eval``);
    ``label_key`` names a column every row must have."""
    from rlhf.data.chat import DataRowError, iter_file_rows, messages_field

    try:
        rows_iter = iter_file_rows(source)
    except DataRowError as e:
        raise DataRowError(f"{section}.prompts={e}") from e
    rows = []
    for lineno, row in rows_iter:
        where = f"{source}:{lineno}"
        if key not in row:
            raise DataRowError(
                f"{where}: missing column {key!r} (set {section}.prompt_key to the prompt column; "
                f"this row has {sorted(row)})"
            )
        if label_key and row.get(label_key) is None:
            raise DataRowError(
                f"{where}: missing column {label_key!r} ({section}.label_key); every prompt needs its label"
            )
        rows.append((messages_field(row[key], where, key), {k: v for k, v in row.items() if k != key}))
    if not rows:
        raise DataRowError(f"{source}: no prompts found")
    return rows


def load_prompts(
    source: str,
    tokenizer,
    key: str = "prompt",
    num_toy: int = 256,
    seed: int = 0,
    max_len: int | None = None,
    overlong: str = "error",
    label_key: str = "",
    section: str = "data",
    tools: list[dict] | None = None,
    label_as: str = "",
) -> tuple[list[Prompt], int]:
    """Load and tokenize prompts. Returns ``(prompts, num_skipped_overlong)``. ``tools`` (schemas)
    are rendered into the prompt by the chat template (tool-calling runs, ``env.tools``).

    ``overlong="error"`` raises on a prompt over ``max_len`` tokens naming
    ``data.max_prompt_len``; ``"skip"`` drops it and counts it. ``section`` (``data`` or
    ``eval``) is the config section errors name. Warns once when the tokenizer maps more than
    ``UNKNOWN_TOKEN_WARN`` of the prompt tokens to its unknown token (a model that cannot read the data).
    ``label_as``: the ``label_key`` column is also put under this name (eval rows whose label
    column differs from the one the verifiers read, ``PPOConfig.label_key``).
    """
    if source == "toy:count":
        rows = [(m, {}) for m in toy_count_messages(num_toy, seed)]
    elif source.startswith("toy:"):
        raise ValueError(f"{section}.prompts={source!r}: unknown toy task (available: toy:count)")
    else:
        rows = read_prompt_rows(source, key, label_key, section)
        if label_as and label_key and label_as != label_key:
            rows = [(m, {**cols, label_as: cols[label_key]}) for m, cols in rows]
    prompts, skipped = [], 0
    for i, (msgs, columns) in enumerate(rows):
        text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_len is not None and len(ids) > max_len:
            if overlong == "skip":
                skipped += 1
                continue
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than data.max_prompt_len={max_len}: raise "
                "data.max_prompt_len (and rollout.max_model_len) or set data.overlong_prompts=skip"
            )
        info = {**columns, "index": columns.get("index", i)}
        prompts.append(Prompt(text=text, token_ids=ids, info=info, messages=list(msgs)))
    if not prompts:
        raise ValueError(
            f"{section}.prompts={source!r}: every prompt was longer than data.max_prompt_len={max_len}"
        )
    warn_unknown_tokens(prompts, tokenizer, f"{section}.prompts={source}")
    return prompts, skipped


UNKNOWN_TOKEN_WARN = 0.05
_warned_unknown: set[str] = set()


def unknown_token_fraction(prompts: list[Prompt], unk_id: int | None) -> float:
    """Share of all prompt tokens that are ``unk_id`` (0 for a tokenizer without one, e.g. byte-level BPE)."""
    total = sum(len(p.token_ids) for p in prompts)
    if unk_id is None or total == 0:
        return 0.0
    return sum(p.token_ids.count(unk_id) for p in prompts) / total


def warn_unknown_tokens(prompts: list[Prompt], tokenizer, what: str) -> float:
    """Log one warning per source when more than ``UNKNOWN_TOKEN_WARN`` of its tokens are unknown."""
    frac = unknown_token_fraction(prompts, getattr(tokenizer, "unk_token_id", None))
    if frac > UNKNOWN_TOKEN_WARN and what not in _warned_unknown:
        _warned_unknown.add(what)
        logging.getLogger("rlhf").warning(
            "%.0f%% of the prompt tokens of %s are the tokenizer's unknown token %r: the model cannot read "
            "this data. Use a model whose tokenizer covers it (model=hf model.path=DIR, docs/models.md); "
            "the tiny model's word-level tokenizer knows only the toy tasks' words",
            100 * frac,
            what,
            tokenizer.unk_token,
        )
    return frac


class PromptLoader:
    """Epoch-shuffled batches of prompts with a resumable position (for checkpoints)."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int = 0):
        if batch_size > len(prompts):
            raise ValueError(
                f"train.rollout_batch_size={batch_size} exceeds the {len(prompts)} prompts available"
            )
        self.prompts, self.batch_size, self.seed = prompts, batch_size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Prompt]:
        if self.pos + self.batch_size > len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.prompts[i] for i in idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._shuffle()
