"""DAPO overlong shaping and the informative-group filter against loop references."""

import pytest
import torch

from rlhf.algorithms.shaping import informative_samples, longest_turn, overlong_penalty


def ref_verl_overlong(length: int, max_len: int, buffer: int, factor: float) -> float:
    # verl's DAPO reward manager: min(-(len - (max_len - buffer)) / buffer * factor, 0)
    exceed = length - (max_len - buffer)
    return min(-exceed / buffer * factor, 0.0)


@pytest.mark.parametrize(("max_len", "buffer", "factor"), [(20, 4, 1.0), (16, 16, 0.5), (128, 25, 2.0)])
def test_overlong_penalty_matches_verl_for_every_length(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    for n, g in zip(lengths.tolist(), got.tolist(), strict=True):
        assert g == pytest.approx(ref_verl_overlong(n, max_len, buffer, factor))
    assert got[-1] == pytest.approx(-factor) and got[max_len - buffer] == 0.0


def test_overlong_penalty_is_bounded_beyond_the_limit():
    assert overlong_penalty(torch.tensor([40]), 20, 4, 1.0).item() == -1.0


def test_multi_turn_shaping_measures_the_longest_policy_turn():
    # prompt, turn of 3, observation, turn of 5, observation, turn of 2: 10 policy tokens in all
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert longest_turn(mask) == 5 and longest_turn(torch.zeros(4, dtype=torch.bool)) == 0
    assert longest_turn(torch.ones(7, dtype=torch.bool)) == 7  # single turn: the whole response
    # per-turn limit 6 with a ramp of 2: the sum (10) would take the full penalty; the turns are
    # within the limit and the longest (5) is one token into the ramp
    assert overlong_penalty(torch.tensor([longest_turn(mask)]), 6, 2).item() == pytest.approx(-0.5)


def test_overlong_penalty_rejects_a_bad_buffer():
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([3]), 10, 11)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([3]), 10, 0)


def test_informative_samples_by_group():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, 0.3])
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 9, 1])
    # group 7 differs; group 3 is constant; groups 9 and 1 have one sample each
    expected = [True, True, True, False, False, False, False, False]
    assert informative_samples(scores, groups).tolist() == expected
    # order-independent: shuffle and compare
    perm = torch.tensor([5, 2, 7, 0, 6, 3, 1, 4])
    assert informative_samples(scores[perm], groups[perm]).tolist() == [expected[i] for i in perm.tolist()]


def test_longest_turn_matches_a_plain_loop_on_random_masks():
    def loop(mask):
        best = run = 0
        for a in mask.tolist():
            run = run + 1 if a else 0
            best = max(best, run)
        return best

    g = torch.Generator().manual_seed(0)
    for n in [0, 1, 2, 5, 17, 64] * 20:
        mask = torch.rand(n, generator=g) < 0.6
        assert longest_turn(mask) == loop(mask)
