"""The agent loop on a real vLLM engine (CPU build): trajectories with tool latencies of very
different lengths advance on their own, the engine batches their turns together (continuous
batching), and the samples are the same tokens as the lockstep loop gives (seeds depend on
trajectory and turn, not on the order turns finish)."""

from __future__ import annotations

import random
import sys
import time

import pytest

from rlhf.agents.loop import AgentLoop
from rlhf.algorithms.shaping import longest_turn
from rlhf.data.prompts import Prompt
from rlhf.envs.base import StepResult, ToolStats
from rlhf.workers.rollout import default_engine_env

pytestmark = pytest.mark.e2e


class SlowTool:
    """Answers each turn after a latency drawn per trajectory: most fast, some slow."""

    def reset(self, prompt: str, info: dict) -> None:
        self.delay = 0.4 if random.Random(info["index"]).random() < 0.25 else 0.01
        self.turn = 0

    def step(self, response: str) -> StepResult:
        time.sleep(self.delay)
        self.turn += 1
        return StepResult(
            observation=" result 3", done=self.turn >= 3, tools=ToolStats(calls=1, time_s=self.delay)
        )


@pytest.fixture(scope="module")
def pool(ray_session, tiny_llama_dir):
    from rlhf.workers.rollout_pool import RolloutPool

    p = RolloutPool(
        1,
        {"model_path": str(tiny_llama_dir), "max_model_len": 256, "dtype": "float32"},
        num_cpus_per_engine=1,
        env_vars={**default_engine_env(0), "HF_HUB_OFFLINE": "1"},
    )
    yield p
    p.shutdown()


def _loop(pool, tok, lockstep: bool) -> AgentLoop:
    return AgentLoop(
        pool, tok, SlowTool, {"temperature": 1.0, "max_tokens": 6}, seed=7, max_turns=4, max_model_len=256,
        max_observation_tokens=8, step_timeout_s=30, max_concurrency=16, lockstep=lockstep,
    )  # fmt: skip


def test_per_trajectory_equals_lockstep_and_overlaps_requests(pool, tok):
    prompts = [Prompt(f"count {i}", tok(f"count {i}")["input_ids"], {"index": i}) for i in range(8)]
    per, stats = _loop(pool, tok, lockstep=False).run(prompts, 2, batch=3, group_base=0)
    before = pool.stats()[0]["max_in_flight"]
    lock, lstats = _loop(pool, tok, lockstep=True).run(prompts, 2, batch=3, group_base=0)
    assert [s.input_ids.tolist() for s in per] == [s.input_ids.tolist() for s in lock]
    assert [s.action_mask.tolist() for s in per] == [s.action_mask.tolist() for s in lock]
    assert all(s.turns == 3 for s in per) and stats.turns == 16 * 3 and stats.tools.calls == 16 * 3
    assert before >= 2  # turns of different trajectories were in one engine batch
    m = stats.metrics("agent")
    assert m["agent/turns_mean"] == 3.0 and 0 < m["agent/engine_busy_fraction"] <= 1.0
    print(f"\nper-trajectory {stats.wall_s:.2f} s, lockstep {lstats.wall_s:.2f} s, max in flight {before}")


class FaultyEnv:
    """Trajectory 1 hangs past env.step_timeout_s, trajectory 2 raises, the others answer."""

    def reset(self, prompt: str, info: dict) -> None:
        self.index, self.turn = info["index"], 0

    def step(self, response: str) -> StepResult:
        self.turn += 1
        if self.index == 1:
            time.sleep(10)
        if self.index == 2:
            raise RuntimeError("tool crashed")
        return StepResult(observation=" ok", done=self.turn >= 2)


@pytest.mark.parametrize("lockstep", [False, True], ids=["per_trajectory", "lockstep"])
def test_a_hanging_or_raising_env_ends_only_its_trajectory(pool, tok, lockstep):
    loop = AgentLoop(
        pool, tok, FaultyEnv, {"temperature": 1.0, "max_tokens": 4}, seed=7, max_turns=4, max_model_len=256,
        max_observation_tokens=8, step_timeout_s=1.0, max_concurrency=8, lockstep=lockstep,
    )  # fmt: skip
    prompts = [Prompt(f"count {i}", tok(f"count {i}")["input_ids"], {"index": i}) for i in range(4)]
    t0 = time.perf_counter()
    samples, stats = loop.run(prompts, 1, batch=0, group_base=0)
    wall = time.perf_counter() - t0
    loop.close()
    assert stats.env_timeouts == 1 and stats.env_errors == 1
    assert [s.turns for s in samples] == [2, 1, 1, 2]  # the faulty ones end after their first turn
    assert wall < 8, wall  # the hung step is given up at its deadline, not waited for (10 s)


def test_a_run_can_override_the_sampling_as_evaluation_does(pool, tok):
    """The evaluator passes its own sampling (greedy, its token limit) to ``run``."""
    prompts = [Prompt(f"count {i}", tok(f"count {i}")["input_ids"], {"index": i}) for i in range(4)]
    loop = _loop(pool, tok, lockstep=False)
    samples, _ = loop.run(prompts, 1, batch=-1, group_base=0, sampling={"max_tokens": 2, "temperature": 0.0})
    again, _ = loop.run(prompts, 1, batch=-1, group_base=0, sampling={"max_tokens": 2, "temperature": 0.0})
    for s in samples:  # every policy turn (a run of action tokens) is at most 2 tokens
        assert s.turns == 3 and longest_turn(s.action_mask) <= 2
    assert [s.input_ids.tolist() for s in samples] == [s.input_ids.tolist() for s in again]  # greedy
    sampled, _ = loop.run(prompts, 1, batch=-1, group_base=0)
    assert max(s.num_actions for s in sampled) > 6  # the loop's own limit (6 a turn) is back


