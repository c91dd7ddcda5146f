"""Weight sync from the actor's DeepSpeed ranks to the vLLM rollout engines.

Transports (``rollout.weight_sync``):

=============  ===========================================================================
object_store   rank 0 gathers the full weights to CPU and puts them in Ray's object store
               once; every engine loads them (``RolloutEngine.update_weights``). CPU runs.
nccl           engines on GPUs of their own: rank 0 broadcasts over an NCCL group it
               shares with every engine worker, in packed buckets of
               ``rollout.sync_bucket_mb`` (vLLM's ``NCCLTrainerWeightTransferEngine``;
               never one Ray call per parameter).
ipc            engines colocated with the training ranks (``cluster.colocate_engines``):
               CUDA IPC handles of packed buckets, no copy through the host (vLLM's
               ``IPCTrainerWeightTransferEngine``).
auto           object_store on CPU; ipc when the engines are colocated; nccl otherwise.
=============  ===========================================================================

Every transport sends the same stream: ``model.named_parameters()`` in order (tied weights
once), renamed by ``engine_param_name``, gathered under ZeRO-3 one bucket at a time
(``plan_buckets``, ``gathered_weights``), so the transient full copy is one bucket, not
the model. The vLLM side receives through its documented RL interfaces only
(``collective_rpc`` of ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, ``sleep`` / ``wake_up``).

The nccl and ipc transports need CUDA and are not exercised on the CPU CI machine; the
bucket plan, the names and the per-bucket gather they share with ``object_store`` are.
This module imports neither vLLM nor Ray at module level.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.schema import WEIGHT_SYNC_MODES, check_weight_sync, resolve_weight_sync

__all__ = [
    "WEIGHT_SYNC_MODES",
    "EnginePoolClient",
    "TensorMeta",
    "check_weight_sync",
    "engine_init_payloads",
    "engine_param_name",
    "full_shape",
    "gathered_weights",
    "param_metas",
    "plan_buckets",
    "resolve_weight_sync",
]

# Module names that wrappers insert into parameter names; the engines load HF names.
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


# ---------------------------------------------------------------------------- names and buckets
def engine_param_name(name: str) -> str:
    """The HF checkpoint name an engine's ``load_weights`` expects for a trainer parameter.

    Drops wrapper modules (DeepSpeed/DDP ``module.``, ``torch.compile``'s ``_orig_mod.``,
    FSDP/activation-checkpoint wrappers) wherever they appear in the dotted path.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if not parts:
        raise ValueError(f"parameter name {name!r} has nothing left after removing wrapper prefixes")
    return ".".join(parts)


@dataclass(frozen=True)
class TensorMeta:
    """What one sent tensor will be: engine name, dtype and FULL shape (not a ZeRO-3 shard)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's real shape, also under ZeRO-3 (which partitions it in place; ``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def param_metas(model: torch.nn.Module) -> list[TensorMeta]:
    """One ``TensorMeta`` per ``named_parameters()`` entry (tied weights once), without gathering."""
    return [TensorMeta(engine_param_name(n), p.dtype, full_shape(p)) for n, p in model.named_parameters()]


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[range]:
    """Split the tensors, in order, into consecutive buckets of at most ``bucket_bytes``.

    Order is kept because both ends of a transfer enumerate the same stream. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own (it cannot be split: the engines load whole
    tensors). Returns index ranges into ``metas``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"rollout.sync_bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    buckets: list[range] = []
    start, size = 0, 0
    for i, m in enumerate(metas):
        if i > start and size + m.nbytes > bucket_bytes:
            buckets.append(range(start, i))
            start, size = i, 0
        size += m.nbytes
    if start < len(metas):
        buckets.append(range(start, len(metas)))
    return buckets


