"""Experience maker: rollouts -> unpadded samples -> scores, reference logprobs, values.

Every stage speaks ``rlhf.data.types.Sample``: one unpadded sequence per trajectory with an
explicit action mask. Nothing here pads; packing happens inside the model groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlhf.algorithms.shaping import overlong_penalty
from rlhf.config.schema import PPOConfig, RolloutConfig
from rlhf.data.prompts import Prompt
from rlhf.data.types import Sample
from rlhf.rewards import Reward, RewardComponent, RewardFunctionError, non_finite_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf.workers.group import ModelGroup
    from rlhf.workers.rollout_pool import RolloutPool


@dataclass
class RolloutStats:
    num_samples: int = 0
    empty_responses: int = 0
    truncated: int = 0  # stopped by max_new_tokens / max_model_len
    dropped_non_finite: int = 0
    overlong_penalty_mean: float = 0.0  # DAPO shaping added to the scores (0 when off)
    reward_components: dict[str, float] = field(default_factory=dict)  # mean of each weighted part

    def merge(self, other: RolloutStats) -> RolloutStats:
        """Counts of two generation rounds of one step (dynamic sampling)."""
        n = self.num_samples + other.num_samples

        def mean(a: float, b: float) -> float:
            return (a * self.num_samples + b * other.num_samples) / max(n, 1)

        keys = set(self.reward_components) | set(other.reward_components)
        return RolloutStats(
            num_samples=n,
            empty_responses=self.empty_responses + other.empty_responses,
            truncated=self.truncated + other.truncated,
            dropped_non_finite=self.dropped_non_finite + other.dropped_non_finite,
            overlong_penalty_mean=mean(self.overlong_penalty_mean, other.overlong_penalty_mean),
            reward_components={
                k: mean(self.reward_components.get(k, 0.0), other.reward_components.get(k, 0.0)) for k in keys
            },
        )


def sampling_params(cfg: RolloutConfig, n: int) -> dict[str, Any]:
    """Rollout config -> the engine's sampling dict."""
    return {
        "n": n,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_tokens": cfg.max_new_tokens,
    }


def build_sample(prompt: Prompt, completion: dict, group_id: int) -> Sample:
    """One single-turn completion -> one unpadded Sample (prompt tokens masked out)."""
    p, r = list(prompt.token_ids), list(completion["token_ids"])
    lp = completion.get("logprobs")
    if lp is not None and len(lp) != len(r):
        raise ValueError(f"engine returned {len(lp)} logprobs for {len(r)} tokens")
    return Sample(
        input_ids=torch.tensor(p + r, dtype=torch.long),
        action_mask=torch.tensor([False] * len(p) + [True] * len(r)),
        # None when the engine was asked for no logprobs: a correction that needs them says so.
        rollout_logprobs=None if lp is None else torch.tensor([0.0] * len(p) + list(lp), dtype=torch.float32),
        group_id=group_id,
        prompt=prompt.text,
        prompt_len=len(p),
        finish_reason=completion.get("finish_reason"),
        info=dict(prompt.info),
    )


class _Trajectory:
    """A multi-turn trajectory under construction (token lists grow turn by turn)."""

    def __init__(self, prompt: Prompt, group_id: int, env):
        self.prompt, self.group_id, self.env = prompt, group_id, env
        n = len(prompt.token_ids)
        self.ids, self.mask, self.lp = list(prompt.token_ids), [False] * n, [0.0] * n
        self.done, self.env_reward, self.finish_reason = False, None, None
        self.has_logprobs = True

    def append(self, ids: list[int], logprobs: list[float] | None, action: bool) -> None:
        self.ids += ids
        self.mask += [action] * len(ids)
        self.lp += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.has_logprobs &= logprobs is not None or not action

    def to_sample(self) -> Sample:
        return Sample(
            input_ids=torch.tensor(self.ids),
            action_mask=torch.tensor(self.mask),
            rollout_logprobs=torch.tensor(self.lp, dtype=torch.float32) if self.has_logprobs else None,
            group_id=self.group_id,
            prompt=self.prompt.text,
            prompt_len=len(self.prompt.token_ids),
            env_reward=self.env_reward,
            finish_reason=self.finish_reason,
            info=dict(self.prompt.info),
        )


