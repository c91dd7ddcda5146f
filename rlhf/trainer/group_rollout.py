"""One prompt group of a streaming run, start to finish: generation (single-turn, or the agent
loop's trajectories), rewards, and the filters that can leave the group out.

Seeds and group ids are those the batch mode gives the same prompt: group ``g`` of the loader
batch starting at index ``base`` is prompt ``g - base`` of that batch, so with
``train.max_staleness=0`` both modes sample the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf.config.schema import PPOConfig
from rlhf.data.types import Sample
from rlhf.trainer.dynamic_sampling import is_informative
from rlhf.trainer.experience import (
    ExperienceMaker,
    NoFiniteReward,
    RolloutStats,
    build_sample,
    generation_stats,
    sampling_params,
)
from rlhf.trainer.streaming import FinishedGroup, GroupTicket

if TYPE_CHECKING:
    from rlhf.workers.rollout_pool import RolloutPool

__all__ = ["GroupRollout"]


class GroupRollout:
    """``ticket -> FinishedGroup`` for ``StreamingRollouts``; many run at once, one per thread."""

    def __init__(self, cfg: PPOConfig, maker: ExperienceMaker, pool: RolloutPool) -> None:
        self.cfg, self.maker, self.pool = cfg, maker, pool

    def __call__(self, t: GroupTicket) -> FinishedGroup:
        n = self.cfg.rollout.n_samples_per_prompt
        i = t.index - t.batch_base
        agent = None
        if self.maker.agent_loop is not None:
            from rlhf.agents.chat_delta import TemplateDriftError

            try:
                samples, agent = self.maker.agent_loop.run_group(
                    t.prompt, n, batch=t.batch_base, group_id=t.index, first_index=i * n, engine=t.engine
                )
            except TemplateDriftError:
                if self.cfg.env.on_template_drift != "drop":
                    raise
                return FinishedGroup(t, [], RolloutStats(), None, discarded="template_drift")
        else:
            samples = self._single_turn(t, n, i)
        stats = generation_stats(samples)
        try:
            samples = self.maker.assign_rewards(samples, stats)
        except NoFiniteReward:  # reward.non_finite=drop and the whole group scored NaN/inf
            return FinishedGroup(t, [], stats, agent, discarded="non_finite")
        if self.cfg.algorithm.dynamic_sampling and not is_informative(samples):
            return FinishedGroup(t, samples, stats, agent, discarded="uninformative")
        return FinishedGroup(t, samples, stats, agent)

    def _single_turn(self, t: GroupTicket, n: int, i: int) -> list[Sample]:
        # the seed the batch mode's pool.generate gives prompt i of the batch (seed + i * n)
        seed = self.maker.request_seed(t.batch_base) + i * n
        sampling = {**sampling_params(self.cfg.rollout, n), "seed": [seed]}

        def submit() -> object:
            return self.pool.submit_turn(t.engine, t.prompt.token_ids, sampling)

        completions = self.pool.group_result(t.engine, submit(), submit)
        return [build_sample(t.prompt, c, group_id=t.index) for c in completions]
