"""DAPO dynamic sampling: fill a step's batch with groups whose scores differ.

A group whose samples all scored the same has zero advantage under every group estimator;
DAPO drops such groups and keeps generating until the batch holds ``target_groups``
informative ones. The number of generation rounds is capped: when the cap is hit the step
trains on the informative groups it has (possibly none: then it skips the update) and says
so in the metrics, instead of aborting the run as verl did (verl#953).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.algorithms.shaping import informative_samples
from rlhf.data.types import Sample


@dataclass
class DynamicSamplingStats:
    rounds: int = 0
    groups_generated: int = 0
    groups_kept: int = 0
    shortfall: int = 0  # target_groups - groups_kept when the round cap was hit

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/groups_generated": float(self.groups_generated),
            "dynamic_sampling/groups_kept": float(self.groups_kept),
            "dynamic_sampling/informative_fraction": self.groups_kept / max(self.groups_generated, 1),
            "dynamic_sampling/shortfall": float(self.shortfall),
        }


def _split_groups(samples: list[Sample]) -> tuple[list[list[Sample]], list[bool]]:
    """Samples grouped by ``group_id`` in order of first appearance, and which are informative."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    ordered = list(groups.values())
    if not samples:
        return ordered, []
    flags = informative_samples(
        torch.tensor([float(s.score) for s in samples]), torch.tensor([s.group_id for s in samples])
    )
    informative = {s.group_id: bool(f) for s, f in zip(samples, flags, strict=True)}
    return ordered, [informative[g[0].group_id] for g in ordered]


def is_informative(group: list[Sample]) -> bool:
    """Whether the scores of one group's samples differ."""
    return _split_groups(group)[1] == [True]


def collect_informative_groups(
    next_round: Callable[[int], list[Sample]], target_groups: int, max_rounds: int
) -> tuple[list[Sample], DynamicSamplingStats]:
    """Call ``next_round(r)`` (scored samples of new prompts) until ``target_groups`` informative
    groups are collected or ``max_rounds`` rounds ran; returns at most ``target_groups`` groups
    (the first collected) and the stats."""
    if target_groups < 1 or max_rounds < 1:
        raise ValueError(f"target_groups ({target_groups}) and max_rounds ({max_rounds}) must be >= 1")
    kept: list[list[Sample]] = []
    stats = DynamicSamplingStats()
    while stats.rounds < max_rounds and len(kept) < target_groups:
        groups, informative = _split_groups(next_round(stats.rounds))
        stats.rounds += 1
        stats.groups_generated += len(groups)
        kept += [g for g, ok in zip(groups, informative, strict=True) if ok]
    kept = kept[:target_groups]
    stats.groups_kept = len(kept)
    stats.shortfall = target_groups - len(kept)
    return [s for g in kept for s in g], stats