def gathered_weights(
    model: torch.nn.Module,
    bucket_bytes: int,
    *,
    zero3: bool,
    on_bucket: Callable[[], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(engine name, full tensor)`` for every parameter, gathering one bucket at a time.

    Under ZeRO-3 this is a collective: every rank must drain the iterator in lockstep. A
    yielded tensor is valid only until the next item is requested (its bucket is released
    after its last tensor): consumers copy or send it before asking for more. ``on_bucket``
    runs inside each bucket's gather, before its first tensor is yielded.
    """
    every = list(model.parameters())  # the order of named_parameters, hence of param_metas
    metas = param_metas(model)
    for bucket in plan_buckets(metas, bucket_bytes):
        params = [every[i] for i in bucket]
        if zero3:
            import deepspeed

            ctx: Any = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            if on_bucket is not None:
                on_bucket()
            for i, p in zip(bucket, params, strict=True):
                yield metas[i].name, p.data


# ---------------------------------------------------------------------------- vLLM transfer (GPU)
def engine_init_payloads(
    init_info: dict[str, Any], engines: int, workers_per_engine: int
) -> list[dict[str, Any]]:
    """The trainer's worker-side init payload, one per engine, with the NCCL ranks made unique.

    vLLM gives a worker the NCCL rank ``rank_offset + dp_rank * workers + worker_rank`` and the
    trainer sends ``rank_offset=1`` for every worker, which is unique only within ONE engine (its
    data-parallel replicas included). Our engines are separate ``LLM`` instances, each with
    ``dp_rank`` 0, so engine ``j`` gets ``rank_offset = 1 + j * workers_per_engine``: ranks
    ``1 .. engines * workers_per_engine``, the ``world_size - 1`` the trainer declared. Payloads
    without ``rank_offset`` (ipc) are the same for every engine.
    """
    if "rank_offset" not in init_info:
        return [init_info] * engines
    base = int(init_info["rank_offset"])
    return [{**init_info, "rank_offset": base + j * workers_per_engine} for j in range(engines)]


class EnginePoolClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over our engine actors (structural: four methods).

    Each call fans out to every engine actor and waits at most ``timeout_s`` for all of them.
    """

    def __init__(self, engines: list[Any], timeout_s: float, workers_per_engine: int = 1) -> None:
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine

    def _wait(self, method: str, refs: list[Any]) -> None:
        import ray

        try:
            ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"weight transfer: rollout engines did not finish {method} within {self.timeout_s:.0f}s "
                "(raise train.rollout_timeout_s, or check the engines' logs)"
            ) from e

    def _all(self, method: str, *args: Any) -> None:
        self._wait(method, [getattr(e, method).remote(*args) for e in self.engines])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payloads = engine_init_payloads(init_info, len(self.engines), self.workers_per_engine)
        self._wait(
            "transfer_init",
            [e.transfer_init.remote(p) for e, p in zip(self.engines, payloads, strict=True)],
        )

    def start_weight_update(self) -> None:
        self._all("transfer_start")

    def update_weights(self, update_info: Any) -> None:
        self._all("transfer_update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("transfer_finish")


def vllm_weight_source(model: torch.nn.Module, bucket_bytes: int, *, zero3: bool) -> Any:
    """``gathered_weights`` as a vLLM ``WeightSource`` (imports vLLM: call on the trainer rank).

    The ``WeightSource`` contract changed between the vLLM the CPU tests run (0.32: a
    ``metadata()`` method and ``__iter__``) and the one the GPU extra installs (0.33: a
    ``metadata`` cached property, ``iter_full()``, per-parameter owners; a ``metadata``
    method is a TypeError when the class is defined). Both are served from the same stream;
    every rank owns every parameter (ZeRO gathers them), so the default owners apply.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    def declared() -> list[Any]:
        return [ParamMeta(m.name, m.dtype, m.shape) for m in param_metas(model)]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        return gathered_weights(model, bucket_bytes, zero3=zero3)

    if isinstance(inspect.getattr_static(WeightSource, "metadata"), property):  # vLLM >= 0.33

        class _GatheredSource(WeightSource):
            @functools.cached_property
            def metadata(self) -> list[Any]:  # type: ignore[override]
                return declared()

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                return stream()

    else:  # vLLM 0.32

        class _GatheredSource(WeightSource):  # type: ignore[no-redef]
            def metadata(self) -> list[Any]:
                return declared()

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return stream()

    return _GatheredSource()


def open_trainer_transfer(
    mode: str,
    *,
    client: EnginePoolClient,
    source: Any,
    rank: int,
    bucket_bytes: int,
    master_address: str = "",
    master_port: int = 0,
    engine_workers: int = 0,
) -> Any:
    """vLLM's trainer-side transfer engine for ``mode`` (nccl | ipc); rank 0 is the sender.

    nccl: one group of rank 0 + every engine worker (``world_size = 1 + engine_workers``),
    packed buffers of ``bucket_bytes``. ipc: packed CUDA IPC buffers of ``bucket_bytes``.
    Call on every training rank of the actor (non-senders only join the ZeRO-3 gathers).
    """
    if mode == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            rank=rank,
            master_address=master_address,
            master_port=master_port,
            world_size=1 + engine_workers,
            packed=True,
            packed_buffer_size_bytes=bucket_bytes,
        )
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    if mode == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes)
        return IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    raise ValueError(f"open_trainer_transfer: {mode!r} is not a vLLM transfer (nccl | ipc)")
