"""Chat data -> unpadded Samples with assistant-token masks (SFT, DPO, reward model).

Rows are read from JSONL. Errors name the file, the row and the field, and nothing is
dropped silently.

- SFT: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (several assistant turns
  allowed) or ``{"prompt": ..., "completion": ...}``. Loss is on assistant tokens only. A row
  may carry ``tools`` (OpenAI function schemas, as TRL's datasets do): tool-calling transcripts
  (``tool`` messages are observations, not trained on) render with the template's tool prompt.
- Preferences (DPO, RM): ``{"prompt": str | messages, "chosen": str, "rejected": str}``.

Columns under other names are mapped with ``ChatColumns`` (``data.messages_key``,
``data.prompt_key``, ``data.completion_key``, ``data.chosen_key``, ``data.rejected_key``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.data.types import Sample

log = logging.getLogger("rlhf")


class DataRowError(ValueError):
    """A malformed data row; the message names the file, row and field."""


@dataclass(frozen=True)
class ChatColumns:
    """Which column holds each part of a row (``data.<part>_key``)."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    chosen: str = "chosen"
    rejected: str = "rejected"

    @classmethod
    def of(cls, data) -> ChatColumns:
        """The columns a ``ChatDataConfig`` names."""
        return cls(**{part: getattr(data, f"{part}_key") for part in cls.__dataclass_fields__})