def test_agent_loop_bench_runs_both_workloads_in_both_modes(pool, tok):
    """bench/agent_loop.py's measurement on this module's engine, tiny sizes: both modes do the
    same work (same tokens) and report a rate and an idle fraction."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("bench_agent_loop", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    args = bench._parse(
        [
            "--trajectories",
            "6,3",
            "--slow-frac",
            "0.3",
            "--repeats",
            "1",
            "--slow-ms",
            "150",
            "--equal-ms",
            "20",
        ]
    )
    table = bench.measure(pool, tok, args)
    assert set(table) == {"skewed n=6 slow=0.3", "skewed n=3 slow=0.3", "equal n=6"}
    for row in table.values():
        assert row["same_tokens"] == 1.0
        assert row["lockstep"] > 0 and row["per_trajectory"] > 0 and 0 <= row["per_trajectory_idle"] <= 1
        assert row["ideal_speedup"] > 0
    # critical paths by hand: 2 tokens a turn at 10 ms a step; trajectory 0 has one 300 ms call,
    # trajectory 1 two 10 ms calls. Lockstep: round 0 waits 300 ms, round 1 10 ms, round 2 (the
    # last answer) none, plus 3 rounds x 20 ms. Per trajectory: 0.3 + 2 turns x 20 ms.
    work = bench.Workload("hand", (1, 2), ((0.3,), (0.01, 0.01)))
    lock_s, per_s = work.critical_paths(0.01, 2)
    assert lock_s == pytest.approx(0.37) and per_s == pytest.approx(0.34)


def _readme_examples() -> dict:
    """The docs' custom tool and custom environment (docs/agents.md), executed as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    scope: dict = {}
    for block in text.split("```python\n")[1:]:
        exec(block.split("```", 1)[0], scope)  # noqa: S102 - the docs' own code
    return scope


def test_the_documented_tool_and_environment_run_in_the_loop(pool, tok):
    from rlhf.agents.bounded import BoundedCalls
    from rlhf.agents.parser import ToolCall
    from rlhf.agents.tool_env import ToolRunner

    scope = _readme_examples()
    runner = ToolRunner({"weather": scope["weather"]}, 5.0, 100, BoundedCalls(1, "tool"))
    assert runner.call(ToolCall("weather", {"city": "Paris"}))[0] == "18 C"
    assert runner.call(ToolCall("weather", {"town": "Paris"}))[0].startswith("error:")
    prompts = [Prompt("guess", tok("count 1")["input_ids"], {"index": 0, "answer": "7"})]
    loop = AgentLoop(
        pool, tok, scope["Guess"], {"temperature": 1.0, "max_tokens": 4}, seed=7, max_turns=5,
        max_model_len=256, max_observation_tokens=8, step_timeout_s=30, max_concurrency=4,
    )  # fmt: skip
    (s,), stats = loop.run(prompts, 1, batch=0, group_base=0)
    assert s.turns == 3 and s.env_reward == 0.0  # a random model does not guess "7" in 3 tries


class ToolOnEvenPrompts:
    """Even-numbered prompts get one tool turn (role tool messages), odd ones end at once."""

    def reset(self, prompt: str, info: dict) -> None:
        self.even, self.turn = info["index"] % 2 == 0, 0

    def step(self, response: str) -> StepResult:
        self.turn += 1
        if not self.even or self.turn > 1:
            return StepResult(done=True, reward=1.0)
        return StepResult(done=False, messages=[{"role": "tool", "content": "3"}])


@pytest.mark.parametrize("mode", ["error", "drop"])
def test_template_drift_fails_the_step_or_drops_its_groups(pool, tiny_llama_dir, mode):
    """A template that renders earlier assistant turns differently (here: their first character
    cut) drifts on the trajectories with a tool turn only. ``error`` names it after every
    trajectory ended; ``drop`` leaves out their groups and counts them; evaluation keeps them."""
    from transformers import AutoTokenizer

    from rlhf.agents.chat_delta import TemplateDriftError

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = tok.chat_template.replace(
        "m['content']", "(m['content'][1:] if m['role'] == 'assistant' and not loop.last else m['content'])"
    )
    assert "[1:]" in tok.chat_template, "the tiny tokenizer's template changed: adapt the test"
    chats = [[{"role": "user", "content": f"count {i}"}] for i in range(4)]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [
        Prompt(t, tok(t, add_special_tokens=False)["input_ids"], {"index": i}, messages=c)
        for i, (t, c) in enumerate(zip(texts, chats, strict=True))
    ]
    loop = AgentLoop(
        pool, tok, ToolOnEvenPrompts, {"temperature": 1.0, "max_tokens": 4}, seed=7, max_turns=3, max_model_len=256,
        max_observation_tokens=8, step_timeout_s=30, max_concurrency=4, on_template_drift=mode,
    )  # fmt: skip
    if mode == "error":
        with pytest.raises(
            TemplateDriftError, match="4 of 8 trajectories are not what the chat template renders"
        ):
            loop.run(prompts, 2, batch=0, group_base=0)
        return
    samples, stats = loop.run(prompts, 2, batch=0, group_base=0)
    assert stats.template_drift == 4 and stats.metrics()["agent/template_drift"] == 4.0
    assert sorted({s.group_id for s in samples}) == [1, 3] and len(samples) == 4
    evaluated, _ = loop.run(prompts, 2, batch=-1, group_base=0, sampling={"temperature": 0.0})
    assert len(evaluated) == 8
