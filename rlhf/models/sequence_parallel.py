"""Sequence parallelism for the packed forward (DeepSpeed-Ulysses): one packed row across k ranks.

``model.sequence_parallel_size=k``: the k ranks of a sequence-parallel group receive the SAME
packed micro-batch (the driver deals micro-batches to ``ranks / k`` data-parallel shards). The
row ``[1, T]`` is padded to ``T' = k * ceil(T / k)`` (the pad is a sample of its own, so it
attends to nothing real) and rank ``r`` runs the model on tokens ``[r T'/k, (r+1) T'/k)``:
embeddings, MLPs, norms and RoPE are per token, so only attention needs the other ranks.

Attention (``ulysses_<inner>`` implementations registered here; ``ulysses_fa_2`` around
flash-attn 2): each rank holds all heads of its T'/k tokens; an all-to-all turns that into
``H / k`` heads of all T' tokens, the inner
packed attention (``packed_sdpa``, ``packed_varlen`` or flash-attn's varlen kernel) runs on
the whole row with the row's sample boundaries, so sliding windows, soft-capping and sample
isolation are the inner path's own; a second all-to-all brings each rank back all heads of
its own tokens. Key/value heads are repeated to the query heads first when there are fewer
than ``k`` of them, or a count ``k`` does not divide (GQA with KV heads < k).

Why Ulysses and not ring attention: the attention itself is the unchanged varlen kernel (every
sample boundary, window and soft-cap handled by code already checked against the per-sample
forward), the communication is two all-to-alls of activations per layer whatever the number
of samples in the row, and gloo has all-to-all, so the CPU test runs the same collectives as
NCCL. Its limit is ``k <= num_attention_heads`` (and k must divide them); ring attention
would lift that at the cost of a custom causal, windowed, varlen ring kernel.

Outputs: each rank computes its slice's per-token values (log-probs, entropy, values,
scores), and ``gather_row`` all-gathers them, so every rank of the group returns the full
row in the row's order and computes the same loss. Its backward hands each rank its own
slice of the gradient (not the sum over ranks): the group's ranks hold the same loss, and
the parameter gradients of one copy of it are the sum of the ranks' partial gradients,
which DeepSpeed's all-reduce adds up (``rlhf.workers.deepspeed_worker``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rlhf.data.types import FlatBatch
from rlhf.models.attention import VARLEN_KWARG_IMPLS, packed_mask, unwrap_model

__all__ = [
    "RowSplit",
    "SequenceParallel",
    "check_sequence_parallel",
    "enable_sequence_parallel",
    "gather_row",
    "sequence_parallel_of",
    "split_row",
]

PREFIX = "ulysses_"
_ATTR = "_rlhf_sequence_parallel"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` ranks, this one at ``rank`` within it."""

    size: int
    rank: int
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)


@dataclass(frozen=True)
class RowSplit:
    """One packed row split over a sequence-parallel group (see the module docstring)."""

    sp: SequenceParallel
    real: int  # T: tokens of the row
    padded: int  # T': T rounded up to a multiple of k
    cu: torch.Tensor  # [B + 1 (+1 for the pad)] int32 boundaries of the padded row
    max_len: int  # longest segment of the padded row
    input_ids: torch.Tensor  # [T'/k] this rank's tokens
    position_ids: torch.Tensor  # [T'/k]
    targets: torch.Tensor  # [T'/k] the token after each of this rank's positions (0 past the row)

    @property
    def local(self) -> int:
        return self.padded // self.sp.size

    def model_kwargs(self) -> dict:
        """Keyword arguments of this rank's forward: its tokens only, no mask, no cache."""
        return {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "attention_mask": None,
            "use_cache": False,
        }


def sequence_parallel_of(model: torch.nn.Module) -> SequenceParallel | None:
    """The group ``enable_sequence_parallel`` gave ``model`` (None: every rank holds whole rows)."""
    sp = getattr(unwrap_model(model), _ATTR, None)
    return sp if sp is not None and sp.size > 1 else None


def check_sequence_parallel(config: Any, size: int, attn_impl: str | None = None) -> None:
    """Raise ``ValueError`` when a model with this HF ``config`` cannot be split ``size`` ways."""
    heads = getattr(config, "num_attention_heads", None)
    field = "model.sequence_parallel_size"
    if heads is None:
        raise ValueError(f"{field}={size}: the model config has no num_attention_heads")
    if heads % size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{field}={size} must divide the model's {heads} attention heads "
            f"(Ulysses gives each rank heads/k of them); use one of {divisors}"
        )
    if attn_impl is not None and attn_impl not in VARLEN_KWARG_IMPLS:
        raise ValueError(
            f"{field}={size} needs a packed attention path (model.attn_impl auto, "
            f"{', '.join(VARLEN_KWARG_IMPLS)}); {attn_impl} attends across the split row"
        )


def enable_sequence_parallel(model: torch.nn.Module, sp: SequenceParallel, inner: str | None = None) -> str:
    """Run ``model``'s attention as Ulysses over ``sp`` (after ``prepare_model_for_packing``).

    ``inner``: the packed attention each rank runs on its heads (default: the model's current
    implementation). Returns the implementation now set (``ulysses_<inner>``); ``sp.size == 1``
    leaves the model as it is.
    """
    m = unwrap_model(model)
    if sp.size == 1:
        return m.config._attn_implementation
    inner = inner or m.config._attn_implementation
    check_sequence_parallel(m.config, sp.size, inner)
    name = wrapper_name(inner)
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _ulysses_for(inner))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, packed_mask)
    m.set_attn_implementation(name)
    setattr(m, _ATTR, sp)
    return name


