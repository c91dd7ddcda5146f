"""Run checkpoints shared by every driver: DeepSpeed state per group plus a small JSON state.

Layout under ``train.output_dir`` (a shared directory or a storage URI, see ``rlhf.storage``):
``checkpoints/step_<k>/<group name>/`` (model, optimizer, scheduler; every rank writes or
uploads its own part), ``step_<k>/trainer_state.json`` (step, data position, ...) and optional
``step_<k>/<name>.pt`` blobs (e.g. rollouts generated ahead of the trainer);
``checkpoints/latest`` names the newest complete checkpoint. It is written last, whole (a rename,
or one object PUT), once every rank has stored its part, so a crash or a lost node mid-save
leaves the previous checkpoint in force.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.storage import Store, redact

log = logging.getLogger("rlhf")
LATEST = "checkpoints/latest"


@dataclass
class RunCheckpoint:
    path: str  # a directory or a URI
    state: dict
    blobs: dict[str, Any] = field(default_factory=dict)


def _latest_name(store: Store) -> str | None:
    if not store.is_file(LATEST):
        return None
    name = store.read_text(LATEST).strip()
    if not store.is_file(f"checkpoints/{name}/trainer_state.json"):
        raise FileNotFoundError(
            f"{redact(store.uri(LATEST))} names {name}, which has no trainer_state.json: the checkpoint was deleted "
            f"or is incomplete. Point it at a complete step_<k> directory or remove it to start over"
        )
    return name


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The location (path or URI) ``<output_dir>/checkpoints/latest`` names, or None if there is none."""
    store = Store(output_dir)
    name = _latest_name(store)
    return None if name is None else store.uri(f"checkpoints/{name}")


def forget_latest(output_dir: str | Path) -> None:
    """Detach the newest checkpoint from ``latest`` (its files stay)."""
    Store(output_dir).delete(LATEST)


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``step_<k>`` directories (never the one ``latest`` names),
    every rank's part with them."""
    if keep <= 0:
        return
    store = Store(output_dir)
    current = _latest_name(store)
    steps = sorted(
        (d for d in store.list_dirs("checkpoints") if d.startswith("step_") and d[5:].isdigit()),
        key=lambda d: int(d[5:]),
    )
    for old in steps[:-keep]:
        if old != current:
            store.delete(f"checkpoints/{old}")


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    groups: dict[str, Any],
    state: dict,
    blobs: dict[str, Any] | None = None,
    keep: int = 0,
) -> str:
    """Save every group in ``groups`` (name -> ``ModelGroup``), ``state`` and ``blobs``; update
    ``latest``; keep the ``keep`` newest checkpoints (0 = all). Returns the checkpoint's location."""
    store = Store(output_dir)
    rel = f"checkpoints/step_{step}"
    for name, group in groups.items():
        group.save_checkpoint(store.uri(f"{rel}/{name}"))  # the run state lives once, in trainer_state.json
    for name, obj in (blobs or {}).items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        store.write_bytes(f"{rel}/{name}.pt", buf.getvalue())
    store.write_text(f"{rel}/trainer_state.json", json.dumps(state))
    store.write_text(LATEST, f"step_{step}")
    log.info("saved checkpoint %s", redact(store.uri(rel)))
    prune_checkpoints(output_dir, keep)
    return store.uri(rel)


def load_latest(
    output_dir: str | Path, groups: dict[str, Any], blobs: tuple[str, ...] = ()
) -> RunCheckpoint | None:
    """Restore ``groups`` from the newest checkpoint; returns it (state and the named ``blobs``
    that exist), or None if there is none."""
    store = Store(output_dir)
    name = _latest_name(store)
    if name is None:
        return None
    rel = f"checkpoints/{name}"
    state = json.loads(store.read_text(f"{rel}/trainer_state.json"))
    for g, group in groups.items():
        group.load_checkpoint(store.uri(f"{rel}/{g}"))
    # Blobs are this run's own pickles (samples with their tensors), not foreign files.
    found = {
        n: torch.load(io.BytesIO(store.read_bytes(f"{rel}/{n}.pt")), weights_only=False)
        for n in blobs
        if store.is_file(f"{rel}/{n}.pt")
    }
    log.info("resumed from %s at step %d", redact(store.uri(rel)), state["step"])
    return RunCheckpoint(store.uri(rel), state, found)


def save_final(group: Any, output_dir: str | Path, lora: bool, save_merged: bool) -> str:
    """The trained model under ``<output_dir>/final``: an HF model dir, or with LoRA a PEFT adapter
    dir (``PeftModel.from_pretrained(base, dir)``), plus ``final_merged`` (the adapter folded into
    the base) when ``train.save_merged``. Returns the ``final`` location."""
    store = Store(output_dir)
    group.save_hf(store.uri("final"))
    if lora and save_merged:
        group.save_hf(store.uri("final_merged"), merged=True)
    return store.uri("final")
