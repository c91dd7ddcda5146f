"""pass@k against a brute-force count over every k-subset."""

import itertools

import pytest

from rlhf.trainer.evaluation import pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(3, 1, 4)
