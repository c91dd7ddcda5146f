import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rlhf.algorithms import (
    aggregate_loss,
    dpo_loss,
    gspo_policy_loss,
    pairwise_rm_loss,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)

from ._batches import PackedBatch, fixed_batch, packed_batches

FAST = settings(max_examples=30, deadline=None)
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def ref_aggregate(batch: PackedBatch, per_token: dict[int, float], aggregation: str) -> float:
    per_sample = [[per_token[t] for t in idx] for idx in batch.action_indices() if idx]
    if aggregation == "token_mean":
        return statistics.fmean([x for s in per_sample for x in s])
    if aggregation == "seq_mean_token_mean":
        return statistics.fmean([statistics.fmean(s) for s in per_sample])
    return statistics.fmean([math.fsum(s) for s in per_sample])


def ref_ppo(batch, lp, old, adv, low, high, dual):
    losses, clipped, dual_active, kls = {}, [], [], []
    for idx in batch.action_indices():
        for t in idx:
            ratio = math.exp(lp[t] - old[t])
            l1 = -adv[t] * ratio
            l2 = -adv[t] * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            clipped.append(l2 > l1)
            if dual is not None and adv[t] < 0:
                dual_active.append(-adv[t] * dual < loss)
                loss = min(loss, -adv[t] * dual)
            else:
                dual_active.append(False)
            losses[t] = loss
            kls.append(ratio - 1 - math.log(ratio))
    return losses, statistics.fmean(clipped), statistics.fmean(dual_active), statistics.fmean(kls)


def ppo_inputs(batch: PackedBatch, spread: float = 0.4):
    old = batch.randn(0) - 3
    lp = old + batch.randn(1) * spread
    lp[~batch.action_mask] = float("-inf")
    adv = batch.randn(2, poison=float("inf"))
    return lp, old, adv


@given(
    packed_batches(),
    st.sampled_from(AGGREGATIONS),
    st.sampled_from([None, 1.5, 3.0]),
    st.floats(0.05, 0.3),
    st.floats(0.05, 0.4),
)
@FAST
def test_ppo_policy_loss_matches_loop_reference(batch, aggregation, dual, low, high):
    lp, old, adv = ppo_inputs(batch)
    loss, stats = ppo_policy_loss(
        lp, old, adv, batch.action_mask, batch.cu_seqlens, low, high, dual_clip=dual, aggregation=aggregation
    )
    per_token, clip_frac, dual_frac, kl = ref_ppo(
        batch, lp.tolist(), old.tolist(), adv.tolist(), low, high, dual
    )
    assert_close(loss, torch.tensor(ref_aggregate(batch, per_token, aggregation), dtype=torch.float64))
    assert_close(stats["clip_fraction"], torch.tensor(clip_frac, dtype=torch.float64))
    assert_close(stats["approx_kl"], torch.tensor(kl, dtype=torch.float64))
    if dual is not None:
        assert_close(stats["dual_clip_fraction"], torch.tensor(dual_frac, dtype=torch.float64))


def test_ppo_clip_and_dual_clip_hand_cases():
    # every sample: [prompt, action]; ratio / advantage per action token
    ratios = [5.0, 2.0, 5.0, 0.5, 0.5, 1.1]
    advs = [-1.0, -1.0, 1.0, 1.0, -1.0, 2.0]
    mask = torch.tensor([False, True] * 6)
    cu = torch.arange(0, 13, 2)
    old = torch.full((12,), -2.0, dtype=torch.float64)
    lp = old.clone()
    lp[1::2] += torch.tensor(ratios, dtype=torch.float64).log()
    lp.requires_grad_(True)
    adv = torch.zeros(12, dtype=torch.float64)
    adv[1::2] = torch.tensor(advs, dtype=torch.float64)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, cu, 0.2, 0.2, dual_clip=3.0)
    # per token: min(max(5, 1.2), 3)=3 [dual], 2, max(-5, -1.2)=-1.2 [clip], -0.5, max(0.5, 0.8)=0.8 [clip], -2.2
    expected = [3.0, 2.0, -1.2, -0.5, 0.8, -2.2]
    assert_close(loss, torch.tensor(statistics.fmean(expected), dtype=torch.float64))
    assert_close(stats["clip_fraction"], torch.tensor(2 / 6, dtype=torch.float64))
    assert_close(stats["dual_clip_fraction"], torch.tensor(1 / 6, dtype=torch.float64))
    assert_close(stats["ratio_mean"], torch.tensor(statistics.fmean(ratios), dtype=torch.float64))
    loss.backward()
    # clipped tokens get no gradient; active unclipped ones get -A * ratio / N
    grad = [0.0, 2.0, 0.0, -0.5, 0.0, -2.2]
    expected_grad = torch.zeros(12, dtype=torch.float64)
    expected_grad[1::2] = torch.tensor(grad, dtype=torch.float64) / 6
    assert_close(lp.grad, expected_grad)


