"""Masked and segmented reductions over unpadded (packed) token tensors.

Every function here selects entries with ``torch.where`` instead of multiplying by the mask:
``0 * nan`` is ``nan``, and masked-out positions (prompt tokens, observation tokens) routinely
hold garbage such as the log-probability of a token that has no prefix.

Packed layout: a per-token tensor has shape ``[T]`` (the concatenation of ``B`` samples) and
``cu_seqlens`` (``[B + 1]``, integer, ``cu_seqlens[0] == 0``) says that sample ``i`` occupies
``[cu_seqlens[i], cu_seqlens[i + 1])``.
"""

from __future__ import annotations

import torch

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "segment_ids",
    "segment_mean",
    "segment_sum",
]


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over the entries where ``mask`` is true.

    Args:
        values (torch.Tensor): input tensor of any shape.
        mask (torch.Tensor): bool (or 0/1) tensor broadcastable to ``values``; true entries are summed.
            Entries where it is false are ignored even if they are NaN or inf.
        dim (int | None): dimension to reduce; ``None`` reduces over all entries. Default None.

    Returns:
        torch.Tensor: a 0-dim tensor when ``dim`` is None, else ``values`` reduced over ``dim``.
    """
    selected = torch.where(_as_bool(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim)


def _masked_count(values: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    full_mask = torch.broadcast_to(_as_bool(mask), values.shape)
    count = full_mask.sum() if dim is None else full_mask.sum(dim)
    return count.to(values.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is true.

    An empty selection gives 0 rather than NaN, so that a micro-batch without any selected token
    contributes nothing to a loss instead of poisoning it.

    Args:
        values (torch.Tensor): input tensor of any shape (floating point).
        mask (torch.Tensor): bool (or 0/1) tensor broadcastable to ``values``.
        dim (int | None): dimension to reduce; ``None`` reduces over all entries. Default None.

    Returns:
        torch.Tensor: a 0-dim tensor when ``dim`` is None, else ``values`` reduced over ``dim``.
    """
    count = _masked_count(values, mask, dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Variance of ``values`` over the entries where ``mask`` is true.

    With ``unbiased=True`` Bessel's correction ``n / (n - 1)`` is applied. A selection of a single
    entry has variance 0 (not NaN) and an empty selection has variance 0.

    Args:
        values (torch.Tensor): input tensor of any shape (floating point).
        mask (torch.Tensor): bool (or 0/1) tensor broadcastable to ``values``.
        dim (int | None): dimension to reduce; ``None`` reduces over all entries. Default None.
        unbiased (bool): apply Bessel's correction. Default True.

    Returns:
        torch.Tensor: a 0-dim tensor when ``dim`` is None, else ``values`` reduced over ``dim``.
    """
    mean = masked_mean(values, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    centered_sq = (values - mean) ** 2
    count = _masked_count(values, mask, dim)
    denom = count - 1 if unbiased else count
    return masked_sum(centered_sq, mask, dim) / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit variance using statistics of the selected entries.

    ``(values - mean) / sqrt(var + eps)`` with mean and (unbiased) variance computed over
    ``mask == True`` entries only. With ``shift_mean=False`` the mean is added back, i.e. only the
    scale changes (useful when the sign of an advantage must be preserved).

    Args:
        values (torch.Tensor): input tensor of any shape (floating point), e.g. advantages ``[T]``.
        mask (torch.Tensor): bool (or 0/1) tensor broadcastable to ``values``.
        shift_mean (bool): subtract the mean. Default True.
        eps (float): added to the variance for numerical stability. Default 1e-8.

    Returns:
        torch.Tensor: same shape as ``values``; exactly 0 where ``mask`` is false.
    """
    mask = _as_bool(mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> int:
    """Validate ``cu_seqlens`` against a packed length and return the number of samples.

    This costs one host sync; silent corruption of per-sample statistics is worse.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at {total} (packed length), got {bounds[0]}..{bounds[-1]}"
        )
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError("cu_seqlens must be non-decreasing")
    return len(bounds) - 1


def segment_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Sample index of every packed token.

    Args:
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        total (int | None): packed length ``T``; defaults to ``cu_seqlens[-1]``.

    Returns:
        torch.Tensor: ``[T]`` int64 tensor on ``cu_seqlens``' device, ``out[t] = i`` for
        ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``.
    """
    if total is None:
        total = int(cu_seqlens[-1])
    num_samples = _check_cu_seqlens(cu_seqlens, total)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(num_samples, device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def segment_sum(
    values: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sample sum of a packed tensor, optionally over masked entries only.

    Args:
        values (torch.Tensor): ``[T, ...]`` packed tensor.
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        mask (torch.Tensor | None): ``[T]`` or ``[T, ...]`` bool; false entries are ignored (even NaN).

    Returns:
        torch.Tensor: ``[B, ...]``; 0 for samples with nothing selected.
    """
    ids = segment_ids(cu_seqlens.to(values.device), values.shape[0])
    if mask is not None:
        mask = _as_bool(mask)
        mask = mask.reshape(mask.shape + (1,) * (values.dim() - mask.dim()))
        values = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = values.new_zeros((cu_seqlens.numel() - 1,) + tuple(values.shape[1:]))
    return out.index_add(0, ids, values)


def segment_mean(
    values: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sample mean of a packed tensor, optionally over masked entries only.

    Args:
        values (torch.Tensor): ``[T, ...]`` packed tensor (floating point).
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        mask (torch.Tensor | None): ``[T]`` or ``[T, ...]`` bool; false entries are ignored (even NaN).

    Returns:
        torch.Tensor: ``[B, ...]``; 0 for samples with nothing selected.
    """
    if mask is None:
        mask = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    mask = _as_bool(mask)
    mask = torch.broadcast_to(mask.reshape(mask.shape + (1,) * (values.dim() - mask.dim())), values.shape)
    total = segment_sum(values, cu_seqlens, mask)
    count = segment_sum(mask.to(values.dtype), cu_seqlens)
    return total / count.clamp(min=1)
