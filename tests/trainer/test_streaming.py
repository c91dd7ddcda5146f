"""The streaming scheduler (``rlhf.trainer.streaming``) on its own: admission bounded by
staleness, groups taken as they finish, stale groups dropped, checkpoints, failures.

``run_group`` here is a plain function that returns a group after a delay the test chooses,
with the weight version it was admitted under: the real generation runs in
tests/trainer/test_streaming_e2e.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlhf.data.prompts import Prompt
from rlhf.data.types import Sample
from rlhf.trainer.experience import RolloutStats
from rlhf.trainer.streaming import (
    FinishedGroup,
    GroupTicket,
    StreamingRollouts,
    StreamState,
    staleness_metrics,
)

B = 4


class Groups:
    """A ``run_group`` whose groups take ``delay(index)`` seconds; it records what was admitted."""

    def __init__(self, delay=lambda i: 0.0, fail_at: int | None = None, discard=lambda i: None):
        self.delay, self.fail_at, self.discard = delay, fail_at, discard
        self.admitted: list[tuple[int, int]] = []  # (group index, version at admission)
        self.done: set[int] = set()  # groups whose generation returned
        self.lock = threading.Lock()

    def __call__(self, t: GroupTicket) -> FinishedGroup:
        with self.lock:
            self.admitted.append((t.index, t.version))
        time.sleep(self.delay(t.index))
        self.done.add(t.index)
        if t.index == self.fail_at:
            raise ValueError("the reward broke")
        s = Sample(
            torch.tensor([1, 2, 3]),
            torch.tensor([False, True, True]),
            group_id=t.index,
            weight_version=t.version,
        )
        s.token_versions = torch.tensor([t.version] * 3)
        return FinishedGroup(t, [s], RolloutStats(num_samples=1), discarded=self.discard(t.index))


class Loader:
    def __init__(self):
        self.pulled = 0

    def __call__(self) -> list[Prompt]:
        self.pulled += 1
        return [Prompt(token_ids=[1, 2], text=f"p{self.pulled}-{i}") for i in range(B)]


def _wait_for(stream: StreamingRollouts, indices: set[int], timeout_s: float = 30.0) -> None:
    """Until the groups ``indices`` are finished in ``stream`` (a busy machine is slow)."""
    deadline = time.monotonic() + timeout_s
    while not indices <= set(stream.finished_groups()):
        assert time.monotonic() < deadline, f"groups {sorted(indices)} did not finish"
        time.sleep(0.01)


def _stream(groups, max_staleness, num_steps=4, start_step=0, **kw) -> StreamingRollouts:
    return StreamingRollouts(
        groups,
        kw.pop("loader", Loader()),
        B,
        max_staleness,
        kw.pop("max_in_flight", 0),
        2,
        start_step,
        num_steps,
        timeout_s=kw.pop("timeout_s", 30.0),
        **kw,
    ).start()


def _train(stream: StreamingRollouts, steps: range, step_s: float = 0.0) -> list[list[int]]:
    """The trainer's loop: take, 'train', sync the next version; returns each batch's group ids."""
    batches = []
    for step in steps:
        batch, _ = stream.get(step)
        batches.append([s.group_id for s in batch.samples])
        time.sleep(step_s)
        stream.sync(lambda: None, step + 1)
    return batches


def test_staleness_zero_admits_each_step_after_its_sync_in_batch_order():
    groups = Groups(delay=lambda i: 0.01 * (B - i % B))  # the last of each batch finishes first
    stream = _stream(groups, max_staleness=0)
    try:
        batches = _train(stream, range(4))
    finally:
        stream.close()
    assert batches == [list(range(s * B, (s + 1) * B)) for s in range(4)]
    assert all(v == i // B for i, v in groups.admitted)  # group i admitted under version i // B


def test_admission_never_runs_more_than_max_staleness_versions_ahead():
    groups = Groups(delay=lambda i: 0.005)
    stream = _stream(groups, max_staleness=1, num_steps=6)
    try:
        _train(stream, range(6), step_s=0.05)  # training is the slow phase: admission fills up
    finally:
        stream.close()
    # at version v at most (v + 2) * B groups were admitted, so no group waits beyond one version
    for n, (_, v) in enumerate(groups.admitted):
        assert n < (v + 2) * B
    assert max(i for i, _ in groups.admitted) == 6 * B - 1  # nothing past the run's last step


def test_a_slow_group_holds_back_only_the_last_step_that_may_train_it():
    groups = Groups(delay=lambda i: 1.5 if i == 0 else 0.01)
    stream = _stream(groups, max_staleness=2, num_steps=4)
    try:
        taken = []
        for step in range(3):
            batch, waited = stream.get(step)
            taken.append(([s.group_id for s in batch.samples], waited))
            stream.sync(lambda: None, step + 1)
    finally:
        stream.close()
    # steps 0 and 1 go on without group 0 (admitted under version 0); step 2 is its last chance
    assert 0 not in taken[0][0] and 0 not in taken[1][0] and taken[0][1] < 1.0
    assert taken[2][0][0] == 0
    assert batch.metrics["async/dropped_stale"] == 0


def test_a_group_too_stale_to_train_is_dropped_and_counted():
    old = Groups()(GroupTicket(3, Prompt(token_ids=[1], text="p"), 0, version=0, engine=0))
    state = StreamState([old], [], batches_pulled=3)  # a checkpoint taken long ago
    stream = _stream(Groups(), max_staleness=1, num_steps=5, start_step=3, pending=[state])
    try:
        batch, _ = stream.get(3)
    finally:
        stream.close()
    assert 3 not in [s.group_id for s in batch.samples]
    assert batch.metrics["async/dropped_stale"] == 1.0


def test_the_checkpoint_keeps_finished_groups_and_regenerates_those_in_flight():
    groups = Groups(delay=lambda i: 5.0 if i in (5, 6) else 0.0)
    loader = Loader()
    stream = _stream(groups, max_staleness=1, num_steps=3, loader=loader)
    try:
        _wait_for(stream, {0, 1, 2, 3, 4, 7})  # 5 and 6 take 5 s
        _train(stream, range(1))
        _wait_for(stream, {8, 9, 10, 11})  # admitted under version 1
        (state,) = stream.drain()
        stream.resume()
    finally:
        stream.close()
    assert sorted(g.ticket.index for g in state.finished) == [4, 7, 8, 9, 10, 11]
    assert [t.index for t in state.waiting] == [5, 6]  # in flight: their prompts, to generate again
    assert state.batches_pulled == 3 and loader.pulled == 3

    again = Groups()
    resumed = _stream(again, max_staleness=1, num_steps=3, start_step=1, loader=Loader(), pending=[state])
    try:
        batches = _train(resumed, range(1, 3))
    finally:
        resumed.close()
    assert [i for i, _ in again.admitted] == [5, 6]  # generated again, nothing new is needed
    assert batches == [[4, 7, 8, 9], [5, 6, 10, 11]]


def test_a_failing_group_fails_the_step_with_its_cause():
    stream = _stream(Groups(fail_at=2), max_staleness=0)
    try:
        with pytest.raises(RuntimeError, match="group 2 failed: the reward broke"):
            stream.get(0)
    finally:
        stream.close()


def test_a_missing_batch_times_out_with_a_message():
    stream = _stream(Groups(delay=lambda i: 3.0), max_staleness=0, timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError, match="0 of 4 groups finished, 4 in flight"):
            stream.get(0)
    finally:
        stream.close()


def test_dynamic_sampling_discards_and_stops_at_its_round_cap():
    groups = Groups(discard=lambda i: None if i == 0 else "uninformative")
    stream = _stream(groups, max_staleness=0, dynamic_sampling_rounds=2)
    try:
        batch, _ = stream.get(0)
    finally:
        stream.close()
    # 2 rounds' worth of candidates (8 groups) examined, one informative: the step trains on it
    assert [s.group_id for s in batch.samples] == [0]
    assert batch.metrics["async/discarded_uninformative"] >= 7.0
    assert batch.metrics["dynamic_sampling/shortfall"] == 3.0


def test_staleness_metrics_count_tokens_by_the_version_that_sampled_them():
    s = Sample(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([False, False, True, True, True]))
    s.token_versions = torch.tensor([2, 2, 2, 3, 4])
    old = Sample(torch.tensor([1, 2]), torch.tensor([False, True]), weight_version=1)
    m = staleness_metrics([s, old], step=4)
    lags = [2.0, 1.0, 0.0, 3.0]
    assert m["async/staleness_mean"] == pytest.approx(sum(lags) / 4)
    assert m["async/staleness_max"] == 3.0
    assert m["async/stale_token_fraction"] == pytest.approx(3 / 4)
