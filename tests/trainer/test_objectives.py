"""Objectives on a packed micro-batch == the algorithms on per-sample (unpacked) HF forwards."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.kl import kl_estimator
from rlhf.algorithms.losses import aggregate_loss, ppo_policy_loss, sft_loss, value_loss
from rlhf.data.packing import concat, dummy_flat_batch
from rlhf.data.types import Sample
from rlhf.trainer.objectives import PolicyObjective, SFTObjective, ValueObjective

LENGTHS = [(9, 3), (12, 5), (7, 2), (6, 6), (11, 4)]  # (tokens, prompt length); (6, 6): no action


def _samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, p in LENGTHS:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[p:] = True
        ids = torch.randint(8, vocab, (n,), generator=g)
        old, ref, adv, val, ret = (torch.randn(n, generator=g) * 0.3 for _ in range(5))
        out.append(
            Sample(
                ids,
                mask,
                old_logprobs=old - 3.0,
                ref_logprobs=ref - 3.0,
                advantages=adv * 3,
                values=val,
                returns=ret + 0.5,
            )
        )
    return out


@pytest.fixture(scope="module")
def lm(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.models.forward import prepare_model_for_packing

    m = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    prepare_model_for_packing(m)
    return m, ref


@pytest.fixture(scope="module")
def value_model(tiny_llama_dir):
    from rlhf.models.forward import build_value_model, prepare_model_for_packing

    torch.manual_seed(0)
    m = build_value_model(tiny_llama_dir, init_from_causal_lm=True).eval()
    prepare_model_for_packing(m)
    return m


def _ref_logprobs(ref, s: Sample, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain HF forward of one sample: logprobs and entropy aligned to the token, 0 at t=0."""
    logp = torch.log_softmax(ref(s.input_ids[None]).logits[0].float() / temperature, -1)
    lp, ent = torch.zeros(len(s)), torch.zeros(len(s))
    lp[1:] = logp[:-1].gather(-1, s.input_ids[1:, None])[:, 0]
    ent[1:] = -(logp.exp() * logp).sum(-1)[:-1]
    return lp, ent


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_policy_objective_matches_per_sample_reference(lm, aggregation: str) -> None:
    model, ref = lm
    samples = _samples(model.config.vocab_size)
    mb = concat(samples)
    obj = PolicyObjective(
        clip_eps_low=0.1,
        clip_eps_high=0.3,
        dual_clip=3.0,
        kl_coef_in_loss=0.1,
        kl_kind="k3",
        entropy_coef=0.01,
        temperature=0.7,
        aggregation=aggregation,
    )
    with torch.no_grad():
        loss, stats = obj(model, mb, 1.0)
        scaled, _ = obj(model, mb, 0.25)
        per = [_ref_logprobs(ref, s, 0.7) for s in samples]
    lp, ent = _flat([p[0] for p in per]), _flat([p[1] for p in per])
    m, cu = mb.action_mask, mb.cu_seqlens
    exp_ppo, exp_stats = ppo_policy_loss(
        lp, mb.old_logprobs, mb.advantages, m, cu, 0.1, 0.3, 3.0, aggregation
    )
    exp_kl = aggregate_loss(kl_estimator(lp, mb.ref_logprobs, "k3", action_mask=m), m, cu, aggregation)
    exp_ent = aggregate_loss(ent, m, cu, aggregation)
    expected = exp_ppo + 0.1 * exp_kl - 0.01 * exp_ent
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scaled, 0.25 * expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["loss"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["policy_loss"], exp_ppo, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["kl_loss"], exp_kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["entropy"], exp_ent, atol=1e-5, rtol=1e-5)
    for k in ("clip_fraction", "approx_kl", "dual_clip_fraction"):
        torch.testing.assert_close(stats[k], exp_stats[k], atol=1e-5, rtol=1e-5)


