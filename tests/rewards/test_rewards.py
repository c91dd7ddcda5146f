import math

import pytest

from rlhf.rewards import RewardFunctionError, load_reward_fn, non_finite_indices, score_with_function
from rlhf.rewards.toy import count_reward


def test_count_reward_values():
    assert count_reward("count 3 4", "5 6 7 <|end|> <eos>", {}) == pytest.approx(1.0)
    assert count_reward("count 3 4", "a b", {}) == 0.0
    # numbers but wrong count: only the numeric half
    assert count_reward("count 3 4", "9 9", {}) == pytest.approx(0.5)
    assert count_reward("count 3 4", "5 x", {}) == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)
    assert count_reward("count 3 4", "", {}) == 0.0


def test_load_by_module_and_by_file(tmp_path):
    assert load_reward_fn("rlhf.rewards.toy:count_reward") is count_reward
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompt, response, info):\n    return float(len(response))\n")
    fn = load_reward_fn(f"{f}:score")
    assert fn("p", "abc", {}) == 3.0


@pytest.mark.parametrize(
    ("spec", "msg"),
    [
        ("no_colon", "module:fn"),
        ("rlhf.nope:f", "cannot import"),
        ("rlhf.rewards.toy:missing", "no callable"),
        ("/nonexistent/file.py:f", "does not exist"),
    ],
)
def test_bad_specs_name_the_field(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        load_reward_fn(spec)
    assert "reward.function" in str(e.value)


def test_raising_reward_names_sample_and_keeps_cause():
    fn = load_reward_fn("rlhf.rewards.toy:always_raises")
    with pytest.raises(RewardFunctionError, match="sample 0") as e:
        score_with_function(fn, ["p"], ["r"], [{}])
    assert isinstance(e.value.__cause__, RuntimeError)


def test_non_float_reward_is_an_error():
    with pytest.raises(RewardFunctionError, match="must return a float"):
        score_with_function(lambda p, r, i: "high", ["p"], ["r"], [{}])


def test_non_finite_indices():
    assert non_finite_indices([1.0, math.nan, math.inf, -2.0]) == [1, 2]
