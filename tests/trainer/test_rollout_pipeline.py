"""The rollout pipeline's pacing, ordering, hand-over and checkpoint drain (no Ray needed:
``collect`` is a plain function that records the weight version it ran under)."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf.trainer.rollout_pipeline import RolloutPipeline


class Recorder:
    def __init__(self, gen_s: float = 0.0, fail_at: int | None = None):
        self.gen_s, self.fail_at = gen_s, fail_at
        self.pipeline: RolloutPipeline | None = None
        self.generated: list[tuple[int, int]] = []  # (step, engine version at generation)
        self.busy = threading.Event()

    def __call__(self, step: int):
        if step == self.fail_at:
            raise ValueError("reward service down")
        self.busy.set()
        time.sleep(self.gen_s)
        self.generated.append((step, self.pipeline.version))
        self.busy.clear()
        return [f"sample-{step}"], None, {"m": float(step)}


def _run(k: int, num_steps: int = 5, train_s: float = 0.01, gen_s: float = 0.01, threaded=None, idle=None):
    rec = Recorder(gen_s)
    p = RolloutPipeline(rec, k, 0, num_steps, timeout_s=10, threaded=threaded)
    rec.pipeline = p
    p.start()
    trained = []
    try:
        for step in range(num_steps):
            batch, _ = p.get(step)
            trained.append((batch.step, batch.weight_version, batch.samples))
            time.sleep(train_s)
            # a sync never lands while a generation is running
            p.sync(lambda: trained.append(("sync", rec.busy.is_set())), step + 1)
            if idle is not None:
                idle.append(p.take_engine_idle())
    finally:
        p.close()
    return rec, trained


@pytest.mark.parametrize("k", [0, 1, 2])
def test_generation_never_runs_more_than_k_versions_ahead(k):
    rec, trained = _run(k, threaded=True)
    assert [s for s, _ in rec.generated] == list(range(5))
    assert all(step - version <= k for step, version in rec.generated)
    batches = [t for t in trained if t[0] != "sync"]
    assert [b[0] for b in batches] == list(range(5)) and [b[2] for b in batches] == [
        [f"sample-{i}"] for i in range(5)
    ]
    assert all(not busy for tag, busy in (t for t in trained if t[0] == "sync"))
    if k == 0:
        assert rec.generated == [(i, i) for i in range(5)]  # the synchronous schedule


def test_one_step_off_overlaps_generation_with_training():
    # Generation and training take 0.1 s each: one-step-off takes about half the time.
    t0 = time.perf_counter()
    sync_idle, async_idle = [], []
    rec, _ = _run(0, num_steps=6, train_s=0.1, gen_s=0.1, threaded=True, idle=sync_idle)
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rec, _ = _run(1, num_steps=6, train_s=0.1, gen_s=0.1, idle=async_idle)
    async_s = time.perf_counter() - t0
    assert [v for _, v in rec.generated] == [0, 0, 1, 2, 3, 4]  # batch s+1 made by version s
    assert async_s < 0.8 * sync_s
    # synchronous: the engines wait through every training phase (0.1 s); one step off: hardly
    assert sum(sync_idle) > 0.4 and sum(async_idle) < 0.5 * sum(sync_idle)


def test_inline_and_threaded_schedules_are_the_same():
    rec_inline, _ = _run(0, threaded=False)
    rec_thread, _ = _run(0, threaded=True)
    assert rec_inline.generated == rec_thread.generated


def test_producer_failure_reaches_the_trainer_with_the_step():
    rec = Recorder(fail_at=2)
    p = RolloutPipeline(rec, 1, 0, 5, timeout_s=10)
    rec.pipeline = p
    p.start()
    try:
        p.get(0)
        p.sync(lambda: None, 1)
        p.get(1)
        p.sync(lambda: None, 2)
        with pytest.raises(RuntimeError, match="batch of step 3 failed: reward service down"):
            p.get(2)
    finally:
        p.close()


def test_a_stuck_producer_times_out_with_a_message():
    def stuck(step):
        time.sleep(2)
        return [], None, {}

    p = RolloutPipeline(stuck, 1, 0, 3, timeout_s=0.3).start()
    try:
        with pytest.raises(TimeoutError, match="no rollout batch for step 1 after 0 s"):
            p.get(0)
    finally:
        p._stop = True


def test_drain_returns_the_batches_ahead_and_a_restored_pipeline_serves_them_first():
    rec = Recorder()
    p = RolloutPipeline(rec, 2, 0, 6, timeout_s=10)
    rec.pipeline = p
    p.start()
    p.get(0)
    deadline = time.time() + 5
    while len(rec.generated) < 3 and time.time() < deadline:  # steps 1 and 2 run ahead
        time.sleep(0.01)
    pending = p.drain()
    assert [b.step for b in pending] == [1, 2] and [b.weight_version for b in pending] == [0, 0]
    p.resume()
    p.close()
    # Resume at step 1 with the pending batches: they are served as they were, then step 3 on.
    rec2 = Recorder()
    q = RolloutPipeline(rec2, 2, 1, 6, timeout_s=10, pending=pending)
    rec2.pipeline = q
    q.start()
    try:
        b1, _ = q.get(1)
        assert (b1.step, b1.weight_version, b1.samples) == (1, 0, ["sample-1"])
        q.sync(lambda: None, 2)
        b2, _ = q.get(2)
        assert b2.weight_version == 0
        q.sync(lambda: None, 3)
        q.get(3)
    finally:
        q.close()
    assert rec2.generated[0][0] == 3
