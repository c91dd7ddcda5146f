"""math-verify in its own process: a runaway check stopped at its budget, scored 0 and counted;
the child outliving neither the driver nor a signal meant for the driver's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlhf.rewards import Reward, RewardComponent, batched, count
from rlhf.rewards.verifiers import math_verify_reward
from rlhf.rewards.verify_process import VerifyProcess, check

REPO = Path(__file__).resolve().parents[2]
RUNAWAY = "9^{9^{9^{9}}}"  # sympy evaluates the tower: minutes at least


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is gone for our purposes
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_scores_equal_the_in_process_check():
    vp = VerifyProcess()
    try:
        pairs = [("0.5", r"\frac{1}{2}"), ("3", "3"), ("3", "4"), (r"\frac{1}{3}", "0.3333"), ("x+1", "1+x")]
        assert [vp.check(a, b, 30) for a, b in pairs] == [check(a, b) for a, b in pairs]
    finally:
        vp.close()


def test_a_runaway_check_is_stopped_at_its_budget_and_the_next_one_runs():
    vp = VerifyProcess()
    try:
        assert vp.check("1", "1", 60) == 1.0  # started and warm
        first = vp._proc.pid
        t0 = time.monotonic()
        assert vp.check("1", RUNAWAY, 1.0) is None
        took = time.monotonic() - t0
        assert 1.0 <= took < 10, took
        assert vp.timeouts == 1 and not _alive(first)  # killed, not left burning a core
        assert vp.check("2", "2", 60) == 1.0 and vp._proc.pid != first
    finally:
        vp.close()


def test_timeouts_are_counted_per_batch_and_zero_when_none():
    reward = Reward([RewardComponent("math_verify_reward", math_verify_reward)], timeout_s=60)
    got = reward(
        ["q"] * 3,
        [f"#### {RUNAWAY}", "#### 2", "#### 3"],
        [{"answer": "1"}, {"answer": "2"}, {"answer": "4"}],
    )
    assert got.totals == [0.0, 1.0, 0.0] and got.counts == {"verify_timeouts": 1} and got.errors == []
    # the default budget (reward.verify_timeout_s=5) applies when nothing binds it
    assert reward(["q"], ["#### 2"], [{"answer": "2"}]).counts == {"verify_timeouts": 0}


def test_the_config_budget_reaches_the_verifier_and_must_be_below_the_call_timeout():
    from rlhf.config import ConfigError, compose

    cfg = compose("ppo", ["experiment=rlvr_math", "reward.verify_timeout_s=0.5"])
    reward = Reward.from_config(cfg.reward, cfg.label_key)
    mv = next(c for c in reward.components if c.name == "math_verify_reward")
    assert mv.fn.keywords["timeout_s"] == 0.5 and mv.fn.counts == ("verify_timeouts",)
    t0 = time.monotonic()
    assert reward(["q"], [f"#### {RUNAWAY}"], [{"answer": "1"}]).counts["verify_timeouts"] == 1
    assert time.monotonic() - t0 < 10
    with pytest.raises(
        ConfigError, match="reward.verify_timeout_s=60 must be > 0 and below reward.timeout_s=30"
    ):
        compose("ppo", ["experiment=rlvr_math", "reward.verify_timeout_s=60", "reward.timeout_s=30"])


def test_count_is_per_batch_and_a_no_op_outside_one():
    count("nothing")  # no batch being scored: nothing to count into, no error

    @batched
    def flags(prompts, responses, infos):
        for r in responses:
            if "!" in r:
                count("shouted")
        return [1.0] * len(responses)

    flags.counts = ("shouted", "whispered")
    got = Reward([RewardComponent("flags", flags)])(["p"] * 3, ["a!", "b", "c!"], [{}] * 3)
    assert got.counts == {"shouted": 2, "whispered": 0}


def test_threads_take_turns_and_each_gets_its_own_answer():
    vp = VerifyProcess()
    results: dict[int, list[float | None]] = {}

    def work(k: int) -> None:
        results[k] = [vp.check(str(k * 100 + i), str(k * 100 + i + (i % 2)), 60) for i in range(20)]

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all(results[k] == [1.0, 0.0] * 10 for k in range(4)), results
    finally:
        vp.close()


DRIVER = textwrap.dedent(
    """
    import signal, sys, time
    from rlhf.rewards.verify_process import VerifyProcess
    vp = VerifyProcess()
    after = []
    signal.signal(signal.SIGINT, lambda *a: after.append(vp.check("7", "7", 60)))
    vp.check("1", "1", 60)
    print(vp._proc.pid, flush=True)
    deadline = time.monotonic() + 60
    while not after and time.monotonic() < deadline:
        time.sleep(0.05)
    print("after-signal", after, flush=True)
    if sys.argv[1] == "kill":
        import os
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_the_child_survives_a_group_signal_and_not_its_driver(end):
    """Ctrl-C reaches the whole process group: the driver handles it (here: one more check) and
    the child must still answer; once the driver is gone, by exit or SIGKILL, so is the child."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, end],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        child = int(driver.stdout.readline())
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.stdout.readline().strip() == "after-signal [1.0]"
        driver.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"the math-verify child {child} outlived its driver ({end})"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
