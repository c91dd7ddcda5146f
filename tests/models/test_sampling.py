"""Sampling distributions of the hf rollout backend against a plain per-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.models.sampling import SamplingSpec, draw, sampling_logprobs


def _reference_row(
    logits: list[float], spec: SamplingSpec, step: int, stops: set[int], seen: set[int]
) -> list[float]:
    """One row by hand, in vLLM's order, with Python lists and math only."""
    x = list(logits)
    if spec.repetition_penalty != 1.0:
        x = [
            (v / spec.repetition_penalty if v > 0 else v * spec.repetition_penalty) if i in seen else v
            for i, v in enumerate(x)
        ]
    if step < spec.min_tokens:
        x = [-math.inf if i in stops else v for i, v in enumerate(x)]
    if spec.temperature == 0:
        keep = [v > -math.inf for v in x]
    else:
        x = [v / spec.temperature for v in x]
        keep = [v > -math.inf for v in x]
        z = sum(math.exp(v) for v in x if v > -math.inf)
        p = [math.exp(v) / z if v > -math.inf else 0.0 for v in x]
        if spec.min_p > 0:
            keep = [k and pi >= spec.min_p * max(p) for k, pi in zip(keep, p, strict=True)]
        if spec.top_k > 0:
            kth = sorted((v for v, k in zip(x, keep, strict=True) if k), reverse=True)[: spec.top_k][-1]
            keep = [k and v >= kth for k, v in zip(keep, x, strict=True)]
        if spec.top_p < 1:
            kept = [i for i in sorted(range(len(x)), key=lambda i: -x[i]) if keep[i]]
            z = sum(math.exp(x[i]) for i in kept)
            mass, allowed = 0.0, set()
            for i in kept:  # the most likely first, until the mass before a token reaches top_p
                if mass >= spec.top_p:
                    break
                allowed.add(i)
                mass += math.exp(x[i]) / z
            keep = [i in allowed for i in range(len(x))]
    z = sum(math.exp(v) for v, k in zip(x, keep, strict=True) if k)
    return [v - math.log(z) if k else -math.inf for v, k in zip(x, keep, strict=True)]


SPECS = [
    SamplingSpec(),
    SamplingSpec(temperature=0.7),
    SamplingSpec(temperature=1.3, top_k=5),
    SamplingSpec(temperature=0.9, top_p=0.8),
    SamplingSpec(temperature=1.0, min_p=0.1),
    SamplingSpec(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    SamplingSpec(temperature=1.0, min_tokens=3, repetition_penalty=1.3),
    SamplingSpec(temperature=0.0),
    SamplingSpec(temperature=0.0, min_tokens=2, repetition_penalty=1.5),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("step", [0, 5])
def test_sampling_logprobs_match_a_plain_reference(spec, step):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    stops = torch.tensor([2, 7])
    seen = torch.rand(6, 40, generator=g) < 0.2
    got = sampling_logprobs(logits, spec, step=step, stop_ids=stops, seen=seen)
    for r in range(6):
        ref = _reference_row(
            logits[r].tolist(), spec, step, {2, 7}, set(seen[r].nonzero().flatten().tolist())
        )
        torch.testing.assert_close(got[r], torch.tensor(ref), atol=1e-5, rtol=1e-5)
    if step < spec.min_tokens:
        assert torch.isinf(got[:, [2, 7]]).all()
    else:
        assert torch.isfinite(got[:, [2, 7]]).all() or spec.top_k > 0 or spec.top_p < 1 or spec.min_p > 0


def test_truncation_and_temperature_change_the_distribution():
    # the reference comparison above can fail: these settings do move the numbers
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3
    base = sampling_logprobs(logits, SamplingSpec())
    for spec in SPECS[1:6]:
        assert (sampling_logprobs(logits, spec) - base).abs().max() > 1e-3


def test_draw_follows_the_distribution_and_never_picks_a_masked_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0]])
    lp = sampling_logprobs(logits, SamplingSpec(temperature=1.0, top_k=4))
    n = 40_000
    u = 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = draw(lp.expand(n, -1), u)
    freq = torch.bincount(tok, minlength=6).double() / n
    p = lp[0].exp().double()
    assert freq[p == 0].sum() == 0  # the two dropped tokens never come out
    assert (freq - p).abs().max() < 0.01  # 4 sigma of a binomial at n=40k is < 0.01
    # the ends of (0, 1]: u=1 takes the last kept token, a tiny u the first kept one
    edge = draw(lp.expand(2, -1), torch.tensor([1.0, 1e-12], dtype=torch.float64))
    kept = (p > 0).nonzero().flatten()
    assert edge.tolist() == [int(kept[-1]), int(kept[0])]


def test_greedy_takes_the_argmax_of_the_processed_logits():
    logits = torch.tensor([[0.1, 5.0, 4.0], [3.0, 2.0, 9.0]])
    spec = SamplingSpec(temperature=0.0, min_tokens=1)
    lp = sampling_logprobs(logits, spec, step=0, stop_ids=torch.tensor([2]))
    assert draw(lp, torch.ones(2), greedy=True).tolist() == [1, 0]  # token 2 is masked before min_tokens
