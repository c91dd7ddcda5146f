"""Dynamic sampling (DAPO): collect informative groups, bounded rounds, never abort."""

import torch

from rlhf.data.types import Sample
from rlhf.trainer.dynamic_sampling import collect_informative_groups


def _group(gid: int, scores: list[float]) -> list[Sample]:
    return [Sample(torch.arange(3), torch.tensor([False, True, True]), score=x, group_id=gid) for x in scores]


def _rounds(plan: list[list[list[float]]]):
    """next_round(r) gives groups of round r with ids 100*r + k; records the calls."""
    calls = []

    def next_round(r: int) -> list[Sample]:
        calls.append(r)
        return [s for k, sc in enumerate(plan[r]) for s in _group(100 * r + k, sc)]

    return next_round, calls


def test_keeps_generating_until_enough_informative_groups():
    plan = [
        [[1, 1], [0, 1], [0, 0]],  # one informative group (id 1)
        [[0.5, 0.5], [1, 1], [1, 1]],  # none
        [[0, 1], [1, 0], [0.2, 0.3]],  # three: only two more are needed
        [[0, 1]] * 3,  # never reached
    ]
    next_round, calls = _rounds(plan)
    samples, stats = collect_informative_groups(next_round, target_groups=3, max_rounds=10)
    assert calls == [0, 1, 2]
    assert sorted({s.group_id for s in samples}) == [1, 200, 201]
    assert len(samples) == 6  # whole groups
    assert (stats.rounds, stats.groups_generated, stats.groups_kept, stats.shortfall) == (3, 9, 3, 0)
    assert stats.metrics()["dynamic_sampling/informative_fraction"] == 3 / 9


def test_round_cap_trains_on_what_there_is():
    next_round, calls = _rounds([[[0, 1], [1, 1]], [[2, 2], [3, 3]], [[0, 1]]])
    samples, stats = collect_informative_groups(next_round, target_groups=4, max_rounds=2)
    assert calls == [0, 1]
    assert {s.group_id for s in samples} == {0}
    assert (stats.groups_kept, stats.shortfall) == (1, 3)


def test_no_informative_group_returns_nothing_rather_than_raising():
    next_round, _ = _rounds([[[1, 1]], [[0, 0]]])
    samples, stats = collect_informative_groups(next_round, target_groups=2, max_rounds=2)
    assert samples == [] and stats.shortfall == 2 and stats.metrics()["dynamic_sampling/groups_kept"] == 0