def _missing(where: str, row: dict, wanted: str, keys: str) -> DataRowError:
    return DataRowError(
        f"{where}: missing {wanted} (set {keys} to your column names; this row has {sorted(row)})"
    )


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataRowError(
                    f"{path}:{lineno}: not UTF-8 text ({e}); re-encode the file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataRowError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise DataRowError(f"{path}:{lineno}: each row must be a JSON object")
            yield lineno, row


def messages_field(value, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataRowError(f"{where}: field {field!r} is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataRowError(f"{where}: field {field!r} must be a string or a non-empty list of messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataRowError(f"{where}: {field}[{j}] must have 'role' and 'content'")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise DataRowError(f"{where}: {field}[{j}] ({m['role']}) has an empty content")
    return value


def tools_field(value, where: str) -> list[dict] | None:
    """A row's ``tools`` (as TRL's SFT datasets carry them): OpenAI function schemas, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" for t in value
    ):
        raise DataRowError(
            f"{where}: field 'tools' must be a list of OpenAI function schemas "
            '({"type": "function", "function": {"name": ..., "parameters": {...}}})'
        )
    return value


def tokenize_conversation(
    tokenizer, messages: list[dict], where: str = "row", tools: list[dict] | None = None
) -> Sample:
    """Tokenize with the chat template; ``action_mask`` marks assistant-turn tokens.

    Each turn's tokens are the difference between the template rendered up to that turn and
    up to the turn before, so the mask follows the tokenizer's own template. A template that
    is not prefix-stable (re-renders earlier turns differently) is an error, not a guess.
    ``tools`` (OpenAI function schemas) go to the template as ``apply_chat_template(tools=...)``:
    a tool-calling transcript is rendered the way the agent loop renders it at rollout time.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(messages):
        text = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if full[: len(ids)] != ids:
            raise DataRowError(
                f"{where}: the chat template is not prefix-stable at message {i}; "
                "tokenize with a template that renders earlier turns unchanged"
            )
        new = full[len(ids) :]
        if m["role"] == "assistant":
            if not m["content"].strip():
                raise DataRowError(f"{where}: message {i} is an empty assistant turn")
            # The turn's role header is prompt, not target: mask only what follows it.
            header = (
                tokenizer.apply_chat_template(
                    messages[:i], tools=tools, tokenize=False, add_generation_prompt=True
                )
                if i
                else None
            )
            head_len = 0
            if header is not None:
                h = tokenizer(header, add_special_tokens=False)["input_ids"]
                if full[: len(h)] == h:
                    head_len = max(0, len(h) - len(ids))
            mask += [False] * head_len + [True] * (len(new) - head_len)
        else:
            mask += [False] * len(new)
        ids = full
    if not any(mask):
        raise DataRowError(f"{where}: no assistant tokens to train on")
    if mask[0]:
        raise DataRowError(f"{where}: the conversation must not start with an assistant turn")
    return Sample(input_ids=torch.tensor(ids), action_mask=torch.tensor(mask), info={"where": where})


def iter_parquet(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Rows of a Parquet file (verl's data format), numbered from 1; nested columns stay nested."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a file that is not Parquet
        raise DataRowError(f"{path}: not a readable Parquet file ({e})") from e
    i = 0
    for batch in table.iter_batches():
        for row in batch.to_pylist():
            i += 1
            yield i, row


def iter_hf(spec: str) -> Iterator[tuple[int, dict]]:
    """Rows of a Hugging Face dataset: ``hf:NAME_OR_DIR`` or ``hf:NAME_OR_DIR:SPLIT`` (default train).

    A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` loads with
    ``load_from_disk``; anything else with ``load_dataset`` (with ``HF_HUB_OFFLINE=1`` only
    local or cached datasets).
    """
    import datasets

    name, _, split = spec[len("hf:") :].partition(":")
    split = split or "train"
    if Path(name).is_dir() and any((Path(name) / f).is_file() for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataRowError(f"data source {spec!r}: no split {split!r} (splits: {', '.join(ds)})")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name, split=split)
        except Exception as e:  # datasets raises many kinds; the message is what matters
            raise DataRowError(f"data source {spec!r}: cannot load ({type(e).__name__}: {e})") from e
    for i, row in enumerate(ds, 1):
        yield i, dict(row)


def iter_file_rows(source: str) -> Iterator[tuple[int, dict]]:
    """Rows of ``hf:...``, a ``.parquet`` file or a JSONL file, numbered from 1."""
    if source.startswith("hf:"):
        return iter_hf(source)
    if not Path(source).is_file():
        raise DataRowError(f"{source!r}: no such file (or use toy:count / hf:NAME)")
    return iter_parquet(source) if source.endswith(".parquet") else iter_jsonl(source)


def iter_rows(source: str | Path, kind: str, num_toy: int = 256, seed: int = 0) -> Iterator[tuple[int, dict]]:
    """Rows of a JSONL file, a Hugging Face dataset (``hf:NAME[:SPLIT]``), or the bundled toy
    task (``toy:count``; ``kind`` picks its chats ``"sft"`` or preference pairs ``"pref"``)."""
    source = str(source)
    if source == "toy:count":
        from rlhf.data.toy import toy_preference_rows, toy_sft_rows

        rows = toy_sft_rows(num_toy, seed) if kind == "sft" else toy_preference_rows(num_toy, seed)
        yield from enumerate(rows, 1)
    elif source.startswith("toy:"):
        raise DataRowError(f"data.path={source!r}: unknown toy task (available: toy:count)")
    else:
        try:
            rows = iter_file_rows(source)
        except DataRowError as e:
            raise DataRowError(f"data.path={e}") from e
        yield from rows


def _sft_messages(row: dict, where: str, cols: ChatColumns) -> list[dict]:
    if cols.messages in row:
        return messages_field(row[cols.messages], where, cols.messages)
    if cols.prompt in row and cols.completion in row:
        completion = row[cols.completion]
        if not isinstance(completion, str) or not completion.strip():
            raise DataRowError(f"{where}: field {cols.completion!r} is empty")
        return messages_field(row[cols.prompt], where, cols.prompt) + [
            {"role": "assistant", "content": completion}
        ]
    raise _missing(
        where,
        row,
        f"field {cols.messages!r} (or {cols.prompt!r} and {cols.completion!r})",
        "data.messages_key, or data.prompt_key and data.completion_key,",
    )


def load_sft(
    path: str | Path,
    tokenizer,
    max_len: int,
    overlong: str = "error",
    num_toy: int = 256,
    seed: int = 0,
    columns: ChatColumns = ChatColumns(),
) -> tuple[list[Sample], int]:
    """SFT rows -> Samples. Returns ``(samples, num_skipped_overlong)``."""
    out, skipped = [], 0
    for lineno, row in iter_rows(path, "sft", num_toy, seed):
        where = f"{path}:{lineno}"
        msgs = _sft_messages(row, where, columns)
        s = tokenize_conversation(tokenizer, msgs, where, tools_field(row.get("tools"), where))
        if len(s) > max_len:
            if overlong == "skip":
                skipped += 1
                continue
            raise DataRowError(
                f"{where}: {len(s)} tokens, more than data.max_len={max_len}; raise it or set "
                "data.overlong=skip"
            )
        out.append(s)
    if not out:
        raise DataRowError(f"{path}: no usable rows")
    return out, skipped


def load_preferences(
    path: str | Path,
    tokenizer,
    max_len: int,
    overlong: str = "error",
    num_toy: int = 256,
    seed: int = 0,
    columns: ChatColumns = ChatColumns(),
) -> tuple[list[tuple[Sample, Sample]], int]:
    """Preference rows -> (chosen, rejected) Sample pairs sharing the prompt."""
    pairs, skipped = [], 0
    keys = {"prompt": columns.prompt, "chosen": columns.chosen, "rejected": columns.rejected}
    for lineno, row in iter_rows(path, "pref", num_toy, seed):
        where = f"{path}:{lineno}"
        for part, field in keys.items():
            if field not in row:
                raise _missing(where, row, f"field {field!r}", f"data.{part}_key")
        prompt = messages_field(row[columns.prompt], where, columns.prompt)
        pair = []
        for field in (columns.chosen, columns.rejected):
            value = row[field]
            if not isinstance(value, str) or not value.strip():
                raise DataRowError(
                    f"{where}: field {field!r} is empty (an empty completion cannot be scored)"
                )
            pair.append(
                tokenize_conversation(
                    tokenizer, prompt + [{"role": "assistant", "content": value}], f"{where} ({field})"
                )
            )
        if max(len(pair[0]), len(pair[1])) > max_len:
            if overlong == "skip":
                skipped += 1
                continue
            raise DataRowError(
                f"{where}: longer than data.max_len={max_len}; raise it or set data.overlong=skip"
            )
        pairs.append((pair[0], pair[1]))
    if not pairs:
        raise DataRowError(f"{path}: no usable rows")
    return pairs, skipped


def split_eval(
    units: Sequence[Any], eval_size: int, seed: int, what: str = "rows"
) -> tuple[list[Any], list[Any]]:
    """``(train, eval)``: ``eval_size`` units drawn at random (seeded), the rest for training.
    Logs the held-out share, so that no rows leave training unsaid."""
    if eval_size >= len(units):
        raise ValueError(
            f"data.eval_size={eval_size} leaves nothing to train on: the data has only "
            f"{len(units)} rows; lower data.eval_size"
        )
    if eval_size:
        log.info(
            "data: %d %s; %d (%.1f%%) held out for evaluation (data.eval_size=%d), %d to train on",
            len(units),
            what,
            eval_size,
            100 * eval_size / len(units),
            eval_size,
            len(units) - eval_size,
        )
    else:
        log.info(
            "data: %d %s, all trained on; no held-out evaluation (set data.eval_size=N to hold out N)",
            len(units),
            what,
        )
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    held = set(order[:eval_size])
    return [u for i, u in enumerate(units) if i not in held], [units[i] for i in sorted(held)]


def load_pairs(data, tokenizer) -> tuple[list, list]:
    """``(train, eval)`` (chosen, rejected) pairs for DPO and RM training from a ``ChatDataConfig``.

    A malformed row raises ``DataRowError``; pairs longer than ``data.max_len`` raise or, with
    ``data.overlong=skip``, are dropped and counted in the log.
    """
    pairs, skipped = load_preferences(
        data.path, tokenizer, data.max_len, data.overlong, data.num_toy, data.seed, ChatColumns.of(data)
    )
    if skipped:
        log.warning("skipped %d pairs longer than data.max_len=%d", skipped, data.max_len)
    return split_eval(pairs, data.eval_size, data.seed, "pairs")
