"""Property tests of the packing contract: pack/unpack round trips, bin quality, rank balance."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.packing import OverlongSampleError, balance_bins, concat, pack, plan_bins, unpack
from rlhf.data.types import TOKEN_FIELDS, Sample

pytestmark = pytest.mark.cpu

FAST = settings(max_examples=60, deadline=None)


def make_sample(n: int, seed: int, with_fields: bool = True) -> Sample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < 0.5
    mask[0] = False
    fields = {name: torch.randn(n, generator=g) for name in TOKEN_FIELDS} if with_fields else {}
    return Sample(
        input_ids=torch.randint(0, 1000, (n,), generator=g),
        action_mask=mask,
        score=float(seed),
        group_id=seed % 3,
        **fields,
    )


lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=25)


def check_batches(samples, batches, budget, units=None):
    """Every sample exactly once, whole and unchanged; bins within budget; positions restart."""
    seen = [i for mb in batches for i in mb.sample_index.tolist()]
    assert sorted(seen) == list(range(len(samples)))
    for mb in batches:
        assert mb.num_tokens <= budget
        assert int(mb.cu_seqlens[0]) == 0 and int(mb.cu_seqlens[-1]) == mb.num_tokens
        expect_pos = torch.cat([torch.arange(int(n)) for n in mb.seqlens])
        assert torch.equal(mb.position_ids, expect_pos)
        ids, masks = unpack(mb.input_ids, mb.cu_seqlens), unpack(mb.action_mask, mb.cu_seqlens)
        for k, i in enumerate(mb.sample_index.tolist()):
            s = samples[i]
            assert torch.equal(ids[k], s.input_ids) and torch.equal(masks[k], s.action_mask)
            assert float(mb.scores[k]) == s.score and int(mb.group_ids[k]) == s.group_id
        for name in TOKEN_FIELDS:
            if getattr(samples[0], name) is None:
                assert getattr(mb, name) is None
                continue
            parts = unpack(getattr(mb, name), mb.cu_seqlens)
            for i, part in zip(mb.sample_index.tolist(), parts, strict=True):
                assert torch.equal(part, getattr(samples[i], name))
    if units is not None:
        where = {
            i: (b, pos) for b, mb in enumerate(batches) for pos, i in enumerate(mb.sample_index.tolist())
        }
        for u in units:
            bins = {where[i][0] for i in u}
            assert len(bins) == 1, f"unit {u} split across micro-batches"
            pos = [where[i][1] for i in u]
            assert pos == list(range(pos[0], pos[0] + len(u))), f"unit {u} not contiguous and in order"


@FAST
@given(lengths=lengths_st, extra=st.integers(0, 80))
def test_pack_round_trip(lengths, extra):
    budget = max(lengths) + extra
    samples = [make_sample(n, seed) for seed, n in enumerate(lengths)]
    check_batches(samples, pack(samples, budget), budget)


@FAST
@given(
    pair_lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12),
    extra=st.integers(0, 60),
)
def test_pairs_stay_together(pair_lengths, extra):
    lengths = [n for p in pair_lengths for n in p]
    units = [[2 * k, 2 * k + 1] for k in range(len(pair_lengths))]
    budget = max(a + b for a, b in pair_lengths) + extra
    samples = [make_sample(n, seed, with_fields=False) for seed, n in enumerate(lengths)]
    batches = pack(samples, budget, units=units)
    check_batches(samples, batches, budget, units=units)


@FAST
@given(lengths=lengths_st, budget=st.integers(1, 59))
def test_overlong_raises_naming_the_budget(lengths, budget):
    samples = [make_sample(n, seed, with_fields=False) for seed, n in enumerate(lengths)]
    if max(lengths) <= budget:
        check_batches(samples, pack(samples, budget), budget)
        return
    with pytest.raises(OverlongSampleError, match="max_tokens_per_microbatch") as e:
        pack(samples, budget)
    assert str(budget) in str(e.value)


def test_bad_arguments():
    samples = [make_sample(5, 0), make_sample(5, 1)]
    with pytest.raises(ValueError, match="units must cover"):
        pack(samples, 20, units=[[0]])
    with pytest.raises(ValueError, match="budget must be positive"):
        plan_bins([1], 0)
    with pytest.raises(ValueError, match="set on some samples"):
        concat([make_sample(5, 0), make_sample(5, 1, with_fields=False)])


# ---------------------------------------------------------------------------- bin quality
def optimal_bins(lengths: list[int], budget: int) -> int:
    """Exact optimum by trying every assignment (small inputs only)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for i, b in enumerate(assign):
                loads[b] += lengths[i]
            if max(loads) <= budget:
                return k
    return n