def test_policy_objective_gradient_flows_and_scales(lm) -> None:
    model, _ = lm
    mb = concat(_samples(model.config.vocab_size))
    grads = []
    for scale in (1.0, 0.5):
        model.zero_grad()
        loss, _ = PolicyObjective()(model, mb, scale)
        loss.backward()
        grads.append(model.lm_head.weight.grad.clone())
    model.zero_grad()
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], 0.5 * grads[0], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_policy_objective_without_entropy_bonus_loss_and_grads(lm, aggregation: str) -> None:
    """entropy_coef=0 (entropy only a statistic, no graph): loss, stats and every parameter
    gradient match an independent per-sample reference on a separate copy of the model."""
    model, ref = lm
    samples = _samples(model.config.vocab_size)
    mb = concat(samples)
    obj = PolicyObjective(kl_coef_in_loss=0.1, entropy_coef=0.0, temperature=0.7, aggregation=aggregation)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    loss, stats = obj(model, mb, 0.5)
    loss.backward()

    per = [_ref_logprobs(ref, s, 0.7) for s in samples]
    lp, ent = _flat([p[0] for p in per]), _flat([p[1] for p in per])
    m, cu = mb.action_mask, mb.cu_seqlens
    exp_ppo, _ = ppo_policy_loss(lp, mb.old_logprobs, mb.advantages, m, cu, 0.2, 0.2, None, aggregation)
    exp_kl = aggregate_loss(kl_estimator(lp, mb.ref_logprobs, "k3", action_mask=m), m, cu, aggregation)
    expected = exp_ppo + 0.1 * exp_kl
    (0.5 * expected).backward()

    torch.testing.assert_close(loss.detach(), 0.5 * expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["loss"], expected.detach(), atol=1e-5, rtol=1e-5)
    exp_ent = aggregate_loss(ent.detach(), m, cu, aggregation)
    torch.testing.assert_close(stats["entropy"], exp_ent, atol=1e-5, rtol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, ref_grads[n].grad, atol=1e-5, rtol=1e-4, msg=f"grad of {n}")
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("clip_eps", [0.2, None])
def test_value_objective_matches_per_sample_reference(value_model, clip_eps: float | None) -> None:
    samples = _samples(value_model.config.vocab_size)
    mb = concat(samples)
    with torch.no_grad():
        loss, stats = ValueObjective(clip_eps=clip_eps, aggregation="token_mean")(value_model, mb, 1.0)
        parts = []
        for s in samples:
            h = value_model.base_model(s.input_ids[None]).last_hidden_state[0]
            v = torch.zeros(len(s))
            v[1:] = value_model.score(h[:-1])[:, 0]
            parts.append(v)
    expected, exp_stats = value_loss(
        _flat(parts),
        mb.values,
        mb.returns,
        mb.action_mask,
        mb.cu_seqlens,
        clip_eps=clip_eps,
        aggregation="token_mean",
    )
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        stats["explained_variance"], exp_stats["explained_variance"], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_sft_objective_matches_per_sample_reference(lm, aggregation: str) -> None:
    model, ref = lm
    samples = _samples(model.config.vocab_size)
    mb = concat(samples)
    with torch.no_grad():
        loss, stats = SFTObjective(aggregation=aggregation)(model, mb, 1.0)
        lp = _flat([_ref_logprobs(ref, s)[0] for s in samples])
    expected = sft_loss(lp, mb.action_mask, mb.cu_seqlens, aggregation)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    # Independent of rlhf.algorithms: mean NLL over all response tokens / over samples.
    parts = [_ref_logprobs(ref, s)[0][s.action_mask] for s in samples]
    if aggregation == "token_mean":
        manual = -torch.cat(parts).mean()
    else:
        manual = -torch.stack([p.mean() for p in parts if p.numel()]).mean()
    torch.testing.assert_close(stats["loss"], manual.detach(), atol=1e-5, rtol=1e-5)


def test_loss_weight_counts_tokens_or_samples_with_actions() -> None:
    mb = concat(_samples(100))
    n_actions = sum(n - p for n, p in LENGTHS)
    assert SFTObjective().loss_weight(mb) == n_actions
    assert SFTObjective(aggregation="seq_mean_token_mean").loss_weight(mb) == len(LENGTHS) - 1
    assert PolicyObjective(aggregation="seq_mean_token_sum").loss_weight(mb) == len(LENGTHS) - 1


def test_dummy_batch_gives_zero_finite_loss_for_every_objective(lm, value_model) -> None:
    model, _ = lm
    d = dummy_flat_batch()
    assert d.num_tokens == 2 and d.num_samples == 1 and bool(d.action_mask[1])
    for obj, m in (
        (PolicyObjective(kl_coef_in_loss=0.1), model),
        (SFTObjective(), model),
        (ValueObjective(), value_model),
    ):
        loss, _ = obj(m, obj.dummy_batch(), 0.0)
        assert loss.requires_grad and float(loss.detach()) == 0.0


