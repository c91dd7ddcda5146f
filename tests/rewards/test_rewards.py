import math

import pytest

from rlhf.rewards import RewardComponent, RewardFunctionError, load_reward_fn, non_finite_indices
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
        RewardComponent("always_raises", fn).score(["p"], ["r"], [{}], timeout_s=60)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_non_float_reward_is_an_error():
    with pytest.raises(RewardFunctionError, match="must return a float"):
        RewardComponent("fn", lambda p, r, i: "high").score(["p"], ["r"], [{}], timeout_s=60)


def test_non_finite_indices():
    assert non_finite_indices([1.0, math.nan, math.inf, -2.0]) == [1, 2]


def test_numeric_string_is_an_error_naming_the_sample():
    with pytest.raises(RewardFunctionError, match="sample 1 returned '0.5'"):
        RewardComponent("fn", lambda p, r, i: 1.0 if r == "a" else "0.5").score(
            ["p", "p"], ["a", "b"], [{}, {}], timeout_s=60
        )


def test_a_hanging_reward_fails_within_the_timeout_naming_it():
    import time

    def hangs(p, r, info):
        time.sleep(30)
        return 1.0

    t0 = time.perf_counter()
    with pytest.raises(
        RewardFunctionError, match=r"hangs on sample 0 did not return within reward.timeout_s=0.2"
    ):
        RewardComponent("hangs", hangs).score(["p"], ["r"], [{}], timeout_s=0.2)
    assert time.perf_counter() - t0 < 5


def test_weighted_components_and_a_batched_function():
    from rlhf.rewards import Reward, RewardComponent, batched

    calls = []

    @batched
    def lengths(prompts, responses, infos):
        calls.append(len(responses))
        return [float(len(r)) for r in responses]

    def answer(p, r, info):
        return float(r == info["answer"])

    reward = Reward([RewardComponent("answer", answer, 0.9), RewardComponent("lengths", lengths, 0.1)])
    totals, parts, _, _ = reward(
        ["p", "p", "p"], ["3", "44", "3"], [{"answer": "3"}, {"answer": "3"}, {"answer": "4"}]
    )
    assert calls == [3]  # one call for the batch
    assert parts == {"answer": [1.0, 0.0, 0.0], "lengths": [1.0, 2.0, 1.0]}
    assert totals == pytest.approx([0.9 + 0.1, 0.2, 0.1])


def test_a_batched_function_must_return_one_score_per_sample():
    from rlhf.rewards import Reward, RewardComponent, batched

    reward = Reward([RewardComponent("short", batched(lambda p, r, i: [1.0]))])
    with pytest.raises(
        RewardFunctionError, match="short \\(batched\\) returned list of length 1 for 2 samples"
    ):
        reward(["p", "p"], ["a", "b"], [{}, {}])


def test_reward_from_config(tmp_path):
    from rlhf.config import ConfigError, compose
    from rlhf.rewards import Reward

    cfg = compose(
        "ppo",
        [
            "data.prompts=prompts.jsonl",
            "reward.functions=[rlhf.rewards.verifiers:exact_match_reward,rlhf.rewards.verifiers:format_reward]",
            "reward.weights=[1.0,0.5]",
        ],
    )
    reward = Reward.from_config(cfg.reward)
    totals, parts, _, _ = reward(["q"], ["#### 7"], [{"answer": "7"}])
    assert totals == [1.5] and set(parts) == {"exact_match_reward", "format_reward"}
    with pytest.raises(ConfigError, match="reward.weights has 1 entries for 2"):
        compose("ppo", ["data.prompts=prompts.jsonl", "reward.functions=[a:b,c:d]", "reward.weights=[1.0]"])


