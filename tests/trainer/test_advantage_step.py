"""The advantage step against independent loop references on small batches."""

import math

import pytest
import torch

from rlhf.config.schema import AlgorithmConfig
from rlhf.data.types import Sample
from rlhf.trainer.advantage_step import advantage_step


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(2):
        for k in range(3):
            n = 6 + 3 * k + group
            mask = torch.zeros(n, dtype=torch.bool)
            mask[3:] = True
            if k == 2:  # multi-turn: an observation span in the middle
                mask[6:8] = False
            out.append(
                Sample(
                    input_ids=torch.arange(n),
                    action_mask=mask,
                    score=float(torch.rand(1, generator=g)),
                    group_id=group,
                    old_logprobs=-torch.rand(n, generator=g),
                    ref_logprobs=-torch.rand(n, generator=g),
                    values=torch.randn(n, generator=g),
                )
            )
    return out


def _ref_gae(s: Sample, kl_coef: float, gamma: float, lam: float):
    idx = [t for t in range(len(s)) if s.action_mask[t]]
    kl = [float(s.old_logprobs[t] - s.ref_logprobs[t]) for t in idx]  # k1
    r = [-kl_coef * x for x in kl]
    r[-1] += s.score
    v = [float(s.values[t]) for t in idx] + [0.0]
    adv = [0.0] * len(idx)
    running = 0.0
    for k in reversed(range(len(idx))):
        running = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * running
        adv[k] = running
    full = torch.zeros(len(s))
    ret = torch.zeros(len(s))
    for k, t in enumerate(idx):
        full[t], ret[t] = adv[k], adv[k] + v[k]
    return full, ret


def test_gae_step_matches_loop_reference():
    samples = _samples()
    cfg = AlgorithmConfig(
        advantage="gae", kl_kind="k1", kl_coef=0.05, gamma=0.99, lam=0.9, normalize_advantages=False
    )
    advantage_step(samples, cfg)
    for s in samples:
        adv, ret = _ref_gae(s, 0.05, 0.99, 0.9)
        torch.testing.assert_close(s.advantages, adv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.returns, ret, atol=1e-5, rtol=1e-5)


def test_grpo_step_matches_group_reference():
    samples = _samples()
    advantage_step(samples, AlgorithmConfig(advantage="grpo", kl_in_reward=False, normalize_advantages=False))
    for s in samples:
        group = [x.score for x in samples if x.group_id == s.group_id]
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        expected = (s.score - mean) / (std + 1e-6)
        assert s.advantages[s.action_mask] == pytest.approx([expected] * s.num_actions, abs=1e-5)
        assert (s.advantages[~s.action_mask] == 0).all()


