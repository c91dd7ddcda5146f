"""Built-in verifiers: final-answer extraction and the match rules."""

import pytest

from rlhf.rewards.verifiers import (
    exact_match_reward,
    extract_answer,
    format_reward,
    math_verify_reward,
    numeric_match_reward,
)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so 40 + 2 = 42\n#### 42", "42"),
        ("#### 1,234 <eos>", "1,234"),
        (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{x^{2}} then more", "x^{2}"),
        ("I think 3 apples then 7 pears", "7"),
        ("-0.5 is it", "-0.5"),
        ("no digits here", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_exact_and_numeric_match():
    assert exact_match_reward("", "#### 42", {"answer": "42"}) == 1.0
    assert exact_match_reward("", "#### 42.0", {"answer": "42"}) == 0.0
    assert numeric_match_reward("", "#### 42.0", {"answer": "42"}) == 1.0
    assert numeric_match_reward("", "it is 1,234.", {"answer": 1234}) == 1.0
    assert numeric_match_reward("", "it is 1235", {"answer": "1234"}) == 0.0
    # GSM8K keeps the whole solution in the label: its final answer is what counts
    assert numeric_match_reward("", "#### 18", {"answer": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18"}) == 1.0
    assert exact_match_reward("", "3", {"label": "3"}, key="label") == 1.0


def test_math_verify_equivalence():
    assert math_verify_reward("", r"so \boxed{\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math_verify_reward("", "#### 0.5", {"answer": r"\frac{1}{2}"}) == 1.0
    assert math_verify_reward("", r"\boxed{3}", {"answer": "3"}) == 1.0
    assert math_verify_reward("", r"\boxed{4}", {"answer": "3"}) == 0.0
    assert math_verify_reward("", "nothing", {"answer": "3"}) == 0.0


def test_format_reward():
    assert format_reward("", "work... #### 5", {}) == 1.0
    assert format_reward("", r"\boxed{5}", {}) == 1.0
    assert format_reward("", "5", {}) == 0.0


def test_missing_label_is_named():
    with pytest.raises(KeyError, match="label column 'answer'"):
        exact_match_reward("", "#### 1", {"index": 0})


def test_math_verify_through_the_timeout_wrapper():
    # the reward runs on a worker thread (reward.timeout_s), where signal-based timeouts fail
    from rlhf.rewards import RewardComponent

    scores = RewardComponent("math", math_verify_reward).score(
        ["q", "q"], [r"\boxed{0.5}", "#### 2"], [{"answer": "1/2"}] * 2, timeout_s=60
    )
    assert scores == [1.0, 0.0]
