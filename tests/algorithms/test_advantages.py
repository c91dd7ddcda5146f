import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rlhf.algorithms import (
    broadcast_sequence_advantages,
    gae,
    grpo_advantages,
    kl_estimator,
    masked_whiten,
    reinforce_pp_baseline,
    reinforce_pp_returns,
    rloo_advantages,
    token_level_rewards,
)

from ._batches import PackedBatch, fixed_batch, packed_batches

FAST = settings(max_examples=40, deadline=None)
unit = st.floats(min_value=0.0, max_value=1.0)


def ref_gae(batch: PackedBatch, values, rewards, gamma, lam):
    adv = [0.0] * batch.total
    ret = [0.0] * batch.total
    for idx in batch.action_indices():
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[t] + gamma * next_value - values[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[t]
            adv[t] = next_adv
            ret[t] = next_adv + values[t]
    return adv, ret


def ref_discounted_returns(batch: PackedBatch, rewards, gamma):
    out = [0.0] * batch.total
    for idx in batch.action_indices():
        running = 0.0
        for t in reversed(idx):
            running = rewards[t] + gamma * running
            out[t] = running
    return out


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@given(packed_batches(), unit, unit)
@FAST
def test_gae_matches_loop_reference(batch, gamma, lam):
    values, rewards = batch.randn(0), batch.randn(1, poison=float("inf"))
    adv, ret = gae(values, rewards, batch.action_mask, batch.cu_seqlens, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(batch, values.tolist(), rewards.tolist(), gamma, lam)
    assert adv.dtype == torch.float64
    assert_close(adv, t64(ref_adv))
    assert_close(ret, t64(ref_ret))
    assert (adv[~batch.action_mask] == 0).all() and (ret[~batch.action_mask] == 0).all()


def test_gae_hand_computed_multi_turn():
    # sample 0: prompt, a0, a1, obs, a2 ; sample 1: prompt, a0 (single action token)
    mask = torch.tensor([False, True, True, False, True, False, True])
    cu = torch.tensor([0, 5, 7])
    values = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 9.0, 0.5])
    rewards = torch.tensor([9.0, 0.0, 0.5, 9.0, 1.0, 9.0, 2.0])
    gamma, lam = 0.9, 0.8
    # observation tokens are skipped: a1 bootstraps from a2's value
    d2 = 1.0 - 3.0
    d1 = 0.5 + gamma * 3.0 - 2.0
    d0 = 0.0 + gamma * 2.0 - 1.0
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(values, rewards, mask, cu, gamma, lam)
    assert_close(adv, torch.tensor([0.0, a0, a1, 0.0, a2, 0.0, 2.0 - 0.5]))
    assert_close(ret, torch.tensor([0.0, a0 + 1.0, a1 + 2.0, 0.0, a2 + 3.0, 0.0, 2.0]))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    batch = fixed_batch()
    values, rewards = batch.randn(0), batch.randn(1)
    adv, ret = gae(values, rewards, batch.action_mask, batch.cu_seqlens, gamma=1.0, lam=1.0)
    mc = reinforce_pp_returns(rewards, batch.action_mask, batch.cu_seqlens, gamma=1.0)
    mask = batch.action_mask
    assert_close(ret[mask], mc[mask])
    assert_close(adv[mask], mc[mask] - values[mask])


def test_gae_low_precision_inputs_are_upcast():
    batch = fixed_batch()
    values, rewards = batch.randn(0, poison=0.0), batch.randn(1, poison=0.0)
    adv, _ = gae(values.bfloat16(), rewards.bfloat16(), batch.action_mask, batch.cu_seqlens, 1.0, 0.95)
    assert adv.dtype == torch.float32
    ref, _ = ref_gae(
        batch, values.bfloat16().double().tolist(), rewards.bfloat16().double().tolist(), 1.0, 0.95
    )
    assert_close(adv, torch.tensor(ref, dtype=torch.float32))


@given(packed_batches(), unit)
@FAST
def test_reinforce_pp_returns_matches_loop_reference(batch, gamma):
    rewards = batch.randn(2)
    out = reinforce_pp_returns(rewards, batch.action_mask, batch.cu_seqlens, gamma)
    assert_close(out, t64(ref_discounted_returns(batch, rewards.tolist(), gamma)))