def test_ppo_dual_clip_validation():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(x, x, x, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), dual_clip=1.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ppo_gradient_matches_autograd_reference_and_ignores_poison(aggregation):
    batch = fixed_batch()
    lp, old, adv = ppo_inputs(batch, spread=0.5)
    lp.requires_grad_(True)
    loss, _ = ppo_policy_loss(lp, old, adv, batch.action_mask, batch.cu_seqlens, 0.2, 0.28, 2.0, aggregation)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert (lp.grad[~batch.action_mask] == 0).all()

    # independent per-token autograd reference on clean scalars
    leaves = {
        t: torch.tensor(lp[t].item(), dtype=torch.float64, requires_grad=True)
        for idx in batch.action_indices()
        for t in idx
    }
    per_token = {}
    for t, x in leaves.items():
        ratio = torch.exp(x - old[t].item())
        a = adv[t].item()
        loss_t = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
        per_token[t] = torch.minimum(loss_t, torch.tensor(-a * 2.0, dtype=torch.float64)) if a < 0 else loss_t
    if aggregation == "token_mean":
        ref = sum(per_token.values()) / len(per_token)
    else:
        sample_terms = []
        for idx in batch.action_indices():
            s = sum(per_token[t] for t in idx)
            sample_terms.append(s / len(idx) if aggregation == "seq_mean_token_mean" else s)
        ref = sum(sample_terms) / len(sample_terms)
    ref.backward()
    assert_close(loss.detach(), ref.detach())
    for t, x in leaves.items():
        assert_close(lp.grad[t], x.grad)


@given(packed_batches(), st.sampled_from(AGGREGATIONS), st.sampled_from([None, 0.1, 0.5]))
@FAST
def test_value_loss_matches_loop_reference(batch, aggregation, clip_eps):
    values, old, returns = batch.randn(0), batch.randn(1, poison=float("inf")), batch.randn(2)
    values = values.requires_grad_(True)
    loss, stats = value_loss(values, old, returns, batch.action_mask, batch.cu_seqlens, clip_eps, aggregation)
    per_token, clipped = {}, []
    for idx in batch.action_indices():
        for t in idx:
            v, o, r = values[t].item(), old[t].item(), returns[t].item()
            unclipped = (v - r) ** 2
            if clip_eps is None:
                per_token[t] = 0.5 * unclipped
                clipped.append(False)
                continue
            v_clip = min(max(v, o - clip_eps), o + clip_eps)
            per_token[t] = 0.5 * max(unclipped, (v_clip - r) ** 2)
            clipped.append((v_clip - r) ** 2 > unclipped)
    assert_close(loss, torch.tensor(ref_aggregate(batch, per_token, aggregation), dtype=torch.float64))
    assert_close(stats["clip_fraction"], torch.tensor(statistics.fmean(clipped), dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(values.grad).all() and (values.grad[~batch.action_mask] == 0).all()


def test_value_loss_explained_variance():
    mask = torch.tensor([False, True, True, True, True])
    returns = torch.tensor([float("nan"), 1.0, 2.0, 3.0, 4.0])
    _, stats = value_loss(returns.clone(), returns.clone(), returns, mask, torch.tensor([0, 5]))
    assert_close(stats["explained_variance"], torch.tensor(1.0))
    _, stats = value_loss(torch.zeros(5), torch.zeros(5), returns, mask, torch.tensor([0, 5]), clip_eps=None)
    # Var[R - 0] / Var[R] = 1
    assert_close(stats["explained_variance"], torch.tensor(0.0))


@given(packed_batches(), st.sampled_from(AGGREGATIONS))
@FAST
def test_sft_loss_matches_loop_reference(batch, aggregation):
    logprobs = batch.randn(0, poison=float("-inf")) - 2
    loss = sft_loss(logprobs, batch.action_mask, batch.cu_seqlens, aggregation)
    per_token = {t: -logprobs[t].item() for idx in batch.action_indices() for t in idx}
    assert_close(loss, torch.tensor(ref_aggregate(batch, per_token, aggregation), dtype=torch.float64))


def test_aggregate_skips_samples_without_tokens():
    x = torch.tensor([float("nan"), 2.0, 4.0, float("nan"), 7.0, float("inf")])
    mask = torch.tensor([False, True, True, False, True, False])
    cu = torch.tensor([0, 3, 4, 6])  # sample 1 has no selected token
    assert_close(aggregate_loss(x, mask, cu, "token_mean"), torch.tensor(13 / 3))
    assert_close(aggregate_loss(x, mask, cu, "seq_mean_token_mean"), torch.tensor((3.0 + 7.0) / 2))
    assert_close(aggregate_loss(x, mask, cu, "seq_mean_token_sum"), torch.tensor((6.0 + 7.0) / 2))
    empty = torch.zeros(6, dtype=torch.bool)
    for agg in AGGREGATIONS:
        assert aggregate_loss(x, empty, cu, agg).item() == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(x, mask, cu, "sum")  # type: ignore[arg-type]


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.1), (2.0, 0.5)])
def test_dpo_loss_hand_formula(beta, ls):
    g = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (-torch.rand(7, generator=g, dtype=torch.float64) * 50 for _ in range(4))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls)
    terms = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
        h = beta * ((a - c) - (b - d))
        terms.append(-(1 - ls) * _logsigmoid(h) - ls * _logsigmoid(-h))
    assert_close(loss, torch.tensor(statistics.fmean(terms), dtype=torch.float64))
    assert_close(chosen, beta * (pc - rc))
    assert_close(rejected, beta * (pr - rr))
    assert not chosen.requires_grad


