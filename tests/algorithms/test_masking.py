import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rlhf.algorithms import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    segment_ids,
    segment_mean,
    segment_sum,
)

from ._batches import PackedBatch, packed_batches

FAST = settings(max_examples=40, deadline=None)


def _poisoned(seed: int, n: int, mask: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1
    poison = [float("nan"), float("inf"), -float("inf")]
    for i, t in enumerate(torch.nonzero(~mask).flatten().tolist()):
        x[t] = poison[i % 3]
    return x


@given(packed_batches())
@FAST
def test_masked_reductions_match_loop_reference(batch: PackedBatch):
    mask = batch.action_mask
    x = _poisoned(batch.seed, batch.total, mask)
    selected = [float(v) for v, m in zip(x.tolist(), mask.tolist(), strict=True) if m]
    ref_mean = statistics.fmean(selected)
    assert_close(masked_sum(x, mask), torch.tensor(math.fsum(selected), dtype=torch.float64))
    assert_close(masked_mean(x, mask), torch.tensor(ref_mean, dtype=torch.float64))
    ref_var = statistics.variance(selected) if len(selected) > 1 else 0.0
    assert_close(masked_var(x, mask), torch.tensor(ref_var, dtype=torch.float64))
    assert_close(
        masked_var(x, mask, unbiased=False), torch.tensor(statistics.pvariance(selected), dtype=torch.float64)
    )

    white = masked_whiten(x, mask)
    assert torch.isfinite(white).all()
    ref_std = math.sqrt(ref_var + 1e-8)
    expected = [
        (v - ref_mean) / ref_std if m else 0.0 for v, m in zip(x.tolist(), mask.tolist(), strict=True)
    ]
    assert_close(white, torch.tensor(expected, dtype=torch.float64))
    unshifted = masked_whiten(x, mask, shift_mean=False)
    expected = [
        (v - ref_mean) / ref_std + ref_mean if m else 0.0
        for v, m in zip(x.tolist(), mask.tolist(), strict=True)
    ]
    assert_close(unshifted, torch.tensor(expected, dtype=torch.float64))


def test_masked_whiten_statistics():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 5 + 3
    mask = torch.rand(1000, generator=g) > 0.3
    white = masked_whiten(x, mask)
    assert_close(white[mask].mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    assert_close(white[mask].std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert (white[~mask] == 0).all()


def test_masked_mean_with_dim_and_integer_mask():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0, 0.0]))
    assert_close(masked_mean(x, mask, dim=0), torch.tensor([2.5, 2.0, 6.0]))
    assert_close(masked_sum(x, mask.bool(), dim=1), torch.tensor([3.0, 10.0, 0.0]))
    assert_close(masked_var(x, mask, dim=1), torch.tensor([0.5, 2.0, 0.0]))
    assert_close(masked_var(x, mask, dim=1, unbiased=False), torch.tensor([0.25, 1.0, 0.0]))
    # broadcast mask: select columns 0 and 2 of every row
    col = torch.tensor([True, False, True])
    assert_close(masked_mean(x[1:], col), torch.tensor(6.5))
    assert_close(masked_sum(x[1:], col, dim=1), torch.tensor([10.0, 16.0]))


def test_empty_selection_is_zero_not_nan():
    x = torch.tensor([float("nan"), 1.0])
    mask = torch.zeros(2, dtype=torch.bool)
    assert masked_mean(x, mask).item() == 0.0
    assert masked_var(x, mask).item() == 0.0
    assert (masked_whiten(x, mask) == 0).all()
    single = torch.tensor([False, True])
    assert masked_var(x, single).item() == 0.0
    assert torch.isfinite(masked_whiten(x, single)).all()


def test_masked_mean_gradient_ignores_poisoned_entries():
    x = torch.tensor([float("nan"), 2.0, float("inf"), 4.0], requires_grad=True)
    mask = torch.tensor([False, True, False, True])
    masked_mean(x, mask).backward()
    assert_close(x.grad, torch.tensor([0.0, 0.5, 0.0, 0.5]))


@given(st.lists(st.integers(0, 30), min_size=1, max_size=10), st.integers(0, 1000))
@FAST
def test_segment_reductions_match_loop_reference(lengths: list[int], seed: int):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    total = cu[-1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) > 0.4
    x[~mask] = float("nan")

    ids = segment_ids(cu_seqlens, total)
    assert ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]

    ref_sum, ref_mean = [], []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        sel = [x[t].item() for t in range(s, e) if mask[t]]
        ref_sum.append(math.fsum(sel))
        ref_mean.append(statistics.fmean(sel) if sel else 0.0)
    assert_close(segment_sum(x, cu_seqlens, mask), torch.tensor(ref_sum, dtype=torch.float64))
    assert_close(segment_mean(x, cu_seqlens, mask), torch.tensor(ref_mean, dtype=torch.float64))

    clean = torch.nan_to_num(x, nan=0.5)
    ref_unmasked = [
        statistics.fmean(clean[s:e].tolist()) if e > s else 0.0 for s, e in zip(cu[:-1], cu[1:], strict=True)
    ]
    assert_close(segment_mean(clean, cu_seqlens), torch.tensor(ref_unmasked, dtype=torch.float64))


def test_segment_sum_trailing_dims():
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    cu = torch.tensor([0, 2, 6])
    mask = torch.tensor([True, False, True, True, False, True])
    assert_close(segment_sum(x, cu, mask), torch.tensor([[0.0, 1.0], [4.0 + 6 + 10, 5.0 + 7 + 11]]))
    assert_close(segment_mean(x, cu, mask), torch.tensor([[0.0, 1.0], [20 / 3, 23 / 3]]))


@pytest.mark.parametrize(
    "cu",
    [[1, 3], [0, 2], [0, 4, 3], [[0, 3]]],
)
def test_bad_cu_seqlens_raise(cu):
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_sum(torch.zeros(3), torch.tensor(cu))


def test_float_cu_seqlens_raise():
    with pytest.raises(ValueError, match="integer"):
        segment_ids(torch.tensor([0.0, 3.0]), 3)
