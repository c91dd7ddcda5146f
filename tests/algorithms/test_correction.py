"""Rollout correction (TIS/MIS) and mismatch metrics against plain loop references."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rlhf.algorithms.correction import mismatch_stats, rollout_correction_weights

from ._batches import PackedBatch, fixed_batch, packed_batches

FAST = settings(max_examples=30, deadline=None)


def _inputs(batch: PackedBatch, spread: float):
    rollout = batch.randn(0) - 2.0
    old = rollout + batch.randn(1) * spread
    return old, rollout


def ref_weights(batch, old, rollout, mode, level, cap, low, high):
    """Per token: rho from the token, the sample's product, or the sample's geometric mean."""
    w, hits = {}, []
    for idx in batch.action_indices():
        logs = [old[t] - rollout[t] for t in idx]
        for k, t in enumerate(idx):
            if level == "token":
                log_rho = logs[k]
            elif level == "sequence":
                log_rho = math.fsum(logs)
            else:
                log_rho = statistics.fmean(logs)
            rho = math.exp(max(-20.0, min(20.0, log_rho)))
            if mode == "tis":
                w[t], hit = min(rho, cap), rho > cap
            else:
                hit = rho < low or rho > high
                w[t] = 0.0 if hit else rho
            hits.append(hit)
    return w, statistics.fmean(hits) if hits else 0.0


@given(
    packed_batches(),
    st.sampled_from(["tis", "mis"]),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.floats(0.05, 1.0),
)
@FAST
def test_weights_match_loop_reference(batch, mode, level, spread):
    old, rollout = _inputs(batch, spread)
    weights, stats = rollout_correction_weights(
        old, rollout, batch.action_mask, batch.cu_seqlens, mode, level, tis_cap=1.5, mis_low=0.7, mis_high=1.4
    )
    ref, frac = ref_weights(batch, old.tolist(), rollout.tolist(), mode, level, 1.5, 0.7, 1.4)
    expected = torch.zeros(batch.total, dtype=torch.float32)
    for t, v in ref.items():
        expected[t] = v
    assert_close(weights, expected, rtol=1e-5, atol=1e-6)  # 0 off the mask, whatever the inputs hold there
    name = "truncated_fraction" if mode == "tis" else "masked_fraction"
    assert stats[name] == pytest.approx(frac)
    assert stats["weight_mean"] == pytest.approx(statistics.fmean(ref.values()) if ref else 0.0, rel=1e-5)


def test_hand_case_truncates_and_masks_where_expected():
    # One sample, prompt token then 3 actions with log(pi_old / pi_rollout) = ln 3, 0, ln 0.25.
    mask = torch.tensor([False, True, True, True])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    rollout = torch.tensor([0.0, -1.0, -1.0, -1.0])
    old = rollout + torch.log(torch.tensor([1.0, 3.0, 1.0, 0.25]))
    w, st_ = rollout_correction_weights(old, rollout, mask, cu, "tis", "token", tis_cap=2.0)
    assert_close(w, torch.tensor([0.0, 2.0, 1.0, 0.25]))
    assert st_["truncated_fraction"] == pytest.approx(1 / 3)
    w, st_ = rollout_correction_weights(old, rollout, mask, cu, "mis", "token", mis_low=0.5, mis_high=2.0)
    assert_close(w, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert st_["masked_fraction"] == pytest.approx(2 / 3)
    # The sequence ratio is 3 * 1 * 0.25 = 0.75: inside [0.5, 2], every token keeps weight 0.75.
    w, _ = rollout_correction_weights(old, rollout, mask, cu, "mis", "sequence", mis_low=0.5, mis_high=2.0)
    assert_close(w, torch.tensor([0.0, 0.75, 0.75, 0.75]))


def test_mismatch_stats_match_loop_reference():
    batch = fixed_batch()
    old, rollout = _inputs(batch, 0.3)
    stats = mismatch_stats(old, rollout, batch.action_mask)
    idx = [t for ids in batch.action_indices() for t in ids]
    log_r = [old[t].item() - rollout[t].item() for t in idx]
    assert stats["kl_k1"] == pytest.approx(statistics.fmean(-x for x in log_r), rel=1e-5)
    assert stats["kl_k3"] == pytest.approx(statistics.fmean(math.exp(x) - 1 - x for x in log_r), rel=1e-5)
    assert stats["kl_k3"] > 0


def test_identical_policies_give_unit_weights_and_zero_mismatch():
    batch = fixed_batch()
    lp = batch.randn(0, poison=None)
    for mode in ("tis", "mis"):
        w, _ = rollout_correction_weights(lp, lp, batch.action_mask, batch.cu_seqlens, mode, "sequence")
        assert_close(w, batch.action_mask.float())
    assert mismatch_stats(lp, lp, batch.action_mask) == {"kl_k1": 0.0, "kl_k3": 0.0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "tis", "tis_cap": 0.5}, "TIS cap"),
        ({"mode": "mis", "mis_low": 1.2, "mis_high": 2.0}, "MIS bounds"),
        ({"mode": "mis", "mis_low": 0.5, "mis_high": 0.9}, "MIS bounds"),
        ({"mode": "clip"}, "unknown correction mode"),
        ({"mode": "tis", "level": "turn"}, "unknown correction level"),
    ],
)
def test_bad_parameters_are_clear_errors(kwargs, match):
    batch = fixed_batch()
    lp = batch.randn(0, poison=None)
    with pytest.raises(ValueError, match=match):
        rollout_correction_weights(lp, lp, batch.action_mask, batch.cu_seqlens, **kwargs)
