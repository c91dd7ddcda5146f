"""What every rollout backend (vLLM and ``hf``) keeps about itself: liveness, counters and
timings (``stats``), its log file, and the cores it computes with on CPU."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from rlhf.workers.placement import cpu_threads

__all__ = ["EngineCounters"]


class EngineCounters:
    """``ping``/``stats`` and the counters every rollout backend keeps (vLLM and ``hf``)."""

    log_file: Path | None = None

    def upload_log(self, output_dir: str) -> None:
        """Copy this engine's log file to ``<output_dir>/logs/`` (a URI: logs stay on their node)."""
        if self.log_file is not None and self.log_file.is_file():
            from rlhf.storage import Store

            Store(output_dir).upload(self.log_file, f"logs/{self.log_file.name}")

    def set_cpu_share(self, share: float) -> None:
        """On CPU, generate with ``share`` of this node's cores (0: the CPUs Ray gave the actor).
        The driver knows what else computes meanwhile: in a synchronous run nothing does (the
        trainer waits for the batch), so the engines may use the cores the ranks leave idle."""
        if not torch.cuda.is_available():
            self._use_threads(cpu_threads(share) if share > 0 else self._own_threads)

    def _use_threads(self, n: int) -> None:
        raise NotImplementedError

    def _start_counters(self, backend: str, t0: float) -> None:
        self._stats: dict[str, Any] = {
            "backend": backend,
            "pid": os.getpid(),
            "startup_s": time.perf_counter() - t0,
            "generate_calls": 0,
            "prompts": 0,
            "completions": 0,
            "generated_tokens": 0,
            "generate_s": 0.0,
            "weight_updates": 0,
            "weight_update_s": 0.0,
            "weight_version": 0,
        }

    def set_version(self, version: int) -> None:
        """Number the weights held now ``version`` (they do not change)."""
        self._stats["weight_version"] = int(version)

    def ping(self) -> str:
        """Liveness probe; returns once the engine is constructed."""
        return f"ok pid={os.getpid()}"

    def stats(self) -> dict[str, Any]:
        """Counters and timings since start-up (``weight_version`` = last version loaded;
        ``busy_s``: time in engine steps, ``steps``: their number, ``max_in_flight``: most requests
        batched at once, ``inflight_updates``: weight loads that landed with requests in flight,
        ``continued``: completions a weight load aborted and continued (partial rollouts),
        ``compute_threads``: intra-op threads of its last generation)."""
        batcher = getattr(self, "batcher", None)
        extra = (
            {"compute_threads": torch.get_num_threads()}
            if batcher is None
            else {
                "busy_s": batcher.busy_s,
                "steps": batcher.steps,
                "max_in_flight": batcher.max_in_flight,
                "inflight_updates": batcher.inflight_updates,
                "continued": batcher.continued,
                "compute_threads": batcher.compute_threads,
            }
        )
        return {**self._stats, **extra}

    def _count_generate(self, results: list[list[dict]], t0: float) -> None:
        s = self._stats
        s["generate_calls"] += 1
        s["prompts"] += len(results)
        s["completions"] += sum(len(r) for r in results)
        s["generated_tokens"] += sum(len(c["token_ids"]) for r in results for c in r)
        s["generate_s"] += time.perf_counter() - t0

    def _count_update(self, t0: float, version: int | None) -> None:
        s = self._stats
        s["weight_updates"] += 1
        s["weight_update_s"] += time.perf_counter() - t0
        s["weight_version"] = version if version is not None else s["weight_version"] + 1
