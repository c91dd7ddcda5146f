import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rlhf.algorithms import kl_estimator

logps = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@given(st.lists(st.tuples(logps, logps), min_size=1, max_size=20))
@settings(max_examples=60, deadline=None)
def test_estimators_match_formulas(pairs):
    lp = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    k1 = [a - b for a, b in pairs]
    k2 = [0.5 * (a - b) ** 2 for a, b in pairs]
    # (ref / pi) - 1 - log(ref / pi)
    k3 = [math.exp(b - a) - 1 - (b - a) for a, b in pairs]
    assert_close(kl_estimator(lp, ref, "k1"), torch.tensor(k1, dtype=torch.float64))
    assert_close(kl_estimator(lp, ref, "k2"), torch.tensor(k2, dtype=torch.float64))
    assert_close(kl_estimator(lp, ref, "k3"), torch.tensor(k3, dtype=torch.float64))
    assert (kl_estimator(lp, ref, "k3") >= -1e-12).all()
    assert (kl_estimator(lp, ref, "k2") >= 0).all()


def test_k3_nonnegative_and_zero_at_equality_float32():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(10_000, generator=g) * 10
    ref = lp + torch.randn(10_000, generator=g) * 1e-3
    assert (kl_estimator(lp, ref, "k3") >= 0).all()
    assert (kl_estimator(lp, lp, "k3") == 0).all()


def test_k1_and_k3_are_unbiased_for_categorical_kl():
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    true_kl = sum(p * math.log(p / q) for p, q in zip(pi.tolist(), ref.tolist(), strict=True))
    tokens = torch.multinomial(pi, 400_000, replacement=True, generator=g)
    lp, rlp = pi.log()[tokens], ref.log()[tokens]
    for kind in ("k1", "k3"):
        est = kl_estimator(lp, rlp, kind).mean().item()
        assert abs(est - true_kl) < 0.01, (kind, est, true_kl)


def test_clamp_and_mask():
    lp = torch.tensor([0.0, -50.0, float("nan"), -1.0])
    ref = torch.tensor([-1.0, 0.0, -2.0, float("-inf")])
    mask = torch.tensor([True, True, False, False])
    k3 = kl_estimator(lp, ref, "k3", clamp=10.0, action_mask=mask)
    assert_close(k3, torch.tensor([math.exp(-1) - 1 + 1, 10.0, 0.0, 0.0]))
    k1 = kl_estimator(lp, ref, "k1", clamp=10.0, action_mask=mask)
    assert_close(k1, torch.tensor([1.0, -10.0, 0.0, 0.0]))


def test_masked_gradient_is_finite():
    lp = torch.tensor([-1.0, float("nan"), -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0, float("-inf")])
    mask = torch.tensor([True, False, False])
    kl_estimator(lp, ref, "k3", action_mask=mask).sum().backward()
    # d/dx [exp(-(x - r)) - 1 + (x - r)] = 1 - exp(r - x)
    assert_close(lp.grad, torch.tensor([1 - math.exp(-1.0), 0.0, 0.0]))


def test_unknown_kind():
    with pytest.raises(ValueError, match="k4"):
        kl_estimator(torch.zeros(2), torch.zeros(2), "k4")  # type: ignore[arg-type]


def test_kl_clamp_bounds_one_wild_token_and_keeps_gradients_finite():
    # log-ratio -15 gives k3 = e^15 - 1 - 15 = 3.3e6 unclamped: one token would swamp everything.
    lp = torch.tensor([-1.0, -16.0, -200.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -1.0])
    raw = kl_estimator(lp, ref, "k3")
    assert raw[1].item() > 3e6
    kl = kl_estimator(lp, ref, "k3", clamp=10.0)
    assert kl.tolist() == [0.0, 10.0, 10.0]
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[1:].tolist() == [0.0, 0.0]