def test_rloo_with_kl_in_reward_uses_penalised_scores():
    samples = _samples()
    advantage_step(
        samples, AlgorithmConfig(advantage="rloo", kl_kind="k1", kl_coef=0.1, normalize_advantages=False)
    )
    pen = {
        id(x): x.score - 0.1 * float((x.old_logprobs - x.ref_logprobs)[x.action_mask].sum()) for x in samples
    }
    for s in samples:
        others = [pen[id(x)] for x in samples if x.group_id == s.group_id and x is not s]
        expected = pen[id(s)] - sum(others) / len(others)
        assert float(s.advantages[s.action_mask][0]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kind", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_estimator_zero_off_mask_and_whitened(kind):
    samples = _samples(1)
    advantage_step(samples, AlgorithmConfig(advantage=kind, normalize_advantages=True))
    adv = torch.cat([s.advantages for s in samples])
    mask = torch.cat([s.action_mask for s in samples])
    assert torch.isfinite(adv).all()
    assert (adv[~mask] == 0).all()
    assert float(adv[mask].mean()) == pytest.approx(0.0, abs=1e-5)


def test_empty_response_sample_does_not_poison_the_batch():
    samples = _samples()
    empty = Sample(
        input_ids=torch.arange(4),
        action_mask=torch.zeros(4, dtype=torch.bool),
        score=1.0,
        group_id=0,
        old_logprobs=torch.zeros(4),
        ref_logprobs=torch.zeros(4),
        values=torch.zeros(4),
    )
    samples.append(empty)
    for kind in ("gae", "grpo"):
        advantage_step(samples, AlgorithmConfig(advantage=kind))
        assert torch.isfinite(torch.cat([s.advantages for s in samples])).all()
        assert (empty.advantages == 0).all()


def _with_rollout(samples, spread=0.5, seed=3):
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        s.rollout_logprobs = torch.where(
            s.action_mask, s.old_logprobs + spread * torch.randn(len(s), generator=g), torch.zeros(len(s))
        )
    return samples


def test_tis_loss_weights_match_token_loop_and_report_mismatch():
    samples = _with_rollout(_samples())
    cfg = AlgorithmConfig(advantage="grpo", rollout_correction="tis", tis_cap=1.5)
    stats = advantage_step(samples, cfg)
    hits, k1 = [], []
    for s in samples:
        for t in range(len(s)):
            if not s.action_mask[t]:
                assert s.loss_weights[t] == 0
                continue
            log_rho = float(s.old_logprobs[t] - s.rollout_logprobs[t])
            assert float(s.loss_weights[t]) == pytest.approx(min(math.exp(log_rho), 1.5), rel=1e-5)
            hits.append(math.exp(log_rho) > 1.5)
            k1.append(-log_rho)
    assert 0 < stats["rollout_corr/truncated_fraction"] == pytest.approx(sum(hits) / len(hits))
    assert stats["rollout_corr/kl_k1"] == pytest.approx(sum(k1) / len(k1), rel=1e-4)


def test_rollout_correction_without_engine_logprobs_is_a_clear_error():
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction=mis needs the engines' logprobs"):
        advantage_step(_samples(), AlgorithmConfig(advantage="grpo", rollout_correction="mis"))


def test_overlong_filter_zeroes_truncated_samples_only():
    samples = _samples()
    for i, s in enumerate(samples):
        s.finish_reason = "length" if i % 2 else "stop"
    stats = advantage_step(samples, AlgorithmConfig(advantage="grpo", overlong_filter=True))
    for i, s in enumerate(samples):
        expected = torch.zeros(len(s)) if i % 2 else s.action_mask.float()
        assert torch.equal(s.loss_weights, expected)
    assert stats["rollout/overlong_filtered"] == pytest.approx(0.5)


def test_no_loss_weights_unless_asked():
    samples = _with_rollout(_samples())
    stats = advantage_step(samples, AlgorithmConfig(advantage="grpo"))
    assert all(s.loss_weights is None for s in samples)
    assert stats["rollout_corr/kl_k3"] > 0  # the mismatch is still measured


def test_kl_clamp_in_the_step():
    samples = _samples()
    samples[0].old_logprobs[4] = -30.0  # one wild token: unclamped k3 would be ~e^29
    advantage_step(
        samples,
        AlgorithmConfig(
            advantage="grpo", kl_kind="k3", kl_coef=0.1, kl_clamp=10.0, normalize_advantages=False
        ),
    )

    def k3(s, t):
        lr = max(-20.0, min(20.0, float(s.old_logprobs[t] - s.ref_logprobs[t])))
        return min(10.0, math.exp(-lr) - 1 + lr)

    pen = {id(x): x.score - 0.1 * sum(k3(x, t) for t in range(len(x)) if x.action_mask[t]) for x in samples}
    for s in samples:
        group = [pen[id(x)] for x in samples if x.group_id == s.group_id]
        mean = sum(group) / len(group)
        std = (sum((v - mean) ** 2 for v in group) / (len(group) - 1)) ** 0.5
        expected = (pen[id(s)] - mean) / (std + 1e-6)
        assert float(s.advantages[s.action_mask][0]) == pytest.approx(expected, abs=1e-4)
