"""Packing-safe attention: no token attends to another sample of the same packed row.

A packed row is ``[1, T]`` holding several samples back to back; ``cu_seq_lens_q`` (or the
position_ids resets) marks the boundaries. ``prepare_model_for_packing(model, attn_impl)``
switches a transformers model to one of these paths:

* ``flash_attention_2`` (CUDA, fp16/bf16, needs the flash-attn package): transformers passes
  ``cu_seq_lens_q/k`` to ``flash_attn_varlen_func``; sliding windows and soft-capping included.
* ``packed_varlen`` (registered here; CUDA, fp16/bf16, nothing to build): PyTorch's own
  ``torch.nn.attention.varlen.varlen_attn`` (flash kernels shipped inside torch) over the
  whole row in one call. A layer it cannot serve (soft-capping, attention dropout, a sliding
  window on a torch whose ``varlen_attn`` has no ``window_size``) runs ``packed_sdpa`` instead.
* ``packed_sdpa`` (registered here; the CPU default, and fp32 on CUDA): causal
  ``F.scaled_dot_product_attention`` per group of samples of similar length (right-padded to
  the group's longest, at most ``_GROUP_SLACK`` x their own ``sum(n_i^2)``; a lone long
  sample is its own group), so no ``[T, T]`` mask is ever built and a row of many short
  samples takes a few calls (64 samples of ~35 tokens, fwd+bwd: 110 -> 80 ms on 2 cores). A sliding window adds a band only where a sample is longer
  than the window; soft-capped logits (Gemma2/3) are computed explicitly, in query chunks,
  per sample. Padded batches and KV-cache decoding fall back to transformers' ``sdpa``.
* ``sdpa`` / ``eager``: transformers detects the packing from the position_ids resets (only
  with ``attention_mask=None`` AND ``use_cache=False``, both always passed here) and builds a
  dense ``[T, T]`` block-diagonal mask: a warning says so when they are chosen.
* ``flex_attention`` is not offered: torch 2.13 has no FlexAttention backward on CPU and its
  forward was 4.5x slower than ``packed_sdpa`` (2.35 s vs 0.52 s, T=4096, no grad).

``"auto"`` (``choose_attn_impl``): CUDA + fp16/bf16 -> ``flash_attention_2`` if flash-attn
imports, else ``packed_varlen`` if the installed torch has ``varlen_attn``, else
``packed_sdpa`` (per-sample SDPA, which PyTorch runs on its flash backend for fp16/bf16);
anything else (CPU, fp32) -> ``packed_sdpa``.

Measured on 2 CPU cores (torch 2.13, fp32, Llama hidden 256, 4 layers, 4 heads / 2 KV heads,
one packed row, lognormal sample lengths; median of 4):

==========  =====================  ==========  =============
T / B       path                   forward     forward+bwd
==========  =====================  ==========  =============
4096 / 18   packed_sdpa            0.14 s      0.47 s
4096 / 18   sdpa (dense mask)      0.51 s      1.43 s
4096 / 18   eager (dense mask)     1.45 s      8.67 s
8192 / 31   packed_sdpa            0.30 s      1.06 s
8192 / 31   sdpa (dense mask)      2.71 s      10.07 s
==========  =====================  ==========  =============
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from rlhf.config.schema import ATTN_IMPLS

PACKED_SDPA = "packed_sdpa"
PACKED_VARLEN = "packed_varlen"
# Paths that read cu_seq_lens_q/k from the forward kwargs (packed_model_kwargs passes them).
VARLEN_KWARG_IMPLS = (PACKED_SDPA, PACKED_VARLEN, "flash_attention_2", "flash_attention_3")
_DENSE_MASK_IMPLS = ("sdpa", "eager")

# Queries per chunk on the explicit (banded / soft-capped) path: bounds the score tensor to
# [heads, chunk, chunk + window] per sample instead of [heads, n, n].
_QUERY_CHUNK = 1024


# ---------------------------------------------------------------------------- boundaries
# (boundaries tensor, its values as ints): every layer of one forward gets the same tensor.
_BOUNDS_CACHE: tuple[torch.Tensor | None, list[int]] = (None, [])


def _segment_bounds(cu: torch.Tensor | None, position_ids: torch.Tensor | None, total: int) -> list[int]:
    """Sample boundaries [0, ..., T] as Python ints (one host sync per forward, not per layer)."""
    global _BOUNDS_CACHE
    key = cu if cu is not None else position_ids
    if key is not None and _BOUNDS_CACHE[0] is key:
        return _BOUNDS_CACHE[1]
    if cu is not None:
        bounds = [int(x) for x in cu.tolist()]
    elif position_ids is not None:
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(torch.diff(pos, prepend=pos[:1] - 1) != 1).reshape(-1).tolist()
        bounds = [*starts, total] if starts and starts[0] == 0 else [0, *starts, total]
    else:
        bounds = [0, total]
    if bounds[-1] != total:
        raise ValueError(
            f"packed attention: sample boundaries end at {bounds[-1]} but the row has {total} tokens"
        )
    # Identity is a safe key: the cache holds a reference, so the id cannot be reused.
    _BOUNDS_CACHE = (key, bounds)
    return bounds


def _unsupported(kwargs: dict) -> None:
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "packed attention does not implement attention sinks (s_aux, GPT-OSS); "
            "use model.attn_impl=flash_attention_2 or eager"
        )


# ---------------------------------------------------------------------------- per-sample SDPA
def _banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention of ONE sample ([1, H, n, D]) with a sliding window and/or soft-capping.

    Window ``W`` as in transformers: query ``i`` sees keys ``j`` with ``i - W < j <= i``.
    Queries go in chunks; each chunk sees only the keys its window can reach.
    """
    n, groups = q.shape[2], q.shape[1] // k.shape[1]
    if softcap is not None and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs = []
    for a in range(0, n, _QUERY_CHUNK):
        b = min(n, a + _QUERY_CHUNK)
        lo = 0 if window is None else max(0, a - window + 1)
        qpos = torch.arange(a, b, device=q.device)[:, None]
        kpos = torch.arange(lo, b, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        qc, kc, vc = q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b]
        if softcap is None:
            outs.append(
                F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=allowed, dropout_p=dropout, scale=scale, enable_gqa=groups > 1
                )
            )
            continue
        # Same order of operations as transformers' eager Gemma attention (softmax in fp32).
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
        probs = F.dropout(probs.to(q.dtype), p=dropout, training=dropout > 0)
        outs.append(torch.matmul(probs, vc))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _sample_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """One sample: plain causal SDPA unless a window is shorter than it or logits are capped."""
    n = q.shape[2]
    if softcap is None and (window is None or n <= window):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return _banded_attention(
        q,
        k,
        v,
        scale=scale if scale is not None else q.shape[-1] ** -0.5,
        window=window,
        softcap=softcap,
        dropout=dropout,
    )


