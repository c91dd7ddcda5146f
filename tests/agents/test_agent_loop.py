"""The agent loop on a real vLLM engine (CPU build): trajectories with tool latencies of very
different lengths advance on their own, the engine batches their turns together (continuous
batching), and the samples are the same tokens as the lockstep loop gives (seeds depend on
trajectory and turn, not on the order turns finish)."""

from __future__ import annotations

import random
import time

import pytest

from rlhf.agents.loop import AgentLoop
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