def test_dpo_loss_value_and_gradient_at_equal_policies():
    x = torch.tensor([-3.0, -4.0], requires_grad=True)
    loss, _, _ = dpo_loss(x, x.detach() - 1, x.detach(), x.detach() - 1, beta=0.1)
    assert_close(loss, torch.tensor(math.log(2.0)))
    loss.backward()
    # d/dx -logsigmoid(beta * (x - c)) at 0 = -beta / 2, averaged over 2 pairs
    assert_close(x.grad, torch.tensor([-0.025, -0.025]))
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, label_smoothing=0.7)


def test_pairwise_rm_loss_hand_formula():
    chosen = torch.tensor([1.0, -2.0, 30.0, 0.0])
    rejected = torch.tensor([0.0, 1.0, -30.0, 0.0])
    margin = torch.tensor([0.5, 0.0, 1.0, 2.0])
    ref = statistics.fmean(
        -_logsigmoid(c - r) for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)
    )
    assert_close(pairwise_rm_loss(chosen, rejected), torch.tensor(ref))
    ref_m = statistics.fmean(
        -_logsigmoid(c - r - m)
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)
    )
    assert_close(pairwise_rm_loss(chosen, rejected, margin), torch.tensor(ref_m))


# -- per-token weights (rollout correction) and GSPO ----------------------------------------


@given(packed_batches(), st.sampled_from(AGGREGATIONS))
@FAST
def test_ppo_weights_multiply_each_token_loss(batch, aggregation):
    lp, old, adv = ppo_inputs(batch)
    w = batch.randn(3, poison=float("nan")).abs()
    loss, _ = ppo_policy_loss(
        lp, old, adv, batch.action_mask, batch.cu_seqlens, 0.2, 0.2, aggregation=aggregation, weights=w
    )
    per_token, *_ = ref_ppo(batch, lp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.2, None)
    weighted = {t: v * w[t].item() for t, v in per_token.items()}
    assert_close(loss, torch.tensor(ref_aggregate(batch, weighted, aggregation), dtype=torch.float64))


def ref_gspo(batch, lp, old, adv, low, high, weights=None):
    """Loop reference: one ratio per sample, exp(mean log-ratio over its action tokens)."""
    per_token, clipped = {}, []
    for idx in batch.action_indices():
        if not idx:
            continue
        s = math.exp(statistics.fmean(lp[t] - old[t] for t in idx))
        for t in idx:
            l1, l2 = -adv[t] * s, -adv[t] * min(max(s, 1 - low), 1 + high)
            per_token[t] = max(l1, l2) * (1.0 if weights is None else weights[t])
            clipped.append(l2 > l1)
    return per_token, statistics.fmean(clipped)