@given(packed_batches(), st.floats(0.0, 0.5), st.booleans())
@FAST
def test_token_level_rewards_matches_loop_reference(batch, kl_coef, with_kl):
    g = torch.Generator().manual_seed(batch.seed)
    scores = torch.randn(batch.num_samples, generator=g, dtype=torch.float64)
    kl = batch.randn(3) if with_kl else None
    out = token_level_rewards(scores, kl, kl_coef, batch.action_mask, batch.cu_seqlens)
    ref = [0.0] * batch.total
    for i, idx in enumerate(batch.action_indices()):
        for t in idx:
            ref[t] = -kl_coef * kl[t].item() if with_kl else 0.0
        ref[idx[-1]] += scores[i].item()
    assert_close(out, t64(ref))


def test_token_level_rewards_sample_without_actions_and_int_scores():
    mask = torch.tensor([False, True, True, False, False, False, True])
    cu = torch.tensor([0, 3, 5, 7])
    out = token_level_rewards(torch.tensor([1, 2, 3]), None, 0.1, mask, cu)
    assert_close(out, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0]))


def test_rlhf_pipelines_do_not_leak_nan():
    batch = fixed_batch()
    mask, cu = batch.action_mask, batch.cu_seqlens
    lp, ref_lp = batch.randn(0) - 2, batch.randn(1) - 2
    lp[0] = float("nan")  # first token of a sample has no log-probability
    ref_lp[~mask] = -float("inf")
    kl = kl_estimator(lp, ref_lp, "k1", action_mask=mask)
    scores = torch.randn(batch.num_samples, dtype=torch.float64)
    rewards = token_level_rewards(scores, kl, 0.05, mask, cu)
    adv_pp = masked_whiten(reinforce_pp_returns(rewards, mask, cu), mask)
    adv_gae, ret = gae(batch.randn(2, poison=float("inf")), rewards, mask, cu, 1.0, 0.95)
    for x in (kl, rewards, adv_pp, adv_gae, ret):
        assert torch.isfinite(x).all()
        assert (x[~mask] == 0).all()


@st.composite
def grouped_scores(draw, min_group=1):
    sizes = draw(st.lists(st.integers(min_group, 6), min_size=1, max_size=6))
    labels = draw(st.permutations([100 + 7 * g for g, n in enumerate(sizes) for _ in range(n)]))
    scores = draw(st.lists(st.floats(-5, 5), min_size=len(labels), max_size=len(labels)))
    return scores, labels


@given(grouped_scores(), st.booleans())
@FAST
def test_grpo_matches_loop_reference(data, scale_by_std):
    scores, labels = data
    out = grpo_advantages(t64(scores), torch.tensor(labels), eps=1e-6, scale_by_std=scale_by_std)
    ref, centered = [], []
    for s, g in zip(scores, labels, strict=True):
        group = [x for x, h in zip(scores, labels, strict=True) if h == g]
        mean = statistics.fmean(group)
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        ref.append((s - mean) / (std + 1e-6) if scale_by_std else s - mean)
        centered.append(s - mean)
    assert_close(out, t64(ref))
    assert_close(reinforce_pp_baseline(t64(scores), torch.tensor(labels)), t64(centered))


def test_grpo_hand_values():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([3, 3, 3, 3, 9])
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0])
    assert_close(grpo_advantages(scores, groups, eps=0.0), expected)
    # identical scores: zero advantage rather than 0/0
    assert (grpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long)) == 0).all()


@given(grouped_scores(min_group=2))
@FAST
def test_rloo_matches_loop_reference(data):
    scores, labels = data
    out = rloo_advantages(t64(scores), torch.tensor(labels))
    ref = []
    for i, (s, g) in enumerate(zip(scores, labels, strict=True)):
        others = [x for j, (x, h) in enumerate(zip(scores, labels, strict=True)) if h == g and j != i]
        ref.append(s - statistics.fmean(others))
    assert_close(out, t64(ref))


def test_rloo_rejects_singleton_group():
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


@given(packed_batches())
@FAST
def test_broadcast_sequence_advantages(batch):
    seq_adv = torch.arange(batch.num_samples, dtype=torch.float64) + 1
    out = broadcast_sequence_advantages(seq_adv, batch.action_mask, batch.cu_seqlens)
    ref = [0.0] * batch.total
    for i, idx in enumerate(batch.action_indices()):
        for t in idx:
            ref[t] = i + 1.0
    assert_close(out, t64(ref))


def test_broadcast_shape_check():
    with pytest.raises(ValueError, match="shape"):
        broadcast_sequence_advantages(torch.zeros(3), torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]))
