"""Runs that survive: SIGTERM -> checkpoint -> exit -> resume, a killed rank -> automatic
recovery, and both reproduce the uninterrupted run's every metric exactly (CPU).

Real Ray, vLLM and DeepSpeed; faults come from tests/faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.config import compose

pytestmark = pytest.mark.e2e

FAULTS = Path(__file__).with_name("faults.py")
STEPS = 6
CALLS_PER_STEP = 4 * 2  # rollout_batch_size x n_samples_per_prompt reward calls
AGENT_TIMINGS = ("agent/tool_time_s", "agent/engine_busy_fraction")  # wall-clock measures


def _overrides(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        "experiment=toy_count",
        "algorithm=grpo",  # actor + reference groups
        f"model.path={model_dir}",
        f"train.output_dir={out}",
        f"train.num_steps={STEPS}",
        "train.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=8",
        "data.num_toy_prompts=32",
        "train.tensorboard=false",
        "train.save_every_min=0",
        "train.stop_grace_s=120",  # a slow CI machine must not hit the watchdog
        *extra,
    ]


def _numbers(rows: list[dict]) -> list[dict]:
    # Timings differ from run to run; so do the counters of what went wrong. A fault-injecting
    # reward (tests/faults.py, count_reward_then_*) scores as count_reward does, and its
    # reward/<fn> metric carries its own name: compared under count_reward's.
    skip = ("time/", "perf/", "run/recoveries", "rollout/engine_restarts", *AGENT_TIMINGS)
    return [
        {
            re.sub(r"^reward/count_reward_then_\w+$", "reward/count_reward", k): v
            for k, v in r.items()
            if not k.startswith(skip)
        }
        for r in rows
    ]


def _streamed(rows: list[dict], like: list[dict]) -> list[dict]:
    """``_numbers`` of a ``train.mode=streaming`` run, on the keys of a batch-mode run ``like``
    (the stream's own async/* counters depend on timing)."""
    return [
        {k: v for k, v in r.items() if k in ref}
        for r, ref in zip(_numbers(rows), _numbers(like), strict=True)
    ]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_llama_dir):
    """The uninterrupted run's metric rows."""
    from rlhf.ppo import run

    out = tmp_path_factory.mktemp("straight")
    history = run(compose("ppo", _overrides(out, tiny_llama_dir)))
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    return history


