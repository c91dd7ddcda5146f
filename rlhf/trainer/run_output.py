"""The run's output location as a driver sees it: checkpoints and ``final`` go to the location
itself (a shared directory or a storage URI, ``rlhf.storage``); the driver's own files
(``metrics.jsonl``, TensorBoard, ``logs/``) are written to a local directory, which for a URI is
a staging copy that ``publish`` uploads at every checkpoint and at the end."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlhf.storage import Store, local_mirror

# Driver-local files never uploaded: the tiny model is rebuilt from its seed by every run.
LOCAL_ONLY = ("tiny_model",)


class RunOutput:
    def __init__(self, location: str | Path):
        self.store = Store(location)
        self.location = self.store.location
        self.local: Path = local_mirror(location)

    @property
    def remote(self) -> bool:
        return self.store.remote

    def pull(self) -> None:
        """Before a resume from a URI: fetch the metrics rows written so far."""
        if self.remote and self.store.is_file("metrics.jsonl"):
            self.store.download("metrics.jsonl", self.local / "metrics.jsonl")

    def publish(self, groups: Iterable[Any] = (), rollout: Any = None) -> None:
        """For a URI: upload the driver's files and every worker's log file (a shared directory
        already holds them)."""
        if not self.remote or not self.local.is_dir():
            return
        for item in self.local.iterdir():
            if item.name not in LOCAL_ONLY:
                self.store.upload(item, item.name)
        for group in groups:
            group.upload_logs(self.location)
        if rollout is not None:
            rollout.upload_logs(self.location)
