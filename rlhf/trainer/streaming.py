"""Streaming rollouts (``train.mode=streaming``): no step waits for its slowest sample.

Prompt groups (one prompt, ``rollout.n_samples_per_prompt`` samples) are admitted one at a
time, each on a thread of its own (``GroupRollout`` generates and scores it), up to
``rollout.max_in_flight`` at once. A finished group goes to a buffer and another is admitted;
the trainer takes the next ``train.rollout_batch_size`` finished groups (lowest group index
first) as soon as they are there. The engines never wait for a batch boundary.

Versions and staleness. Version ``v`` is the policy after ``v`` optimizer steps (the engines'
weights after the sync that ends step ``v - 1``). A group admitted while the engines hold
``v`` is meant for a step ``<= v + train.max_staleness``: admission stops while
``steps taken x B + groups live >= (v + max_staleness + 1) x B`` (live: finished or in flight,
not trained on; B = ``train.rollout_batch_size``). So ``max_staleness=0`` admits the B groups
of step ``v`` only after the sync to ``v``: the synchronous run, the same samples in the same
order. Groups finish out of order: a step takes the lowest-index finished groups, and waits
for a group still in flight only at the last step that may train it (``version +
max_staleness``), so long samples are not traded for short ones. A group whose oldest token is
still more than ``max_staleness`` versions behind the step that would train it (a step took
other groups of that last chance, a checkpoint of older versions) is dropped (never trained
on) and counted in ``async/dropped_stale``.

Checkpoints keep the finished groups not yet trained on (their samples) and the groups in flight
or pulled but not admitted (their prompts, group indices and seeds): on resume those are
generated again first, under the resumed weights, with the same seeds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.data.prompts import Prompt
from rlhf.data.types import Sample
from rlhf.trainer.dynamic_sampling import DynamicSamplingStats
from rlhf.trainer.experience import RolloutStats
from rlhf.trainer.rollout_pipeline import ProducedBatch

log = logging.getLogger("rlhf")

__all__ = ["FinishedGroup", "GroupTicket", "StreamState", "StreamingRollouts", "staleness_metrics"]


@dataclass
class GroupTicket:
    """One prompt group: its global index (its ``group_id``), the first index of the loader
    batch it came from (its seeds), and where and under which version it was admitted."""

    index: int
    prompt: Prompt
    batch_base: int
    version: int | None = None
    engine: int | None = None


@dataclass
class FinishedGroup:
    """A generated and scored group; ``discarded`` names why it is not trained on, if so."""

    ticket: GroupTicket
    samples: list[Sample]
    stats: RolloutStats
    agent: Any = None  # AgentStats of a multi-turn group
    discarded: str | None = None  # "uninformative" | "non_finite" | "template_drift"

    @property
    def oldest_version(self) -> int:
        versions = [s.weight_version for s in self.samples if s.weight_version is not None]
        return min(versions, default=self.ticket.version or 0)


@dataclass
class StreamState:
    """What a checkpoint keeps of a streaming run (see the module docstring)."""

    finished: list[FinishedGroup]
    waiting: list[GroupTicket]
    batches_pulled: int  # from the prompt loader


@dataclass
class _Counters:
    dropped_stale: int = 0
    discarded: dict[str, int] = field(default_factory=dict)
    generated: int = 0  # groups finished (kept or not) since the last take


class StreamingRollouts:
    """The trainer's side of a streaming run; the interface of ``RolloutPipeline``.

    Args:
        run_group: generates and scores one admitted group (``GroupRollout``); runs on the
            group's own thread.
        next_prompts: the loader's next batch of prompts (called under the admission lock).
        batch_size: groups per step (``train.rollout_batch_size``).
        max_staleness: ``train.max_staleness``.
        max_in_flight: most groups generating at once (0 = as many as staleness admits).
        num_engines: engines to spread the groups over (fewest samples in flight first).
        start_step, num_steps: the steps to feed.
        timeout_s: longest wait for a batch before failing with a message.
        engine_busy: seconds the engines spent in engine steps so far, summed (metrics).
        dynamic_sampling_rounds: DAPO's round cap (0 = off): a step whose candidates reach
            ``rounds x batch_size`` groups trains on the informative ones it has.
        group_stride: group indices between two loader batches (the k-th batch's groups are
            ``k x stride + i``; the batch mode's numbering, so both sample the same tokens).
        pending: a checkpoint's ``StreamState``.
    """

    threaded = True

    def __init__(
        self,
        run_group: Callable[[GroupTicket], FinishedGroup],
        next_prompts: Callable[[], list[Prompt]],
        batch_size: int,
        max_staleness: int,
        max_in_flight: int,
        num_engines: int,
        start_step: int,
        num_steps: int,
        timeout_s: float = 3600.0,
        engine_busy: Callable[[], float] | None = None,
        dynamic_sampling_rounds: int = 0,
        group_stride: int | None = None,
        pending: list[StreamState] | None = None,
    ) -> None:
        self.run_group, self.next_prompts = run_group, next_prompts
        self.B, self.max_staleness, self.num_steps = batch_size, max_staleness, num_steps
        self.max_in_flight = max_in_flight or batch_size * (max_staleness + 1)
        self.timeout_s, self.engine_busy, self.ds_rounds = timeout_s, engine_busy, dynamic_sampling_rounds
        self.version = self._taken = start_step
        self.engine_lock = threading.Lock()  # evaluation holds it; generation never waits for it
        self._cv = threading.Condition()
        self._finished: dict[int, FinishedGroup] = {}
        self._in_flight: dict[int, GroupTicket] = {}
        self._waiting: collections.deque[GroupTicket] = collections.deque()
        self._load = [0] * num_engines
        self.stride = group_stride or batch_size
        self._batches = start_step
        for state in pending or []:
            self._restore(state)
        self._count = _Counters()
        self._last_taken: list[FinishedGroup] = []
        self._error: BaseException | None = None
        self._stop, self._paused = False, 0
        self._thread: threading.Thread | None = None
        self._busy_mark = (time.perf_counter(), engine_busy() if engine_busy else 0.0)
        self._idle_s = 0.0

    def _restore(self, state: StreamState) -> None:
        if not isinstance(state, StreamState):
            raise RuntimeError(
                "the checkpoint holds rollouts of train.mode=batch; resume it with train.mode=batch "
                "(or start a new train.output_dir)"
            )
        for g in state.finished:
            self._finished[g.ticket.index] = g
        for t in sorted(state.waiting, key=lambda t: t.index):
            self._waiting.append(GroupTicket(t.index, t.prompt, t.batch_base))
        self._batches = state.batches_pulled

    # -- admission --------------------------------------------------------------------------
    def start(self) -> StreamingRollouts:
        self._thread = threading.Thread(target=self._admit, name="rlhf-stream-admission", daemon=True)
        self._thread.start()
        return self

    def _open(self) -> bool:
        live = len(self._finished) + len(self._in_flight)
        limit = min(self.version + self.max_staleness + 1, self.num_steps) * self.B
        return (
            not self._stop
            and not self._paused
            and len(self._in_flight) < self.max_in_flight
            and self._taken * self.B + live < limit
        )

    def _next_ticket(self) -> GroupTicket:
        if not self._waiting:
            base = self._batches * self.stride
            self._waiting.extend(GroupTicket(base + i, p, base) for i, p in enumerate(self.next_prompts()))
            self._batches += 1
        return self._waiting.popleft()

    def _admit(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._open():
                        if self._stop:
                            return
                        self._cv.wait(timeout=1.0)
                    t = self._next_ticket()
                    t.version = self.version
                    t.engine = min(range(len(self._load)), key=lambda e: (self._load[e], e))
                    self._load[t.engine] += 1
                    self._in_flight[t.index] = t
                threading.Thread(
                    target=self._run, args=(t,), name=f"rlhf-group-{t.index}", daemon=True
                ).start()
        except BaseException as e:  # handed to the trainer, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _run(self, t: GroupTicket) -> None:
        try:
            group: FinishedGroup | BaseException = self.run_group(t)
        except BaseException as e:  # noqa: BLE001 - the trainer raises it with the group named
            group = e
        with self._cv:
            if self._in_flight.pop(t.index, None) is None:
                return  # abandoned: the run closed
            self._load[t.engine] -= 1
            if isinstance(group, BaseException):
                self._error = RuntimeError(f"generating group {t.index} failed: {group}")
                self._error.__cause__ = group
            elif group.discarded is not None:
                self._count.discarded[group.discarded] = self._count.discarded.get(group.discarded, 0) + 1
                self._count.generated += 1
            else:
                self._finished[t.index] = group
                self._count.generated += 1
            self._cv.notify_all()

    # -- trainer side -----------------------------------------------------------------------
    def get(self, step: int) -> tuple[ProducedBatch, float]:
        """The batch of ``step`` (the lowest-index finished groups within the staleness bound)
        and the seconds the trainer waited for it."""
        t0 = time.perf_counter()
        with self._cv:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"streaming rollouts failed: {self._error}") from self._error
                self._drop_stale(step)
                ready = sorted(self._finished)
                if (len(ready) >= self.B and not self._last_chance(step)) or self._shortfall(len(ready)):
                    break
                waited = time.perf_counter() - t0
                if waited >= self.timeout_s:
                    raise TimeoutError(
                        f"no rollout batch for step {step + 1} after {self.timeout_s:.0f} s ({len(ready)} of "
                        f"{self.B} groups finished, {len(self._in_flight)} in flight): the rollout engines are "
                        "stuck or too slow (check the engine logs; raise train.rollout_timeout_s if generation "
                        "is just slow)"
                    )
                self._cv.wait(timeout=min(1.0, self.timeout_s - waited))
            groups = [self._finished.pop(i) for i in ready[: self.B]]
            self._last_taken, self._taken = groups, step + 1
            metrics = self._take_metrics(len(groups))
            self._cv.notify_all()
        metrics.update(self._engine_metrics())
        stats = RolloutStats()
        for g in groups:
            stats = stats.merge(g.stats)
        agents = [g.agent for g in groups if g.agent is not None]
        if agents:
            from rlhf.agents.loop import AgentStats

            total = AgentStats()
            for a in agents:
                total.add(a)
            stats.agent = {
                k: v for k, v in total.metrics("agent").items() if k != "agent/engine_busy_fraction"
            }
        samples = [s for g in groups for s in g.samples]
        version = min((g.oldest_version for g in groups), default=self.version)
        return ProducedBatch(step, samples, stats, metrics, version), time.perf_counter() - t0

    def _drop_stale(self, step: int) -> None:
        for i in [i for i, g in self._finished.items() if step - g.oldest_version > self.max_staleness]:
            g = self._finished.pop(i)
            self._count.dropped_stale += 1
            log.warning(
                "group %d dropped: sampled under weight version %d, %d versions behind step %d "
                "(train.max_staleness=%d)",
                i,
                g.oldest_version,
                step - g.oldest_version,
                step + 1,
                self.max_staleness,
            )

    def _last_chance(self, step: int) -> bool:
        """A group in flight can be trained on at ``step`` and never after (it would be more than
        ``max_staleness`` versions behind): the step waits for it rather than drop it."""
        return any(step - t.version == self.max_staleness for t in self._in_flight.values())

    def _shortfall(self, ready: int) -> bool:
        """Dynamic sampling examined as many groups as its round cap allows: train on ``ready``."""
        return self.ds_rounds > 0 and self._count.generated >= self.ds_rounds * self.B and ready < self.B

    def _take_metrics(self, taken: int) -> dict[str, float]:
        c = self._count
        m = {
            "async/dropped_stale": float(c.dropped_stale),
            "async/groups_in_flight": float(len(self._in_flight)),
            "async/groups_finished_waiting": float(len(self._finished)),
            **{f"async/discarded_{k}": float(v) for k, v in c.discarded.items()},
        }
        if self.ds_rounds:
            ds = DynamicSamplingStats(
                groups_generated=c.generated, groups_kept=taken, shortfall=self.B - taken
            )
            m.update(
                {k: v for k, v in ds.metrics().items() if k != "dynamic_sampling/rounds"}
            )  # no rounds here
        self._count = _Counters(discarded=dict.fromkeys(c.discarded, 0))
        return m

    def _engine_metrics(self) -> dict[str, float]:
        """Engine busy fraction (time in engine steps over wall time and engines) since the last take."""
        if self.engine_busy is None:
            return {}
        now, busy = time.perf_counter(), self.engine_busy()
        t_prev, busy_prev = self._busy_mark
        self._busy_mark = (now, busy)
        capacity = (now - t_prev) * len(self._load)
        self._idle_s += max(capacity - (busy - busy_prev), 0.0)
        return {"async/engine_busy_fraction": (busy - busy_prev) / max(capacity, 1e-9)}

    def finished_groups(self) -> list[int]:
        """Indices of the groups finished and not taken yet."""
        with self._cv:
            return sorted(self._finished)

    def set_aside(self, batch: ProducedBatch) -> None:
        """Give back the batch taken but not trained on (a stop request); admit no more."""
        with self._cv:
            self._stop = True
            for g in self._last_taken:
                self._finished[g.ticket.index] = g
            self._last_taken = []
            self._cv.notify_all()

    def take_engine_idle(self) -> float:
        """Engine-seconds the engines were not stepping, over the takes since the last call."""
        idle, self._idle_s = self._idle_s, 0.0
        return idle

    def sync(self, update_weights: Callable[[], None], version: int) -> float:
        """Load the trainer's new weights (``version``) into the engines, requests in flight
        included (``rollout.inflight_updates``; else the engines finish those first); returns 0:
        the trainer never waits for a generation to end before the update starts."""
        update_weights()
        with self._cv:
            self.version = version
            self._cv.notify_all()
        return 0.0

    def drain(self) -> list[StreamState]:
        """The state a checkpoint keeps, with admission paused; call ``resume()`` after."""
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"streaming rollouts failed: {self._error}") from self._error
            self._paused += 1
            waiting = [GroupTicket(t.index, t.prompt, t.batch_base) for t in self._in_flight.values()]
            waiting += [GroupTicket(t.index, t.prompt, t.batch_base) for t in self._waiting]
            finished = list(self._finished.values())
            return [StreamState(finished, sorted(waiting, key=lambda t: t.index), self._batches)]

    def resume(self) -> None:
        with self._cv:
            self._paused -= 1
            self._cv.notify_all()

    def close(self) -> None:
        """Admit nothing more; groups still in flight are abandoned (their threads end with
        their engine calls; nothing waits for them)."""
        with self._cv:
            self._stop = True
            self._in_flight.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            if self._thread.is_alive():
                log.warning("the streaming admission thread did not stop within 30 s")


def staleness_metrics(samples: list[Sample], step: int) -> dict[str, float]:
    """Per action token: how many versions behind ``step`` the weights that sampled it were
    (``async/staleness_mean``/``_max``) and the share sampled under an older version."""
    lags = []
    for s in samples:
        if s.token_versions is not None:
            lags.append((step - s.token_versions[s.action_mask]).float())
        elif s.weight_version is not None:
            lags.append(torch.full((s.num_actions,), float(step - s.weight_version)))
    if not lags:
        return {}
    lag = torch.cat(lags)
    if lag.numel() == 0:
        return {}
    return {
        "async/staleness_mean": float(lag.mean()),
        "async/staleness_max": float(lag.max()),
        "async/stale_token_fraction": float((lag > 0).float().mean()),
    }
