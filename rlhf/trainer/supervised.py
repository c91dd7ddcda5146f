"""The epoch loop shared by the SFT, DPO and reward-model trainers.

A trainer holds a fixed data set of *units* (one ``Sample`` for SFT, a (chosen, rejected)
pair for DPO/RM), and its ``fit()`` runs epochs over shuffled batches of
``train.batch_size`` units: one ``ModelGroup.train`` call, hence exactly one optimizer
step, per batch. Packing, dealing micro-batches to ranks and loss normalisation all live
in the group and the objective; the trainer only decides what goes into a step.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rlhf.data.types import Sample
from rlhf.trainer.checkpoint import latest_checkpoint, load_latest, save_checkpoint, save_final
from rlhf.trainer.run_control import CheckpointPolicy, GracefulStop, Preempted, resolve_resume
from rlhf.trainer.run_output import RunOutput
from rlhf.trainer.tracking import Tracker

if TYPE_CHECKING:
    from rlhf.config.trainers import DPOConfig, RMConfig, SFTConfig
    from rlhf.workers.group import ModelGroup

__all__ = ["SupervisedTrainer", "Unit", "count_steps", "flatten_units"]

log = logging.getLogger("rlhf")
Unit = tuple[Sample, ...]


def count_steps(num_units: int, train) -> int:
    """Optimizer steps of a run: one per batch (the last one may be smaller), capped by ``train.max_steps``."""
    total = train.epochs * math.ceil(num_units / train.batch_size)
    return min(total, train.max_steps) if train.max_steps else total


class SupervisedTrainer:
    """Epochs over shuffled batches of units -> ``group.train``; eval after every epoch; save at the end.

    Subclasses set ``objective`` and implement ``evaluate``; a unit of more than one sample
    (a pair) is passed to the group as ``units`` so it is never split across micro-batches.
    """

    objective: Any = None

    def __init__(
        self,
        cfg: SFTConfig | DPOConfig | RMConfig,
        group: ModelGroup,
        train_units: Sequence[Unit],
        eval_units: Sequence[Unit] = (),
    ):
        if not train_units:
            raise ValueError("nothing to train on: the training set is empty")
        self.cfg, self.group = cfg, group
        self.train_units, self.eval_units = list(train_units), list(eval_units)
        self.out = RunOutput(cfg.train.output_dir)
        self.step = 0

    @property
    def total_steps(self) -> int:
        return count_steps(len(self.train_units), self.cfg.train)

    def batches(self, epoch: int) -> Iterator[list[Unit]]:
        """This epoch's batches: a fresh seeded shuffle every epoch, the last batch may be smaller."""
        order = list(range(len(self.train_units)))
        random.Random(self.cfg.train.seed * 100003 + epoch).shuffle(order)
        bs = self.cfg.train.batch_size
        for i in range(0, len(order), bs):
            yield [self.train_units[j] for j in order[i : i + bs]]

    def schedule(self) -> Iterator[tuple[float, bool, list[Unit]]]:
        """``(epochs done after this batch, last batch of its epoch?, batch)`` over every epoch."""
        for epoch in range(self.cfg.train.epochs):
            batches = list(self.batches(epoch))
            for i, batch in enumerate(batches):
                yield epoch + (i + 1) / len(batches), i == len(batches) - 1, batch

    def train_step(self, batch: Sequence[Unit]) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the group's stats."""
        samples, units = flatten_units(batch)
        return self.group.train(
            samples,
            self.objective,
            self.cfg.train.max_tokens_per_microbatch,
            num_minibatches=1,
            units=units if len(batch[0]) > 1 else None,
        )

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def step_once(self, progress: float, epoch_end: bool, batch: Sequence[Unit]) -> dict[str, float]:
        """One optimizer step (and the held-out evaluation at an epoch's end); its metrics row."""
        t0 = time.perf_counter()
        stats = self.train_step(batch)
        metrics = {f"train/{k}": v for k, v in stats.items() if k != "num_optimizer_steps"}
        metrics.update(
            {"epoch": progress, "time/step_s": time.perf_counter() - t0, "train/units": float(len(batch))}
        )
        if (epoch_end or self.step + 1 == self.total_steps) and self.eval_units:
            metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
        return metrics

    def fit(self) -> list[dict]:
        """Train ``train.epochs`` epochs (or ``train.max_steps``), save ``<output_dir>/final``; return metrics."""
        t = self.cfg.train
        total = self.total_steps
        if resolve_resume(self.out.location, t.resume) is not None:
            self.out.pull()
            ckpt = load_latest(self.out.location, {"model": self.group})
            self.step = int(ckpt.state["step"])  # the batch schedule is seeded: skip what was done
        tracker = Tracker(
            str(self.out.local), total, t.tensorboard, t.wandb_project, asdict(self.cfg), self.step
        )
        log.info(
            "%s: %d training units, %d held out, %d optimizer steps",
            type(self).__name__,
            len(self.train_units),
            len(self.eval_units),
            total,
        )
        policy = CheckpointPolicy(t.save_every, t.save_every_min)
        try:
            with GracefulStop(t.stop_grace_s, lambda: str(latest_checkpoint(self.out.location))) as stop:
                if self.step == 0 and self.eval_units:  # the starting point of "before -> after"
                    tracker.log(0, {f"eval/{k}": v for k, v in self.evaluate().items()}, advance=False)
                for progress, epoch_end, batch in itertools.islice(self.schedule(), self.step, total):
                    tracker.log(self.step + 1, self.step_once(progress, epoch_end, batch))
                    self.step += 1
                    if policy.due(self.step, self.step == total, stop.requested is not None):
                        save_checkpoint(
                            self.out.location,
                            self.step,
                            {"model": self.group},
                            {"step": self.step},
                            keep=t.keep_checkpoints,
                        )
                        self.out.publish([self.group])
                        policy.saved()
                    if stop.requested is not None and self.step < total:
                        stop.finished()
                        raise Preempted(stop.requested, self.step, latest_checkpoint(self.out.location))
                final = save_final(self.group, self.out.location, self.cfg.model.lora.enabled, t.save_merged)
                self.out.publish([self.group])
                log.info("saved the trained model to %s", final)
        finally:
            tracker.close()
        return tracker.history


def flatten_units(batch: Sequence[Unit]) -> tuple[list[Sample], list[list[int]]]:
    """Samples of ``batch`` in order, and each unit's indices into them (``[[0, 1], [2, 3], ...]`` for pairs)."""
    samples: list[Sample] = []
    units: list[list[int]] = []
    for u in batch:
        units.append(list(range(len(samples), len(samples) + len(u))))
        samples.extend(u)
    return samples, units