@FAST
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=40), extra=st.integers(0, 100))
def test_bfd_bins_are_valid_and_no_two_could_merge(lengths, extra):
    budget = max(lengths) + extra
    bins = plan_bins(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= budget
    # Any-fit property: a bin is only opened when the item fits nowhere, so no two bins could
    # be merged; hence at most one bin is half full and len(bins) <= 2*sum/budget + 1, the
    # classic first-fit bound.
    for a, b in itertools.combinations(loads, 2):
        assert a + b > budget
    assert len(bins) <= 2 * sum(lengths) / budget + 1


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=7), budget=st.integers(20, 30))
def test_bfd_within_known_ratio_of_optimum(lengths, budget):
    bins = plan_bins(lengths, budget)
    # Best-fit decreasing, like first-fit decreasing, uses at most 11/9 OPT + 6/9 bins.
    assert len(bins) <= 11 / 9 * optimal_bins(lengths, budget) + 6 / 9


def test_bfd_fills_bins_on_a_realistic_mix():
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(5.0 + torch.randn(2000, generator=g)).clamp(2, 2000).long().tolist()
    budget = 4096
    bins = plan_bins(lengths, budget)
    fill = sum(lengths) / (len(bins) * budget)
    assert fill > 0.99, f"BFD filled only {fill:.3f} of the bins"


# ---------------------------------------------------------------------------- rank balance
@FAST
@given(lengths=lengths_st, world=st.integers(1, 8), extra=st.integers(0, 40))
def test_balance_bins_same_count_per_rank(lengths, world, extra):
    samples = [make_sample(n, seed, with_fields=False) for seed, n in enumerate(lengths)]
    batches = pack(samples, max(lengths) + extra)
    per_rank = balance_bins(batches, world)
    assert len(per_rank) == world
    assert len({len(r) for r in per_rank}) == 1
    real = [mb for r in per_rank for mb in r if mb is not None]
    assert sorted(id(mb) for mb in real) == sorted(id(mb) for mb in batches)
    assert len(per_rank[0]) == -(-len(batches) // world)
    # None only fills the tail of a rank, so slot k is a real micro-batch on at least one rank.
    for r in per_rank:
        nones = [mb is None for mb in r]
        assert nones == sorted(nones)


def test_balance_bins_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        balance_bins([], 0)


# ---------------------------------------------------------------------------- Sample contract
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (
            {"input_ids": torch.zeros(0, dtype=torch.long), "action_mask": torch.zeros(0, dtype=torch.bool)},
            "input_ids",
        ),
        (
            {
                "input_ids": torch.zeros(2, 3, dtype=torch.long),
                "action_mask": torch.zeros(6, dtype=torch.bool),
            },
            "input_ids",
        ),
        (
            {"input_ids": torch.zeros(4, dtype=torch.long), "action_mask": torch.zeros(3, dtype=torch.bool)},
            "action_mask",
        ),
        (
            {
                "input_ids": torch.zeros(4, dtype=torch.long),
                "action_mask": torch.tensor([True, False, False, False]),
            },
            r"action_mask\[0\]",
        ),
        *[
            (
                {
                    "input_ids": torch.zeros(4, dtype=torch.long),
                    "action_mask": torch.zeros(4, dtype=torch.bool),
                    name: torch.zeros(3),
                },
                name,
            )
            for name in TOKEN_FIELDS
        ],
    ],
)
def test_sample_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Sample.{field}"):
        Sample(**kwargs)


def test_shard_bounds_contiguous_and_balanced() -> None:
    from rlhf.data.packing import shard_bounds

    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert shard_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