def _is_packed_row(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention run separately on each packed sample. q/k/v: [1, heads, T, head_dim]."""
    if not _is_packed_row(query, key, attention_mask):
        # Padded batches and KV-cache decoding: behave exactly like transformers' sdpa.
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    _unsupported(kwargs)
    bounds = _segment_bounds(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), query.shape[2])
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if softcap is None:
        # Samples the window does not cut: a few batched SDPA calls instead of one per sample.
        out = _grouped_causal_attention(query, key, value, bounds, window, scale=scaling, dropout=dropout)
        if out is not None:
            return out.transpose(1, 2), None
    outs = [
        _sample_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            scale=scaling,
            window=window,
            softcap=softcap,
            dropout=dropout,
        )
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        if e > s
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2), None


# ---------------------------------------------------------------------------- length groups
# Padding a group to its longest sample may cost at most this much more attention than the
# samples alone (sum n_i^2); in exchange a row of many short samples takes a handful of SDPA
# calls instead of one per sample, which dominated short-sample rows (per-call overhead,
# most of all in the backward).
_GROUP_SLACK = 1.25


@dataclass(frozen=True)
class _Group:
    gather: torch.Tensor  # [B * L] row positions (a pad repeats its sample's first token)
    keep: torch.Tensor | None  # [B * L] real positions; None when no sample is padded
    size: int  # B
    length: int  # L


@dataclass(frozen=True)
class _GroupPlan:
    groups: list[_Group]
    order: torch.Tensor  # [T] index into the groups' concatenated outputs, in row order


_PLAN_CACHE: tuple[tuple, _GroupPlan | None] = ((), None)


def _plan_groups(bounds: list[int], device: torch.device) -> _GroupPlan:
    """Samples sorted by length, grouped while padding to the group's longest stays within
    ``_GROUP_SLACK`` of their own attention cost. One plan per forward (cached by boundaries)."""
    global _PLAN_CACHE
    key = (tuple(bounds), device)
    if _PLAN_CACHE[0] == key and _PLAN_CACHE[1] is not None:
        return _PLAN_CACHE[1]
    segs = sorted(((e - s, s) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s), reverse=True)
    members: list[list[tuple[int, int]]] = []
    sumsq = 0
    for n, s in segs:
        if members and (len(members[-1]) + 1) * members[-1][0][0] ** 2 <= _GROUP_SLACK * (sumsq + n * n):
            members[-1].append((n, s))
            sumsq += n * n
        else:
            members.append([(n, s)])
            sumsq = n * n
    groups, dests = [], []
    for mem in members:
        length = mem[0][0]
        lens = torch.tensor([n for n, _ in mem], device=device)
        starts = torch.tensor([s for _, s in mem], device=device)
        pos = torch.arange(length, device=device)
        real = pos[None, :] < lens[:, None]  # [B, L]
        gather = (starts[:, None] + torch.where(real, pos[None, :], 0)).reshape(-1)
        keep = real.reshape(-1) if bool((lens != length).any()) else None
        groups.append(_Group(gather, keep, len(mem), length))
        dests.append(gather if keep is None else gather[keep])
    dest = torch.cat(dests)
    order = torch.empty_like(dest)
    order[dest] = torch.arange(len(dest), device=device)
    plan = _GroupPlan(groups, order)
    _PLAN_CACHE = (key, plan)
    return plan


def _grouped_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    window: int | None,
    *,
    scale: float | None,
    dropout: float,
) -> torch.Tensor | None:
    """Causal attention of every sample of the row, batched by length group: [1, H, T, D].

    Samples are right-padded to the group's longest, so the causal mask alone keeps every
    real query off the pads (they come after it); the pads' own outputs are dropped. None
    when a sliding window is shorter than some sample (those need the band).
    """
    if window is not None and max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)) > window:
        return None
    plan = _plan_groups(bounds, query.device)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for g in plan.groups:

        def rows(t: torch.Tensor, g: _Group = g) -> torch.Tensor:
            # [1, H, T, D] -> [B, H, L, D]
            h, d = t.shape[1], t.shape[3]
            return t[0].index_select(1, g.gather).reshape(h, g.size, g.length, d).transpose(0, 1)

        o = F.scaled_dot_product_attention(
            rows(query),
            rows(key),
            rows(value),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        o = o.transpose(0, 1).reshape(o.shape[1], g.size * g.length, o.shape[3])  # [H, B*L, D]
        outs.append(o if g.keep is None else o[:, g.keep])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.index_select(1, plan.order).unsqueeze(0)


# ---------------------------------------------------------------------------- torch varlen (CUDA)
@dataclass(frozen=True)
class VarlenKernel:
    """``torch.nn.attention.varlen.varlen_attn`` and which keywords the installed torch has.

    Its keywords changed between releases (``is_causal`` in the first, ``window_size`` and
    ``enable_gqa`` later), so the call is built from the signature rather than a version.
    """

    fn: Callable[..., torch.Tensor]
    has_window: bool
    has_is_causal: bool
    has_gqa: bool

    def supports(self, window: int | None) -> bool:
        return self.has_window or (window is None and self.has_is_causal)

    def __call__(self, q, k, v, cu, max_len: int, *, scale: float | None, window: int | None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, H_kv, D] -> [T, H, D], causal within each sample."""
        kw: dict = {"scale": scale}
        if self.has_window:
            kw["window_size"] = (window - 1 if window is not None else -1, 0)
        else:
            kw["is_causal"] = True
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            if self.has_gqa:
                kw["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.fn(q, k, v, cu, cu, max_len, max_len, **kw)


@functools.cache
def torch_varlen_kernel() -> VarlenKernel | None:
    """The installed torch's varlen attention, or None (torch too old, or no causal mode)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kernel = VarlenKernel(
        fn=varlen_attn,
        has_window="window_size" in params,
        has_is_causal="is_causal" in params,
        has_gqa="enable_gqa" in params,
    )
    return kernel if kernel.has_window or kernel.has_is_causal else None


def packed_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The whole packed row in one ``varlen_attn`` call; ``packed_sdpa`` where it cannot serve."""
    kernel = torch_varlen_kernel()
    window = kwargs.get("sliding_window")
    if (
        kernel is None
        or not _is_packed_row(query, key, attention_mask)
        or not kernel.supports(window)
        or kwargs.get("softcap") is not None
        or (dropout > 0 and module.training)
    ):
        return packed_sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    _unsupported(kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None or max_len is None:
        bounds = _segment_bounds(None, kwargs.get("position_ids"), query.shape[2])
        cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
        max_len = max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = kernel(q, k, v, cu.to(torch.int32), int(max_len), scale=scaling, window=window)
    return out.unsqueeze(0), None


# ---------------------------------------------------------------------------- registration
def packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for one unpadded row (the attention splits it by sample); sdpa's mask otherwise."""
    b, q, kv = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    if attention_mask is None and b == 1 and q == kv and not kwargs.get("q_offset"):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    for name, fn in (
        (PACKED_SDPA, packed_sdpa_attention_forward),
        (PACKED_VARLEN, packed_varlen_attention_forward),
    ):
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, packed_mask)


_register()


# ---------------------------------------------------------------------------- choice
def unwrap_model(model: torch.nn.Module) -> PreTrainedModel:
    """The HF model inside DeepSpeed/DDP-style wrappers (they expose it as ``.module``)."""
    m = model
    while not isinstance(m, PreTrainedModel) and hasattr(m, "module"):
        m = m.module
    if not isinstance(m, PreTrainedModel):
        raise TypeError(
            f"expected a transformers PreTrainedModel (or a wrapper of one), got {type(model).__name__}"
        )
    return m


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_attn_impl(device_type: str, dtype: torch.dtype, *, flash_attn: bool, torch_varlen: bool) -> str:
    """The ``"auto"`` rule (pure): the fastest packing-safe path installed for this device/dtype."""
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if flash_attn:
            return "flash_attention_2"
        if torch_varlen:
            return PACKED_VARLEN
    return PACKED_SDPA


def resolve_attn_impl(model: torch.nn.Module, attn_impl: str = "auto") -> str:
    """Resolve ``"auto"`` for ``model``'s device and dtype (``choose_attn_impl``).

    Raises ``ValueError`` for a name outside ``rlhf.config.schema.ATTN_IMPLS``.
    """
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"model.attn_impl={attn_impl!r} is not valid; use one of {', '.join(ATTN_IMPLS)}")
    if attn_impl != "auto":
        return attn_impl
    p = next(unwrap_model(model).parameters())
    on_cuda = p.device.type == "cuda"
    return choose_attn_impl(
        p.device.type,
        p.dtype,
        flash_attn=on_cuda and flash_attn_available(),
        torch_varlen=on_cuda and torch_varlen_kernel() is not None,
    )


def prepare_model_for_packing(model: torch.nn.Module, attn_impl: str = "auto") -> str:
    """Switch ``model`` to a packing-safe attention implementation; return the name used.

    ``attn_impl``: ``"auto"`` (see ``choose_attn_impl``) or a name of ``ATTN_IMPLS`` (shared
    with the config schema); any other name raises ``ValueError``. Call it after the model is
    on its device so that ``"auto"`` sees the device and dtype.
    """
    m = unwrap_model(model)
    name = resolve_attn_impl(m, attn_impl)
    if name == PACKED_VARLEN and torch_varlen_kernel() is None:
        raise ValueError(
            "model.attn_impl=packed_varlen needs torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA); "
            "use packed_sdpa"
        )
    if name in _DENSE_MASK_IMPLS:
        warnings.warn(
            f"model.attn_impl={name} builds a dense [T, T] mask for every packed row; "
            "packed_sdpa (or auto) attends per sample without it",
            stacklevel=2,
        )
    m.set_attn_implementation(name)
    if m.config._attn_implementation != name:
        raise ValueError(f"{type(m).__name__} did not accept attn_implementation={name!r}")
    return name