def test_per_sample_calls_share_one_thread_and_each_has_its_own_timeout():
    import threading
    import time

    threads = []

    def slowish(p, r, info):
        threads.append(threading.get_ident())
        time.sleep(0.1)
        return float(len(r))

    # five calls of 0.1 s under a 0.3 s bound: the bound is per call, not per batch
    out = RewardComponent("slowish", slowish).score(
        ["p"] * 5, ["a", "bb", "c", "dd", "e"], [{}] * 5, timeout_s=0.3
    )
    assert out == [1.0, 2.0, 1.0, 2.0, 1.0]
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_a_hang_in_the_middle_of_a_batch_names_that_sample():
    import time

    def third_hangs(p, r, info):
        if r == "c":
            time.sleep(30)
        return 1.0

    t0 = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"third_hangs on sample 2 did not return within"):
        RewardComponent("third_hangs", third_hangs).score(["p"] * 4, list("abcd"), [{}] * 4, timeout_s=0.3)
    assert time.perf_counter() - t0 < 5


def test_a_raising_sample_in_a_batch_is_named_with_its_own_text():
    def second_raises(p, r, info):
        if r == "b":
            raise KeyError("answer")
        return 1.0

    with pytest.raises(RewardFunctionError, match=r"sample 1 raised \(KeyError.*response='b'"):
        RewardComponent("second_raises", second_raises).score(["p"] * 3, list("abc"), [{}] * 3, timeout_s=5)


def test_the_built_in_verifiers_read_the_label_column_the_config_names():
    """data.label_key=target (or reward.label_key) reaches the built-in verifiers: they read a
    fixed info["answer"] before and failed with a KeyError on every row."""
    from rlhf.config import compose
    from rlhf.rewards import Reward

    fns = "reward.functions=[rlhf.rewards.verifiers:exact_match_reward,rlhf.rewards.verifiers:math_verify_reward]"
    for overrides, key in (
        (["data.label_key=target"], "target"),
        (["data.label_key=target", "reward.label_key=gold"], "gold"),
        ([], "answer"),
    ):
        cfg = compose("ppo", ["data.prompts=p.jsonl", fns, *overrides])
        assert cfg.label_key == key
        totals, parts, errors, _ = Reward.from_config(cfg.reward, cfg.label_key)(
            ["q", "q"], ["#### 7", "#### 8"], [{key: "7"}, {key: "7"}]
        )
        assert totals == [2.0, 0.0] and errors == []
    user_fn = Reward.from_config(
        compose("ppo", ["data.prompts=p.jsonl", "reward.function=rlhf.rewards.toy:count_reward"]).reward, "x"
    )
    assert user_fn.components[0].fn is count_reward  # a user's own function is not rebound


def test_eval_rows_carry_their_label_under_the_training_name(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    from rlhf.data.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    path = tmp_path / "eval.jsonl"
    path.write_text('{"question": "count 1", "target": "2"}\n')
    (p,), _ = load_prompts(str(path), tok, "question", label_key="target", section="eval", label_as="answer")
    assert p.info["answer"] == "2" and p.info["target"] == "2"


@pytest.mark.parametrize("on_error", ["fail", "zero", "drop"])
def test_a_reward_that_raises_on_some_rows_fails_scores_zero_or_drops(on_error):
    from rlhf.rewards import Reward, RewardComponent

    def picky(p, r, info):
        if r == "bad":
            raise ValueError("cannot parse")
        return 1.0

    reward = Reward(
        [RewardComponent("picky", picky), RewardComponent("one", lambda p, r, i: 0.5)], 5.0, on_error
    )
    if on_error == "fail":
        with pytest.raises(RewardFunctionError, match="picky on sample 1 raised .ValueError: cannot parse"):
            reward(["p"] * 3, ["ok", "bad", "ok"], [{}] * 3)
        return
    totals, parts, errors, _ = reward(["p"] * 3, ["ok", "bad", "ok"], [{}] * 3)
    assert errors == [1] and parts["picky"] == [1.0, 0.0, 1.0]
    if on_error == "zero":
        assert totals == [1.5, 0.5, 1.5]
    else:
        assert totals[0] == totals[2] == 1.5 and math.isnan(totals[1])