def _local_ray_supervisors() -> set[int]:
    """Pids of the supervisors that keep a driver's local Ray head (rlhf.workers.local_ray)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "rlhf.workers.local_ray" in line}


def _stop_with_sigterm_and_resume(out: Path, overrides: list[str], tmp_path: Path, how: str) -> None:
    """The real CLI stopped the way a terminal, ``timeout`` or a container runtime stops it: SIGTERM
    to its whole process group after step 2 (``how="group"``: ``kill -TERM -- -PGID``;
    ``how="timeout"``: the command runs under ``timeout -s TERM``, which passes a SIGTERM it gets
    on to the group). Then the checkpoint, the exit code within the grace, no Ray left behind,
    and the same command again, which resumes and runs to the end."""
    cmd = [sys.executable, "-m", "rlhf.ppo", *overrides, f"hydra.run.dir={tmp_path / 'h'}"]
    before = _local_ray_supervisors()
    if how == "timeout":
        proc = subprocess.Popen(
            ["timeout", "-s", "TERM", "3600", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    else:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    deadline = time.monotonic() + 600
    while not (out / "metrics.jsonl").is_file() or len(_rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
        time.sleep(0.2)
    t_signal = time.monotonic()
    if how == "timeout":
        proc.send_signal(signal.SIGTERM)  # timeout signals its command's process group
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    stopped_after = time.monotonic() - t_signal
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "received SIGTERM" in log and "run the same command again" in log, log[-3000:]
    assert "Failed to connect to GCS" not in log, log[-3000:]
    assert stopped_after < 120, f"took {stopped_after:.0f} s to stop (train.stop_grace_s=120)"
    assert _local_ray_supervisors() <= before, "the run's local Ray outlived it"
    done = len(_rows(out))
    assert 2 <= done < STEPS
    assert (out / "checkpoints" / "latest").read_text() == f"step_{done}"
    # The same command again continues (train.resume=auto) and ends where the straight run did.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / f'step_{done}'}" in proc.stdout + proc.stderr


def test_sigterm_to_the_process_group_checkpoints_exits_and_the_resumed_run_is_exact(
    straight, tmp_path, tiny_llama_dir
):
    out = tmp_path / "run"
    _stop_with_sigterm_and_resume(out, _overrides(out, tiny_llama_dir), tmp_path, how="group")
    assert _numbers(_rows(out)) == _numbers(straight)


def test_a_multi_turn_run_streamed_through_the_agent_loop_resumes_exactly(tmp_path, tiny_llama_dir):
    """Per-trajectory rollouts (two turns each, an environment between them) streamed group by
    group (train.mode=streaming, max_staleness=0), stopped by SIGTERM with groups in flight and
    resumed, sample the uninterrupted batch-mode run's tokens: seeds depend on (seed, batch,
    trajectory, turn), not on the mode or on which turn the engine happened to finish first."""
    from rlhf.ppo import run

    env = ("env.name=rlhf.envs.toy:EchoToolEnv", "env.max_turns=2")
    straight = run(compose("ppo", _overrides(tmp_path / "straight", tiny_llama_dir, *env)))
    assert all(h["agent/turns_mean"] == 2.0 for h in straight)  # the loop ran both turns
    out = tmp_path / "run"
    streaming = _overrides(out, tiny_llama_dir, *env, "train.mode=streaming")
    _stop_with_sigterm_and_resume(out, streaming, tmp_path, how="timeout")
    rows = _rows(out)
    assert all("async/groups_in_flight" in r for r in rows)
    assert _streamed(rows, straight) == _numbers(straight)


def test_sigterm_before_training_sets_the_batch_aside(straight, tmp_path, tiny_llama_dir, monkeypatch):
    """The signal lands while the step's batch is being rewarded: nothing is trained, the
    batch goes into the checkpoint, and the resumed run uses it (still exact)."""
    from rlhf.ppo import run
    from rlhf.trainer.run_control import Preempted

    monkeypatch.setenv("RLHF_FAULT_MARKER", str(tmp_path / "fired"))
    monkeypatch.setenv("RLHF_FAULT_AT_CALL", str(CALLS_PER_STEP * 3 + 1))  # step 4's first reward
    out = tmp_path / "run"
    cfg = compose(
        "ppo", _overrides(out, tiny_llama_dir, f"reward.function={FAULTS}:count_reward_then_sigterm")
    )
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 3") as e:
        run(cfg)
    assert e.value.checkpoint == str(out / "checkpoints" / "step_3")
    assert (out / "checkpoints" / "step_3" / "pending_rollouts.pt").is_file()
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    history = run(compose("ppo", _overrides(out, tiny_llama_dir)))
    assert _numbers(history) == _numbers(straight) == _numbers(_rows(out))


def _rank_killed_in_step(step: int, tmp_path, model_dir, monkeypatch, *extra: str):
    """A run config whose reward function kills a DeepSpeed rank at the first reward of ``step``."""
    monkeypatch.setenv("RLHF_FAULT_MARKER", str(tmp_path / "fired"))
    monkeypatch.setenv("RLHF_FAULT_AT_CALL", str(CALLS_PER_STEP * (step - 1) + 1))
    fault = f"reward.function={FAULTS}:count_reward_then_kill_a_rank"
    return compose("ppo", _overrides(tmp_path / "run", model_dir, fault, *extra))


def test_killed_rank_is_recovered_from_the_last_checkpoint_mid_stream(
    straight, tmp_path, tiny_llama_dir, monkeypatch
):
    """A streaming run (the batch mode's recovery: the LoRA test below) loses a rank while step
    4's groups are being scored; new workers resume from the step-2 checkpoint, whose stream
    state holds step 3's groups, and the run equals the uninterrupted batch-mode one."""
    from rlhf.ppo import run

    cfg = _rank_killed_in_step(
        4,
        tmp_path,
        tiny_llama_dir,
        monkeypatch,
        "train.save_every=2",
        "train.max_recoveries=1",
        "train.mode=streaming",
    )
    history = run(cfg)
    assert (tmp_path / "fired").is_file(), "the fault never fired: the test would prove nothing"
    # Steps 3-6 were done again from the step-2 checkpoint by new workers.
    assert [h["run/recoveries"] for h in history] == [0, 0, 1, 1, 1, 1]
    assert _streamed(history, straight) == _numbers(straight)


def test_recovery_gives_up_after_max_recoveries_naming_the_checkpoint(tmp_path, tiny_llama_dir, monkeypatch):
    from rlhf.ppo import run
    from rlhf.workers.errors import WorkerDied

    cfg = _rank_killed_in_step(
        2, tmp_path, tiny_llama_dir, monkeypatch, "train.save_every=1", "train.max_recoveries=0"
    )
    with pytest.raises(WorkerDied, match=r"max_recoveries=0 recoveries are used up") as e:
        run(cfg)
    assert str(tmp_path / "run" / "checkpoints" / "step_1") in str(e.value)
    assert "run the same command again" in str(e.value)


def test_a_run_that_can_never_fit_fails_at_once(tmp_path, tiny_llama_dir):
    """Asking more CPUs than the local Ray has is an error naming the numbers, not a hang."""
    import ray

    from rlhf.trainer.setup import build_workers, init_ray

    cfg = compose(
        "ppo", _overrides(tmp_path, tiny_llama_dir, "rollout.num_engines=2", "cluster.cpus_per_engine=4")
    )
    init_ray(cfg.cluster)
    have = ray.cluster_resources()["CPU"]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"needs CPU=10 .*engines 2x4.* has CPU={have:g} in total"):
        build_workers(cfg, str(tiny_llama_dir))
    assert time.monotonic() - t0 < 10