class ExperienceMaker:
    """Generates and scores experience. The engines and model groups are passed in.

    Args:
        rollout: a ``RolloutPool`` (generate(prompt_ids, sampling) -> completions).
        actor, reference, critic, reward_model: ``ModelGroup`` or None.
        reward_fn: rule-based reward ``fn(prompt, response, info) -> float`` or None.
        env_factory: builds a fresh multi-turn ``Env`` per trajectory, or None.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        rollout: RolloutPool,
        actor: ModelGroup,
        reference: ModelGroup | None = None,
        critic: ModelGroup | None = None,
        reward_model: ModelGroup | None = None,
        reward_fn: Reward | Callable | None = None,
        env_factory: Callable | None = None,
    ):
        self.cfg, self.tok, self.rollout = cfg, tokenizer, rollout
        self.actor, self.reference, self.critic, self.reward_model = actor, reference, critic, reward_model
        self.env_factory = env_factory
        # A plain function (tests, scripts) is a one-component reward with the configured timeout.
        self.reward: Reward | None = (
            reward_fn
            if reward_fn is None or isinstance(reward_fn, Reward)
            else Reward(
                [RewardComponent(getattr(reward_fn, "__name__", "reward"), reward_fn)], cfg.reward.timeout_s
            )
        )
        self.budget = cfg.train.max_tokens_per_microbatch

    def generate(
        self, prompts: list[Prompt], step: int, group_base: int | None = None
    ) -> tuple[list[Sample], RolloutStats]:
        """Sample ``rollout.n_samples_per_prompt`` trajectories per prompt.

        The samples of prompt ``i`` get ``group_id = group_base + i`` (default
        ``step * len(prompts)``); a step with several generation rounds passes distinct bases.
        """
        n = self.cfg.rollout.n_samples_per_prompt
        base = step * len(prompts) if group_base is None else group_base
        if self.env_factory is not None:
            samples = self._generate_multi_turn(prompts, n, base)
        else:
            sampling = {**sampling_params(self.cfg.rollout, n), "seed": self.request_seed(base)}
            outs = self.rollout.generate([p.token_ids for p in prompts], sampling)
            samples = [
                build_sample(p, c, group_id=base + i)
                for i, (p, comps) in enumerate(zip(prompts, outs, strict=True))
                for c in comps
            ]
        stats = RolloutStats(num_samples=len(samples))
        stats.empty_responses = sum(s.num_actions == 0 for s in samples)
        stats.truncated = sum(s.finish_reason == "length" for s in samples)
        return samples, stats

    def request_seed(self, group_base: int, turn: int = 0) -> int:
        """Sampling seed of a generate call, a function of (train.seed, batch, turn) only: a run
        samples the same tokens whether its engines were restarted, resumed or run ahead."""
        return (self.cfg.train.seed * 1_000_003 + group_base * 1_009 + turn * 7_919) % (2**31 - 1)

    def _generate_multi_turn(self, prompts: list[Prompt], n: int, base: int) -> list[Sample]:
        """Alternate policy turns (mask 1) and environment observations (mask 0)."""
        max_len = self.cfg.rollout.max_model_len
        trajs = []
        for i, p in enumerate(prompts):
            for _ in range(n):
                env = self.env_factory()
                env.reset(p.text, dict(p.info))
                trajs.append(_Trajectory(p, base + i, env))
        for turn in range(self.cfg.env.max_turns):
            sampling = {**sampling_params(self.cfg.rollout, 1), "seed": self.request_seed(base, turn)}
            last_turn = turn == self.cfg.env.max_turns - 1
            live = [t for t in trajs if not t.done and len(t.ids) < max_len - 1]
            if not live:
                break
            outs = self.rollout.generate([t.ids for t in live], sampling)
            for t, comps in zip(live, outs, strict=True):
                c = comps[0]
                t.append(c["token_ids"], c["logprobs"], action=True)
                t.finish_reason = c.get("finish_reason")
                res = t.env.step(self.tok.decode(c["token_ids"]))
                obs = self.tok(res.observation, add_special_tokens=False)["input_ids"]
                obs = obs[: self.cfg.env.max_observation_tokens]
                # No observation after the last policy turn (nothing would answer it), nor one that
                # leaves no room for another policy turn: either ends the trajectory.
                if res.done or last_turn or len(obs) >= max_len - 1 - len(t.ids):
                    t.done, t.env_reward = True, res.reward
                    continue
                t.append(obs, None, action=False)
        return [t.to_sample() for t in trajs]

    def score(self, samples: list[Sample], stats: RolloutStats) -> list[Sample]:
        """:meth:`assign_rewards` then :meth:`score_models`; returns the samples kept."""
        return self.score_models(self.assign_rewards(samples, stats))

    def assign_rewards(self, samples: list[Sample], stats: RolloutStats) -> list[Sample]:
        """Fill ``score``: reward (environment, model or function), clip, overlong shaping.

        Returns the samples kept: with ``reward.non_finite=drop`` samples whose score is NaN or
        inf are removed (and counted in ``stats``); with ``error`` such a score fails the step
        before any model is updated.
        """
        scores = self.rewards(samples, stats)
        bad = set(non_finite_indices(scores))
        if bad:
            if self.cfg.reward.non_finite == "error":
                i = min(bad)
                raise RewardFunctionError(
                    f"reward for sample {i} is {scores[i]} ({len(bad)} of {len(scores)} samples non-finite); "
                    "fix the reward, or set reward.non_finite=drop to drop such samples (they are counted)"
                )
            if self.cfg.algorithm.estimator.compares_group:
                # A group estimator needs the whole group: a partial one can shrink to a single
                # sample, which has no baseline. Drop the groups of the bad samples.
                bad_groups = {samples[i].group_id for i in bad}
                bad = {i for i, s in enumerate(samples) if s.group_id in bad_groups}
            if len(bad) == len(samples):
                raise RewardFunctionError(
                    "every sample in the batch got a non-finite reward (or shares a group with one)"
                )
            samples = [s for i, s in enumerate(samples) if i not in bad]
            scores = [r for i, r in enumerate(scores) if i not in bad]
            stats.dropped_non_finite = len(bad)
        clip = self.cfg.reward.clip
        shaping = self._overlong_shaping(samples)
        for s, r, extra in zip(samples, scores, shaping, strict=True):
            s.score = (max(-clip, min(clip, r)) if clip > 0 else r) + extra
        stats.overlong_penalty_mean = sum(shaping) / len(shaping) if shaping else 0.0
        return samples

    def _overlong_shaping(self, samples: list[Sample]) -> list[float]:
        """DAPO's overlong penalty per sample (0 when ``algorithm.overlong_buffer_frac=0``)."""
        max_len = self.cfg.rollout.max_new_tokens
        buffer = self.cfg.algorithm.overlong_buffer_len(max_len)
        if buffer == 0 or not samples:
            return [0.0] * len(samples)
        lengths = torch.tensor([s.num_actions for s in samples])
        return overlong_penalty(lengths, max_len, buffer, self.cfg.algorithm.overlong_penalty).tolist()

    def score_models(self, samples: list[Sample], engines_busy: int = 0) -> list[Sample]:
        """Fill ``old_logprobs`` (unless ``cfg.old_logprobs_are_current``: the train step takes
        them from its own forward), ``ref_logprobs`` and ``values`` with the model groups.

        All scoring forwards run at once and split the cores between them and the
        ``engines_busy`` engines generating meanwhile (one-step-off)."""
        # Logprobs at the sampling temperature, as the engine reported them and as the policy
        # loss computes them.
        t = self.cfg.rollout.temperature
        groups = [
            (name, group, temp)
            for name, group, temp in (
                ("old_logprobs", None if self.cfg.old_logprobs_are_current else self.actor, t),
                ("ref_logprobs", self.reference, t),
                ("values", self.critic, 1.0),
            )
            if group is not None
        ]
        share = 1.0 / max(1, sum(g.num_ranks for _, g, _ in groups) + engines_busy)
        pending = [(name, g.forward_async(samples, self.budget, temp, share)) for name, g, temp in groups]
        for name, collect in pending:
            for s, out in zip(samples, collect(), strict=True):
                setattr(s, name, out.float())
        return samples

    def rewards(self, samples: list[Sample], stats: RolloutStats) -> list[float]:
        """Per sample: the environment's reward where it gave one, else the reward model/function."""
        scores = [s.env_reward for s in samples]
        rest = [i for i, r in enumerate(scores) if r is None]
        if not rest:
            return [float(r) for r in scores]
        todo = [samples[i] for i in rest]
        if self.reward_model is not None:
            model_scores = [float(o.reshape(-1)[0]) for o in self.reward_model.forward(todo, self.budget)]
        elif self.reward is None:
            raise RewardFunctionError(
                f"env.name={self.cfg.env.name!r} ended {len(todo)} trajectories without a reward "
                "(StepResult.reward=None) and no reward.function or reward model is set to score them: "
                "return a reward from the environment's last step, or set reward.function"
            )
        else:
            model_scores, parts = self.reward(
                [s.prompt or "" for s in todo],
                [self.tok.decode(s.input_ids[s.prompt_len or 0 :].tolist()) for s in todo],
                [s.info for s in todo],
            )
            if parts:  # one function too: reward/<fn> names what scored the run
                stats.reward_components = {k: math.fsum(v) / len(v) for k, v in parts.items()}
        for i, r in zip(rest, model_scores, strict=True):
            scores[i] = r
        return [float(r) for r in scores]