def test_missing_fields_are_named(lm) -> None:
    model, _ = lm
    mb = concat([Sample(torch.tensor([9, 10, 11]), torch.tensor([False, True, True]))])
    with pytest.raises(ValueError, match="advantages"):
        PolicyObjective()(model, mb, 1.0)
    with pytest.raises(ValueError, match="returns"):
        ValueObjective()(model, mb, 1.0)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_loss_weights_reweight_and_drop_tokens(lm, policy_loss: str) -> None:
    """Weights multiply the policy term; a zero-weight token leaves every term and the normaliser."""
    from rlhf.algorithms.registry import POLICY_LOSSES

    model, ref = lm
    samples = _samples(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    for i, s in enumerate(samples):
        w = torch.rand(len(s), generator=g) * 2 * s.action_mask
        if i == 1:
            w[:] = 0.0  # e.g. a truncated sample under the overlong filter
        w[-1] = 0.0  # e.g. a token rejected by MIS
        s.loss_weights = w
    mb = concat(samples)
    obj = PolicyObjective(
        policy_loss=policy_loss, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef_in_loss=0.1, entropy_coef=0.01
    )
    with torch.no_grad():
        loss, stats = obj(model, mb, 1.0)
        per = [_ref_logprobs(ref, s) for s in samples]
    lp, ent = _flat([p[0] for p in per]), _flat([p[1] for p in per])
    keep = mb.action_mask & (mb.loss_weights > 0)
    cu = mb.cu_seqlens
    exp_pol, _ = POLICY_LOSSES[policy_loss].fn(
        lp,
        mb.old_logprobs,
        mb.advantages,
        keep,
        cu,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=None,
        aggregation="token_mean",
        weights=mb.loss_weights,
    )
    exp_kl = aggregate_loss(kl_estimator(lp, mb.ref_logprobs, "k3", action_mask=keep), keep, cu)
    exp_ent = aggregate_loss(ent, keep, cu)
    torch.testing.assert_close(loss, exp_pol + 0.1 * exp_kl - 0.01 * exp_ent, atol=1e-5, rtol=1e-5)
    # token_mean normaliser: only the kept tokens count
    assert obj.loss_weight(mb) == float(keep.sum()) < float(mb.action_mask.sum())
    # a per-token loop for the policy term under ppo: weight * clipped surrogate, mean over kept tokens
    if policy_loss == "ppo":
        terms = []
        for t in torch.nonzero(keep).flatten().tolist():
            r = math.exp(lp[t] - mb.old_logprobs[t])
            a = float(mb.advantages[t])
            terms.append(float(mb.loss_weights[t]) * max(-a * r, -a * min(max(r, 0.8), 1.28)))
        assert float(stats["policy_loss"]) == pytest.approx(sum(terms) / len(terms), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_without_old_logprobs_the_step_equals_one_with_a_separate_old_forward(lm, policy_loss: str) -> None:
    """The scorer skips the actor when the only optimizer step starts from the sampling
    weights: loss, gradients and stats must equal those with old logprobs from a separate
    forward of those weights (a plain per-sample HF forward of an independent copy)."""
    model, ref = lm
    samples = _samples(model.config.vocab_size)
    for s in samples:
        s.rollout_logprobs = s.old_logprobs + 0.01  # an engine's logprobs, slightly off
    obj = PolicyObjective(policy_loss=policy_loss, kl_coef_in_loss=0.1, kl_kind="k3", temperature=0.7)

    def step(batch):
        model.zero_grad(set_to_none=True)
        loss, stats = obj(model, batch, 1.0)
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    with torch.no_grad():
        old = [_ref_logprobs(ref, s, 0.7)[0] for s in samples]
    with_old = concat([Sample(**{**vars(s), "old_logprobs": o}) for s, o in zip(samples, old, strict=True)])
    without = concat([Sample(**{**vars(s), "old_logprobs": None}) for s in samples])
    loss_a, stats_a, grads_a = step(with_old)
    loss_b, stats_b, grads_b = step(without)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    for k in ("policy_loss", "kl_loss", "entropy", "clip_fraction"):
        if k in stats_a:
            torch.testing.assert_close(stats_b[k], stats_a[k], atol=1e-6, rtol=1e-5, msg=k)
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, atol=1e-6, rtol=1e-4, msg=n)
    # What the skipped scorer forward would have reported, measured by this one instead.
    m = without.action_mask
    lp = _flat(old)
    kl = kl_estimator(lp, without.ref_logprobs, "k3")
    torch.testing.assert_close(stats_b["kl_before_update"], kl[m].mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        stats_b["logprob_gap"], (lp - without.rollout_logprobs)[m].abs().mean(), atol=1e-5, rtol=1e-5
    )
    assert "kl_before_update" not in stats_a and "logprob_gap" not in stats_a
