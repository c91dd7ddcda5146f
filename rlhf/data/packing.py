"""Padding-free packing: best-fit-decreasing bins under a token budget, pack and unpack.

A *unit* is the smallest group of samples that must stay in one micro-batch: a single
sample for SFT/PPO, a (chosen, rejected) pair for DPO and reward-model training. Units are
never cut; a unit longer than the budget is an error (``OverlongSampleError``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from rlhf.data.types import TOKEN_FIELDS, FlatBatch, Sample


class OverlongSampleError(ValueError):
    """A sample (or pair) does not fit the packing token budget."""


def plan_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing.

    Args:
        lengths: size of each unit (tokens), all ``<= budget``.
        budget: capacity of one bin (tokens per micro-batch row).

    Returns:
        Bins as lists of unit indices; each bin's total length is ``<= budget``. Units are
        placed longest first, each into the fullest bin that still has room for it.
    """
    if budget <= 0:
        raise ValueError(f"packing budget must be positive, got {budget}")
    for i, n in enumerate(lengths):
        if n > budget:
            raise OverlongSampleError(
                f"unit {i} has {n} tokens, more than the packing budget of {budget}: raise "
                "train.max_tokens_per_microbatch, or shorten the data (data.max_len / rollout.max_model_len)"
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # (remaining capacity, bin id) sorted ascending: bisect finds the tightest fit in O(log n).
    free: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            cap, b = free.pop(pos)
        else:
            cap, b = budget, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (cap - n, b))
    return bins


def concat(samples: Sequence[Sample], sample_index: Sequence[int] | None = None) -> FlatBatch:
    """Concatenate samples into one ``FlatBatch`` (no budget, no padding)."""
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    lens = torch.tensor([len(s) for s in samples], dtype=torch.int32)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    pos = torch.cat([torch.arange(len(s), dtype=torch.long) for s in samples])
    kw = {}
    for name in TOKEN_FIELDS:
        present = [getattr(s, name) is not None for s in samples]
        if all(present):
            kw[name] = torch.cat([getattr(s, name).float() for s in samples])
        elif any(present):
            raise ValueError(f"field {name!r} is set on some samples but not others; fill it for all or none")
    scores = torch.tensor([float("nan") if s.score is None else float(s.score) for s in samples])
    idx = list(range(len(samples))) if sample_index is None else list(sample_index)
    return FlatBatch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        position_ids=pos,
        cu_seqlens=cu,
        action_mask=torch.cat([s.action_mask for s in samples]),
        scores=scores.float(),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        sample_index=torch.tensor(idx, dtype=torch.long),
        **kw,
    )


def pack(
    samples: Sequence[Sample],
    budget: int,
    units: Sequence[Sequence[int]] | None = None,
) -> list[FlatBatch]:
    """Pack samples into micro-batches of at most ``budget`` tokens each.

    Args:
        samples: the samples (unpadded).
        budget: max tokens per micro-batch (the row length T of each packed row).
        units: groups of sample indices kept in the same micro-batch, in order (e.g. DPO
            pairs ``[[0, 1], [2, 3]]``). Default: every sample is its own unit.

    Returns:
        Micro-batches; ``FlatBatch.sample_index`` says which input samples each holds.
        Every input sample appears in exactly one micro-batch.
    """
    samples = list(samples)
    units = [[i] for i in range(len(samples))] if units is None else [list(u) for u in units]
    seen = sorted(i for u in units for i in u)
    if seen != list(range(len(samples))):
        raise ValueError("units must cover every sample index exactly once")
    lengths = [sum(len(samples[i]) for i in u) for u in units]
    bins = plan_bins(lengths, budget)
    out = []
    for b in bins:
        idx = [i for u in sorted(b) for i in units[u]]
        out.append(concat([samples[i] for i in idx], sample_index=idx))
    return out


def balance_bins(batches: list[FlatBatch], world_size: int) -> list[list[FlatBatch | None]]:
    """Deal micro-batches to ``world_size`` ranks, each rank getting the same number.

    Data-parallel ranks must run the same number of forward/backward passes, since ZeRO
    reduces gradients collectively. Bins go longest-first to the rank with the fewest bins,
    then tokens; a rank short of bins gets ``None`` slots, which the worker runs as a
    zero-weight step on a tiny dummy row so the collectives still line up.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    per_rank: list[list[FlatBatch | None]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for mb in sorted(batches, key=lambda m: -m.num_tokens):
        r = min(range(world_size), key=lambda k: (len(per_rank[k]), load[k]))
        per_rank[r].append(mb)
        load[r] += mb.num_tokens
    slots = max(len(x) for x in per_rank)
    return [x + [None] * (slots - len(x)) for x in per_rank]


def shard_bounds(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges, sizes differing by at most one; empty shards are kept."""
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def dummy_flat_batch(num_samples: int = 1, device: torch.device | str = "cpu") -> FlatBatch:
    """``num_samples`` samples of 2 tokens (token id 0), the second one an action, all fields 0.

    Only ever run with ``loss_scale = 0``; it exists so that a rank short of micro-batches
    still runs the forward/backward collectives (ZeRO-3 gathers, ZeRO-2 reductions).
    """
    n = 2 * num_samples
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[1::2] = True
    kw = {name: torch.zeros(n, dtype=torch.float32, device=device) for name in TOKEN_FIELDS}
    return FlatBatch(
        input_ids=torch.zeros(n, dtype=torch.long, device=device),
        position_ids=torch.arange(2, device=device).repeat(num_samples),
        cu_seqlens=torch.arange(0, n + 1, 2, dtype=torch.int32, device=device),
        action_mask=mask,
        scores=torch.zeros(num_samples, device=device),
        group_ids=torch.zeros(num_samples, dtype=torch.long, device=device),
        sample_index=torch.full((num_samples,), -1, dtype=torch.long, device=device),
        **kw,
    )


def unpack(flat: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a flat [T, ...] tensor back into per-sample tensors using ``cu_seqlens``."""
    if flat.dim() >= 2 and flat.shape[0] == 1 and int(cu_seqlens[-1]) != 1:
        flat = flat.squeeze(0)
    if flat.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(
            f"flat tensor has {flat.shape[0]} tokens but cu_seqlens ends at {int(cu_seqlens[-1])}"
        )
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(flat, lens, dim=0))
