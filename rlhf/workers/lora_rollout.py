"""vLLM rollout engines that serve the frozen base model plus the policy's LoRA adapter
(``model.lora`` with ``rollout.lora_sync=adapter``).

Each weight sync ships only the adapter tensors (through the object store, like the full
weights of ``RolloutEngine``). The engine writes them as a PEFT adapter directory in its own
temp dir (node-local: nothing is shared with the trainer's disk) and registers it with vLLM's
documented LoRA interface (``LLMEngine.add_lora`` with a ``LoRARequest``), under the weight
version as its id; every later generation uses the newest adapter. The last ``keep_versions``
adapters stay registered (``max_loras``): with ``train.max_staleness=k`` that is k+1, so the
adapter a rollout started under is still there until it ends; older ones are removed from the
engine and from disk.

With ``inflight_updates`` (a streaming run) an adapter is registered between two engine steps
without waiting for the requests in flight: vLLM binds an adapter to a request when it is
added, so those requests finish under the adapter they started with (all their tokens share
its version) and only new requests take the new one. An adapter still in use is not removed.
With partial rollouts the requests in flight are aborted and continue under the new adapter.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlhf.config.model import VLLM_LORA_RANKS
from rlhf.workers.rollout import RolloutEngine, RolloutEngineError

__all__ = ["LoraRolloutEngine", "vllm_max_lora_rank"]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


class LoraRolloutEngine(RolloutEngine):
    """A ``RolloutEngine`` with LoRA enabled; ``update_weights`` takes adapter tensors.

    Args:
        lora_rank: the adapter's rank (``model.lora.rank``).
        adapter_config: its ``adapter_config.json`` (``rlhf.models.lora.adapter_config``).
        keep_versions: adapters kept registered (``train.max_staleness + 1``).
        Everything else: ``RolloutEngine``.
    """

    def __init__(
        self,
        *args: Any,
        lora_rank: int,
        adapter_config: dict[str, Any],
        keep_versions: int = 1,
        **kwargs: Any,
    ) -> None:
        extra = {
            **(kwargs.pop("extra", None) or {}),
            "enable_lora": True,
            "max_lora_rank": vllm_max_lora_rank(lora_rank),
            "max_loras": keep_versions,
        }
        super().__init__(*args, extra=extra, **kwargs)
        self._adapter_config, self._keep = adapter_config, keep_versions
        self._dir = Path(tempfile.mkdtemp(prefix="rlhf-lora-"))
        self._loaded: deque[Any] = deque()
        self._stats["backend"] = "vllm+lora"

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Register the adapter ``named_tensors`` (PEFT names) as weight version ``version``."""
        from vllm.lora.request import LoRARequest

        from rlhf.models.lora import write_adapter

        t0 = time.perf_counter()
        version = self._stats["weight_version"] + 1 if version is None else int(version)
        path = write_adapter(self._dir / f"v{version}", dict(named_tensors), self._adapter_config)
        request = LoRARequest(f"policy-v{version}", version, str(path))
        # requests in flight keep the adapter they were added with (vLLM binds it then)
        with self._loading(version, switch_in_flight=False):
            self._register(request, path, self.batcher.versions_in_use())
        self._count_update(t0, version)

    _cache_holds_weights = False  # vLLM keys cached blocks by adapter

    def _register(self, request: Any, path: Path, in_use: set[int]) -> None:
        """Add ``request``'s adapter; drop the oldest beyond ``keep_versions`` that no request uses."""
        version = request.lora_int_id
        if self._loaded and self._loaded[-1].lora_int_id == version:  # the same version again (a retry)
            self.llm.llm_engine.remove_lora(version)
            self._loaded.pop()
        if not self.llm.llm_engine.add_lora(request):
            raise RolloutEngineError(f"vLLM refused the adapter of weight version {version} ({path})")
        self._loaded.append(request)
        for old in list(self._loaded)[: max(len(self._loaded) - self._keep, 0)]:
            if old.lora_int_id not in in_use:
                self._loaded.remove(old)
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)

    def set_inflight_updates(self, on: bool) -> None:
        """As ``RolloutEngine``'s, with the prefix cache kept: vLLM keys cached blocks by adapter,
        so a new adapter never reuses another's prefix."""
        self.inflight_updates = bool(on)

    def loaded_versions(self) -> list[int]:
        """Weight versions whose adapters the engine holds, oldest first."""
        return [r.lora_int_id for r in self._loaded]

    def _lora_request(self) -> Any:
        return self._loaded[-1] if self._loaded else None
