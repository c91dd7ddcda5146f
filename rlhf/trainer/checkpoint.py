"""Run checkpoints shared by every driver: DeepSpeed state per group plus a small JSON state.

Layout: ``<output_dir>/checkpoints/step_<k>/<group name>/`` (model, optimizer, scheduler)
and ``step_<k>/trainer_state.json`` (step, data position, ...); ``checkpoints/latest``
names the newest complete checkpoint and is written last, so a crash mid-save leaves the
previous one in force.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("rlhf")


def save_checkpoint(output_dir: str | Path, step: int, groups: dict[str, Any], state: dict) -> Path:
    """Save every group in ``groups`` (name -> ``ModelGroup``) and ``state``; update ``latest``."""
    root = Path(output_dir) / "checkpoints"
    path = root / f"step_{step}"
    for name, group in groups.items():
        group.save_checkpoint(str(path / name))  # the run state lives once, in trainer_state.json
    (path / "trainer_state.json").write_text(json.dumps(state))
    (root / "latest").write_text(path.name)
    log.info("saved checkpoint %s", path)
    return path


def load_latest(output_dir: str | Path, groups: dict[str, Any]) -> dict | None:
    """Restore ``groups`` from the newest checkpoint; returns its state, or None if there is none."""
    latest = Path(output_dir) / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    path = latest.parent / latest.read_text().strip()
    state = json.loads((path / "trainer_state.json").read_text())
    for name, group in groups.items():
        group.load_checkpoint(str(path / name))
    log.info("resumed from %s at step %d", path, state["step"])
    return state