@given(packed_batches(), st.sampled_from(AGGREGATIONS), st.floats(1e-4, 0.3), st.floats(1e-4, 0.3))
@FAST
def test_gspo_loss_matches_loop_reference(batch, aggregation, low, high):
    lp, old, adv = ppo_inputs(batch, spread=0.05)
    loss, stats = gspo_policy_loss(
        lp, old, adv, batch.action_mask, batch.cu_seqlens, low, high, aggregation=aggregation
    )
    per_token, clip_frac = ref_gspo(batch, lp.tolist(), old.tolist(), adv.tolist(), low, high)
    assert_close(loss, torch.tensor(ref_aggregate(batch, per_token, aggregation), dtype=torch.float64))
    assert_close(stats["clip_fraction"], torch.tensor(clip_frac, dtype=torch.float64))


def test_gspo_gradient_equals_sequence_objective_gradient():
    # Multi-turn masks: the sequence ratio spans every action token of a sample, not one turn.
    batch = fixed_batch()
    lp, old, _ = ppo_inputs(batch, spread=0.02)
    g = torch.Generator().manual_seed(7)
    seq_adv = torch.randn(batch.num_samples, generator=g, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(batch.num_samples), torch.tensor(batch.lengths))
    adv = torch.where(batch.action_mask, seq_adv[ids], torch.tensor(float("inf"), dtype=torch.float64))
    lp.requires_grad_(True)
    loss, _ = gspo_policy_loss(
        lp, old, adv, batch.action_mask, batch.cu_seqlens, 0.01, 0.01, aggregation="seq_mean_token_mean"
    )
    loss.backward()
    assert (lp.grad[~batch.action_mask] == 0).all()
    # GSPO's sequence objective, differentiated directly (no stop-gradient construction).
    leaves = {
        t: torch.tensor(lp[t].item(), dtype=torch.float64, requires_grad=True)
        for idx in batch.action_indices()
        for t in idx
    }
    terms = []
    for i, idx in enumerate(batch.action_indices()):
        s = torch.exp(sum(leaves[t] - old[t].item() for t in idx) / len(idx))
        a = seq_adv[i].item()
        terms.append(torch.maximum(-a * s, -a * s.clamp(0.99, 1.01)))
    ref = sum(terms) / len(terms)
    ref.backward()
    assert_close(loss.detach(), ref.detach())
    for t, x in leaves.items():
        assert_close(lp.grad[t], x.grad)
    # One sample inside the clip range and one outside, so both branches are checked.
    ratios = [
        math.exp(statistics.fmean(lp[t].item() - old[t].item() for t in idx))
        for idx in batch.action_indices()
    ]
    assert sorted({abs(r - 1) > 0.01 for r in ratios}) == [False, True]


def test_gspo_refuses_dual_clip():
    batch = fixed_batch()
    lp, old, adv = ppo_inputs(batch)
    with pytest.raises(ValueError, match="dual_clip"):
        gspo_policy_loss(lp, old, adv, batch.action_mask, batch.cu_seqlens, dual_clip=3.0)


@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, gspo_policy_loss])
def test_statistics_stay_finite_at_huge_log_ratios(loss_fn):
    """A token whose log-ratio is 100 (exp overflows fp32 above ~88): the loss was finite but
    approx_kl and ratio_mean were inf. Both are computed at the bound of 20, by hand here."""
    logprobs = torch.tensor([0.0, -1.0, 99.0, -2.0])
    old = torch.tensor([0.0, -1.0, -1.0, -2.0])  # log-ratios 0, 0, 100, 0
    mask = torch.tensor([False, True, True, True])
    cu = torch.tensor([0, 4])
    loss, stats = loss_fn(logprobs, old, torch.ones(4), mask, cu)
    assert torch.isfinite(loss)
    bound = 20.0
    k3 = [0.0, math.expm1(bound) - bound, 0.0]  # the masked-in tokens, by hand
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    # PPO: per token; GSPO: one sequence, exp(mean log-ratio) = exp(100 / 3), bounded at e^20
    per_token = loss_fn is ppo_policy_loss
    expected_ratio = (1.0 + math.exp(bound) + 1.0) / 3 if per_token else math.exp(bound)
    assert stats["ratio_mean"].item() == pytest.approx(expected_ratio, rel=1e-5)
