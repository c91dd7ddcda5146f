"""The weights half of ``rlhf.workers.deepspeed_worker.ModelWorker``: what a rank sends to the
rollout engines (full weights, a LoRA adapter, or LoRA merged), the vLLM transfer, and the HF
(or PEFT adapter) directory a run ends with. A mixin: it reads the worker's ``hf_model``,
``rank``, ``zero3``, ``lora``, ``lora_sync`` and ``model_dir``."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from rlhf.storage import staged_write
from rlhf.workers.weight_sync import (
    EnginePoolClient,
    engine_param_name,
    gathered_weights,
    open_trainer_transfer,
    vllm_weight_source,
)

logger = logging.getLogger("rlhf.workers.deepspeed_worker")

# Bytes gathered at once under ZeRO-3 by get_weights when no bucket size is given.
DEFAULT_SYNC_BUCKET_BYTES = 256 << 20


class WorkerWeights:
    hf_model: torch.nn.Module
    rank: int
    zero3: bool
    lora: Any
    lora_sync: str
    model_dir: str

    # ---------------------------------------------------------------- weights
    def get_weights(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
        """Full weights in HF naming on rank 0 (None elsewhere). Collective under ZeRO-3.

        The parameters (tied ones once) come from ``weight_sync.gathered_weights``, one bucket
        of at most ``bucket_bytes`` gathered at a time; persistent buffers are added as they are.
        ``last_gather()`` then reports the buckets and the largest gathered size seen.
        """
        model = self.hf_model
        self._gather_stats = {"buckets": 0, "peak_gathered_bytes": 0}
        stream = gathered_weights(model, bucket_bytes, zero3=self.zero3, on_bucket=self._on_bucket)
        if self.lora is not None:
            return self._lora_weights(stream, merged=self.lora_sync == "merged")
        out: dict[str, torch.Tensor] = {}
        for name, tensor in stream:
            if self.rank == 0:
                out[name] = tensor.detach().cpu().clone()
        if self.rank != 0:
            return None
        for name, value in model.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.nn.Parameter):  # a persistent buffer
                out[engine_param_name(name)] = value.detach().cpu().clone()
        return out

    def _lora_weights(self, stream: Any, merged: bool) -> dict[str, torch.Tensor] | None:
        """A LoRA model's sync payload on rank 0: the adapter tensors (PEFT names), or the full
        HF-named weights with the adapter folded in. Every rank drains the (collective) stream."""
        from rlhf.models.lora import adapter_tensors, merged_tensors, transposed_modules

        if self.rank != 0:
            for _ in stream:
                pass
            return None
        if not merged:
            return adapter_tensors(stream)
        out = dict(merged_tensors(stream, self.lora.scaling, transposed_modules(self.hf_model)))
        for name, value in self.hf_model.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.nn.Parameter):
                out[engine_param_name(name)] = value.detach().cpu().clone()
        return out

    def _on_bucket(self) -> None:
        """Inside each bucket's gather: count it and measure what is gathered right now."""
        stats = self._gather_stats
        stats["buckets"] += 1
        if self.zero3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            now = sum(
                p.ds_numel * p.element_size()
                for p in self.hf_model.parameters()
                # Persistent parameters (below stage3_param_persistence_threshold) are never
                # partitioned: always whole, not part of any gather.
                if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
                and not getattr(p, "ds_persist", False)
            )
            stats["peak_gathered_bytes"] = max(stats["peak_gathered_bytes"], now)

    def last_gather(self) -> dict[str, int]:
        """Buckets of the last ``get_weights`` and the most bytes ZeRO-3 held gathered at once."""
        return dict(getattr(self, "_gather_stats", {}))

    def get_weights_ref(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES) -> list | None:
        """``get_weights`` put in the object store by this rank: ``[ObjectRef]`` on rank 0.

        The ref is wrapped in a list so Ray hands it to the driver unresolved: the weights go
        from this worker to the rollout engines without a copy through the driver.
        """
        import ray

        weights = self.get_weights(bucket_bytes)
        return None if weights is None else [ray.put(list(weights.items()))]

    def open_weight_transfer(
        self, mode: str, engines: list, engine_workers: int, bucket_bytes: int, timeout_s: float
    ) -> None:
        """Join vLLM's trainer-side transfer (nccl | ipc) to ``engines``; every rank calls it. GPU only.

        Rank 0 is the sender and opens the NCCL rendezvous on its own node and a free port.
        """
        address, port = "", 0
        if self.rank == 0 and mode == "nccl":
            import ray

            from rlhf.workers.placement import free_port

            address, port = ray.util.get_node_ip_address(), free_port()
        self._transfer = open_trainer_transfer(
            mode,
            client=EnginePoolClient(
                engines, timeout_s, workers_per_engine=engine_workers // max(len(engines), 1)
            ),
            source=vllm_weight_source(self.hf_model, bucket_bytes, zero3=self.zero3),
            rank=self.rank,
            bucket_bytes=bucket_bytes,
            master_address=address,
            master_port=port,
            engine_workers=engine_workers,
        )

    def send_weights(self) -> None:
        """One full weight transfer through ``open_weight_transfer``'s engine (collective)."""
        transfer = getattr(self, "_transfer", None)
        if transfer is None:
            raise RuntimeError("send_weights before open_weight_transfer")
        transfer.send_weights()

    def save_hf(self, path: str, merged: bool = False) -> None:
        """Rank 0 writes an HF model dir (+ the tokenizer of ``model_dir``). Collective under ZeRO-3.

        With LoRA: a PEFT adapter dir (``PeftModel.from_pretrained(base, path)``), or with
        ``merged`` the HF model with the adapter folded in. ``path`` may be a storage URI: rank 0
        writes into node-local staging and uploads it."""
        writing = staged_write(path, f"final-{self.rank}") if self.rank == 0 else contextlib.nullcontext(path)
        with writing as local:
            if self.lora is not None and not merged:
                self._save_adapter(local)
            else:
                self._save_hf_model(local)

    def _save_hf_model(self, path: str) -> None:
        import torch.distributed as dist

        sd = (
            self.get_weights()
            if self.lora is None
            else self._lora_weights(
                gathered_weights(self.hf_model, DEFAULT_SYNC_BUCKET_BYTES, zero3=self.zero3), merged=True
            )
        )
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            if self.lora is not None:  # the plain architecture, without PEFT's layers
                self.hf_model.config.save_pretrained(path)
                from safetensors.torch import save_file

                save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            else:
                self.hf_model.save_pretrained(path, state_dict=sd, safe_serialization=True)
            try:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(path)
            except (OSError, ValueError) as e:  # a model dir without tokenizer files
                logger.warning("save_hf: no tokenizer copied from %s (%s)", self.model_dir, e)
        dist.barrier()

    def _save_adapter(self, path: str) -> None:
        import torch.distributed as dist

        from rlhf.models.lora import adapter_config, write_adapter

        tensors = self._lora_weights(
            gathered_weights(self.hf_model, DEFAULT_SYNC_BUCKET_BYTES, zero3=self.zero3), merged=False
        )
        if self.rank == 0:
            config = adapter_config(self.lora, self.hf_model.config.model_type, self.model_dir)
            write_adapter(path, tensors, config)
        dist.barrier()
