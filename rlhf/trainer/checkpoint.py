"""Run checkpoints shared by every driver: DeepSpeed state per group plus a small JSON state.

Layout: ``<output_dir>/checkpoints/step_<k>/<group name>/`` (model, optimizer, scheduler),
``step_<k>/trainer_state.json`` (step, data position, ...) and optional ``step_<k>/<name>.pt``
blobs (e.g. rollouts generated ahead of the trainer); ``checkpoints/latest`` names the newest
complete checkpoint and is replaced atomically, last, so a crash mid-save leaves the previous
one in force.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("rlhf")


@dataclass
class RunCheckpoint:
    path: Path
    state: dict
    blobs: dict[str, Any] = field(default_factory=dict)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The directory ``<output_dir>/checkpoints/latest`` names, or None if there is none."""
    latest = Path(output_dir) / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    path = latest.parent / latest.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"{latest} names {path.name}, which has no trainer_state.json: the checkpoint was deleted or "
            f"is incomplete. Point {latest} at a complete step_<k> directory or remove it to start over"
        )
    return path


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``step_<k>`` directories (never the one ``latest`` names)."""
    if keep <= 0:
        return
    root = Path(output_dir) / "checkpoints"
    current = latest_checkpoint(output_dir)
    steps = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )
    for old in steps[:-keep]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    groups: dict[str, Any],
    state: dict,
    blobs: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Save every group in ``groups`` (name -> ``ModelGroup``), ``state`` and ``blobs``; update
    ``latest``; keep the ``keep`` newest checkpoints (0 = all)."""
    root = Path(output_dir) / "checkpoints"
    path = root / f"step_{step}"
    for name, group in groups.items():
        group.save_checkpoint(str(path / name))  # the run state lives once, in trainer_state.json
    for name, obj in (blobs or {}).items():
        torch.save(obj, path / f"{name}.pt")
    (path / "trainer_state.json").write_text(json.dumps(state))
    tmp = root / "latest.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, root / "latest")
    log.info("saved checkpoint %s", path)
    prune_checkpoints(output_dir, keep)
    return path


def load_latest(
    output_dir: str | Path, groups: dict[str, Any], blobs: tuple[str, ...] = ()
) -> RunCheckpoint | None:
    """Restore ``groups`` from the newest checkpoint; returns it (state and the named ``blobs``
    that exist), or None if there is none."""
    path = latest_checkpoint(output_dir)
    if path is None:
        return None
    state = json.loads((path / "trainer_state.json").read_text())
    for name, group in groups.items():
        group.load_checkpoint(str(path / name))
    # Blobs are this run's own pickles (samples with their tensors), not foreign files.
    found = {
        n: torch.load(path / f"{n}.pt", weights_only=False) for n in blobs if (path / f"{n}.pt").is_file()
    }
    log.info("resumed from %s at step %d", path, state["step"])
    return RunCheckpoint(path, state, found)


def save_final(group: Any, out: Path, lora: bool, save_merged: bool) -> Path:
    """The trained model under ``<out>/final``: an HF model dir, or with LoRA a PEFT adapter dir
    (``PeftModel.from_pretrained(base, dir)``), plus ``<out>/final_merged`` (the adapter folded
    into the base) when ``train.save_merged``. Returns the ``final`` path."""
    final = Path(out) / "final"
    group.save_hf(str(final))
    if lora and save_merged:
        group.save_hf(str(Path(out) / "final_merged"), merged=True)
    return final