def test_an_engine_that_cannot_be_scheduled_times_out_naming_the_resource(ray_session, tiny_llama_dir):
    from rlhf.workers.rollout import RolloutEngineError
    from rlhf.workers.rollout_pool import RolloutPool

    t0 = time.monotonic()
    with pytest.raises(
        RolloutEngineError, match=r"waited 2 s for rollout engine 0 to start: each engine asks 99 CPU"
    ):
        RolloutPool(
            1,
            {"model_path": str(tiny_llama_dir), "max_model_len": 64},
            num_cpus_per_engine=99,
            startup_timeout_s=2,
        )
    assert time.monotonic() - t0 < 30


def test_a_rank_that_cannot_be_scheduled_fails_or_times_out_naming_the_resource(ray_session, tiny_llama_dir):
    from rlhf.workers.group import ModelGroup
    from rlhf.workers.placement import Placement

    ray = ray_session
    # More than the node has: Ray says so at once.
    with pytest.raises(RuntimeError, match=r"start failed on rank 0 of 1: ActorUnschedulableError"):
        ModelGroup("actor", str(tiny_llama_dir), 1, placement=Placement(num_cpus=999), startup_timeout_s=60)

    # Possible, but the CPUs are taken: a bounded wait, then a message with what is free.
    @ray.remote(num_cpus=1)
    class Holder:
        def ready(self):
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    total = ray.cluster_resources()["CPU"]
    try:
        with pytest.raises(
            RuntimeError,
            match=rf"ranks \[0\] of ModelGroup\(actor\) are not running after 2 s: each asks {total:g} CPU",
        ):
            ModelGroup(
                "actor", str(tiny_llama_dir), 1, placement=Placement(num_cpus=total), startup_timeout_s=2
            )
    finally:
        ray.kill(holder)


def test_lora_run_resumes_after_sigterm_and_recovers_a_killed_rank_exactly(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """model.lora (adapter sync, reference = adapters off): the checkpoint holds the adapter and
    its optimizer state only, and both a SIGTERM + resume and a rank killed mid-run reproduce
    the uninterrupted LoRA run's metrics exactly."""
    from rlhf.ppo import run
    from rlhf.trainer.run_control import Preempted

    lora = "model.lora.rank=8"
    straight = run(compose("ppo", _overrides(tmp_path / "straight", tiny_llama_dir, lora)))
    assert [h["step"] for h in straight] == list(range(1, STEPS + 1))

    monkeypatch.setenv("RLHF_FAULT_MARKER", str(tmp_path / "fired-term"))
    monkeypatch.setenv("RLHF_FAULT_AT_CALL", str(CALLS_PER_STEP * 3 + 1))
    out = tmp_path / "term"
    sigterm = f"reward.function={FAULTS}:count_reward_then_sigterm"
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 3"):
        run(compose("ppo", _overrides(out, tiny_llama_dir, lora, sigterm)))
    assert run(compose("ppo", _overrides(out, tiny_llama_dir, lora))) and _numbers(_rows(out)) == _numbers(
        straight
    )

    cfg = _rank_killed_in_step(
        4, tmp_path, tiny_llama_dir, monkeypatch, lora, "train.save_every=2", "train.max_recoveries=1"
    )
    history = run(cfg)
    assert (tmp_path / "fired").is_file(), "the fault never fired: the test would prove nothing"
    assert [h["run/recoveries"] for h in history] == [0, 0, 1, 1, 1, 1]
    assert _numbers(history) == _numbers(straight)