def wrapper_name(inner: str) -> str:
    """The registered name of Ulysses around ``inner``. Without "flash" in it: transformers
    would read any such name as a flash-attn kernel to fetch from the hub (and the wrapper
    hands the inner flash path its own name, ``_ModuleView``)."""
    return PREFIX + inner.replace("flash_attention", "fa")


# ---------------------------------------------------------------------------- the row's split
def split_row(sp: SequenceParallel, batch: FlatBatch) -> RowSplit:
    """Pad ``batch``'s row to a multiple of ``sp.size`` and take this rank's slice."""
    global _CURRENT
    k, n = sp.size, batch.num_tokens
    padded = -(-max(n, 1) // k) * k
    pad = padded - n
    dev = batch.input_ids.device
    ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)])
    pos = torch.cat([batch.position_ids, torch.arange(pad, device=dev, dtype=batch.position_ids.dtype)])
    cu = batch.cu_seqlens.to(device=dev, dtype=torch.int32)
    if pad:
        cu = torch.cat([cu, cu.new_tensor([padded])])
    t = padded // k
    lo, hi = sp.rank * t, (sp.rank + 1) * t
    nxt = torch.cat([ids[1:], ids.new_zeros(1)])
    split = RowSplit(
        sp=sp,
        real=n,
        padded=padded,
        cu=cu,
        max_len=int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0,
        input_ids=ids[lo:hi],
        position_ids=pos[lo:hi],
        targets=nxt[lo:hi],
    )
    # The attention layers read it from here: a model's forward has no argument for it, and
    # gradient checkpointing re-runs the layers during backward, after this call returned.
    _CURRENT = split
    return split


_CURRENT: RowSplit | None = None


def _staged(x: torch.Tensor, sp: SequenceParallel) -> bool:
    """gloo on CUDA tensors (several ranks sharing one GPU, where NCCL refuses): through the host."""
    return x.is_cuda and dist.get_backend(sp.group) == "gloo"


class _GatherRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        src = x.detach().cpu() if _staged(x, sp) else x.contiguous()
        parts = [torch.empty_like(src) for _ in range(sp.size)]
        dist.all_gather(parts, src, group=sp.group)
        return torch.cat(parts).to(x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank of the group computes the same loss from the gathered row: each keeps
        # the gradient of its own slice (a sum over ranks would count the loss k times).
        return grad.chunk(ctx.sp.size)[ctx.sp.rank].contiguous(), None


def gather_row(local: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """This rank's ``[T'/k, ...]`` -> the row's ``[T, ...]`` on every rank of the group."""
    return _GatherRow.apply(local, split.sp)[: split.real]


# ---------------------------------------------------------------------------- all-to-all
def _all_to_all(x: torch.Tensor, scatter: int, gather: int, sp: SequenceParallel) -> torch.Tensor:
    src = x.cpu() if _staged(x, sp) else x
    chunks = [c.contiguous() for c in src.chunk(sp.size, dim=scatter)]
    out = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(out, chunks, group=sp.group)
    return torch.cat(out, dim=gather).to(x.device)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter: int, gather: int, sp: SequenceParallel) -> torch.Tensor:
        ctx.dims, ctx.sp = (scatter, gather), sp
        return _all_to_all(x, scatter, gather, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter, gather = ctx.dims
        return _all_to_all(grad, gather, scatter, ctx.sp), None, None, None


def _heads_to_row(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[1, H, T'/k, D] (all heads, my tokens) -> [1, H/k, T', D] (my heads, every token)."""
    return _AllToAll.apply(x, 1, 2, sp)


class _ConfigView:
    """A model config that names ``impl`` as its attention implementation, all else its own."""

    def __init__(self, config: Any, impl: str) -> None:
        self._config, self._attn_implementation = config, impl

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class _ModuleView:
    """An attention layer as the inner implementation must see it: transformers' flash path
    loads its kernel by ``module.config._attn_implementation``, which names the wrapper."""

    def __init__(self, module: torch.nn.Module, impl: str) -> None:
        self._module, self.config = module, _ConfigView(module.config, impl)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _ulysses_for(inner: str):
    def ulysses_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        fn = ALL_ATTENTION_FUNCTIONS[inner]
        split = _CURRENT
        if (
            split is None
            or query.shape[0] != 1
            or query.shape[2] != split.local
            or attention_mask is not None
        ):
            raise RuntimeError(
                f"sequence-parallel attention ({wrapper_name(inner)}) runs only inside the packed forward "
                "of rlhf.models.forward (one row split by split_row); this call has "
                f"query {tuple(query.shape)}"
            )
        sp = split.sp
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % sp.size:
            # GQA with fewer KV heads than ranks (or a count k does not divide): one KV head
            # per query head, so every rank's query heads find theirs after the all-to-all.
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        kwargs.update(
            cu_seq_lens_q=split.cu,
            cu_seq_lens_k=split.cu,
            max_length_q=split.max_len,
            max_length_k=split.max_len,
            position_ids=None,
        )
        out, _ = fn(
            _ModuleView(module, inner),
            _heads_to_row(query, sp),
            _heads_to_row(key, sp),
            _heads_to_row(value, sp),
            None,
            **kwargs,
        )
        # out: [1, T', H/k, D] -> [1, T'/k, H, D] (my tokens, every head)
        return _AllToAll.apply(out, 1, 2, sp), None

    return ulysses_attention_forward
