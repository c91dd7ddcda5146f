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

from rlhf.algorithms.shaping import longest_turn, overlong_penalty
from rlhf.config.schema import PPOConfig, RolloutConfig
from rlhf.data.prompts import Prompt
from rlhf.data.types import Sample, versions_tensor
from rlhf.rewards import Reward, RewardComponent, RewardFunctionError, non_finite_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf.agents.loop import AgentLoop
    from rlhf.workers.group import ModelGroup
    from rlhf.workers.rollout_pool import RolloutPool


@dataclass
class RolloutStats:
    num_samples: int = 0
    empty_responses: int = 0
    truncated: int = 0  # stopped by max_new_tokens / max_model_len
    dropped_non_finite: int = 0
    reward_errors: int = 0  # reward calls that raised, under reward.on_error=zero|drop
    # per scored sample: DAPO's overlong shaping, and each weighted part of the reward (kept
    # as values, so that groups scored apart give the same means as one batch)
    overlong_penalties: list[float] = field(default_factory=list)
    reward_parts: dict[str, list[float]] = field(default_factory=dict)
    # events the reward functions counted (rlhf.rewards.count), e.g. verify_timeouts
    reward_counts: dict[str, int] = field(default_factory=dict)
    agent: dict[str, float] = field(default_factory=dict)  # agent/* metrics of multi-turn rollouts

    @property
    def overlong_penalty_mean(self) -> float:
        """DAPO shaping added to the scores, mean over the samples (0 when off)."""
        p = self.overlong_penalties
        return math.fsum(p) / len(p) if p else 0.0

    @property
    def reward_components(self) -> dict[str, float]:
        """Mean of each weighted part of the reward."""
        return {k: math.fsum(v) / len(v) for k, v in self.reward_parts.items() if v}

    def merge(self, other: RolloutStats) -> RolloutStats:
        """Counts of two generation rounds (dynamic sampling) or groups (streaming) of one step."""
        keys = list(self.reward_parts) + [k for k in other.reward_parts if k not in self.reward_parts]
        return RolloutStats(
            num_samples=self.num_samples + other.num_samples,
            empty_responses=self.empty_responses + other.empty_responses,
            truncated=self.truncated + other.truncated,
            dropped_non_finite=self.dropped_non_finite + other.dropped_non_finite,
            reward_errors=self.reward_errors + other.reward_errors,
            overlong_penalties=self.overlong_penalties + other.overlong_penalties,
            reward_parts={k: self.reward_parts.get(k, []) + other.reward_parts.get(k, []) for k in keys},
            agent={**self.agent, **other.agent},
            reward_counts=add_counts(dict(self.reward_counts), other.reward_counts),
        )


def add_counts(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """``into`` with ``more`` added key by key; keys counted 0 stay (their metric is logged as 0)."""
    for k, v in more.items():
        into[k] = into.get(k, 0) + v
    return into


class NoFiniteReward(RewardFunctionError):
    """Under ``reward.non_finite=drop``, no sample of the batch (or group) kept a finite score."""


def generation_stats(samples: list[Sample]) -> RolloutStats:
    """Generation counts of ``samples`` (the rewards add theirs)."""
    return RolloutStats(
        num_samples=len(samples),
        empty_responses=sum(s.num_actions == 0 for s in samples),
        truncated=sum(s.finish_reason == "length" for s in samples),
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
    lp, versions = completion.get("logprobs"), completion.get("versions")  # versions: None from hf
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
        token_versions=versions_tensor([None] * len(p) + list(versions or [])),
        info=dict(prompt.info),
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
        self._agent: tuple[Callable, AgentLoop] | None = None
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
        agent: dict[str, float] = {}
        if self.agent_loop is not None:
            samples, astats = self.agent_loop.run(prompts, n, batch=base, group_base=base)
            agent = astats.metrics("agent", self.rollout.num_engines)
        else:
            sampling = {**sampling_params(self.cfg.rollout, n), "seed": self.request_seed(base)}
            outs = self.rollout.generate([p.token_ids for p in prompts], sampling)
            samples = [
                build_sample(p, c, group_id=base + i)
                for i, (p, comps) in enumerate(zip(prompts, outs, strict=True))
                for c in comps
            ]
        stats = generation_stats(samples)
        stats.agent = agent
        return samples, stats

    @property
    def agent_loop(self) -> AgentLoop | None:
        """Runs the multi-turn trajectories (None: single-turn), built for the current ``env_factory``."""
        if self.env_factory is None:
            return None
        if self._agent is None or self._agent[0] is not self.env_factory:
            self._agent = (self.env_factory, self._agent_loop())
        return self._agent[1]

    def _agent_loop(self) -> AgentLoop:
        from rlhf.agents.loop import AgentLoop

        r, e = self.cfg.rollout, self.cfg.env
        return AgentLoop(
            self.rollout,
            self.tok,
            self.env_factory,
            sampling_params(r, 1),
            seed=self.cfg.train.seed,
            max_turns=e.max_turns,
            max_model_len=r.max_model_len,
            max_observation_tokens=e.max_observation_tokens,
            step_timeout_s=e.step_timeout_s,
            max_concurrency=e.max_concurrency,
            # the hf backend serves one call at a time: turn by turn is all it can do
            lockstep=e.loop == "lockstep" or r.backend == "hf",
            tools=getattr(self.env_factory, "tools", None),
            on_template_drift=e.on_template_drift,
        )

    def request_seed(self, group_base: int, turn: int = 0) -> int:
        """Sampling seed of a generate call, a function of (train.seed, batch, turn) only: a run
        samples the same tokens whether its engines were restarted, resumed or run ahead."""
        return (self.cfg.train.seed * 1_000_003 + group_base * 1_009 + turn * 7_919) % (2**31 - 1)

    def score(self, samples: list[Sample], stats: RolloutStats) -> list[Sample]:
        """:meth:`assign_rewards` then :meth:`score_models`; returns the samples kept."""
        return self.score_models(self.assign_rewards(samples, stats))

    def assign_rewards(self, samples: list[Sample], stats: RolloutStats) -> list[Sample]:
        """Fill ``score``: reward (environment, model or function), clip, overlong shaping.

        Returns the samples kept: with ``reward.non_finite=drop`` samples whose score is NaN or
        inf are removed (and counted in ``stats``); with ``error`` such a score fails the step
        before any model is updated.
        """
        errored: set[int] = set()
        scores = self.rewards(samples, stats, errored)
        bad = set(non_finite_indices(scores))
        if bad:
            # under reward.on_error=drop a sample whose reward call raised is dropped as asked
            if self.cfg.reward.non_finite == "error" and bad - (
                errored if self.cfg.reward.on_error == "drop" else set()
            ):
                i = min(bad - errored)
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
                raise NoFiniteReward(
                    "every sample in the batch got a non-finite reward (or shares a group with one)"
                )
            samples = [s for i, s in enumerate(samples) if i not in bad]
            scores = [r for i, r in enumerate(scores) if i not in bad]
            stats.dropped_non_finite = len(bad)
        clip = self.cfg.reward.clip
        shaping = self._overlong_shaping(samples)
        for s, r, extra in zip(samples, scores, shaping, strict=True):
            s.score = (max(-clip, min(clip, r)) if clip > 0 else r) + extra
        stats.overlong_penalties = list(shaping)
        return samples

    def _overlong_shaping(self, samples: list[Sample]) -> list[float]:
        """DAPO's overlong penalty per sample (0 when ``algorithm.overlong_buffer_frac=0``), on its
        longest policy turn: ``rollout.max_new_tokens`` limits each turn."""
        max_len = self.cfg.rollout.max_new_tokens
        buffer = self.cfg.algorithm.overlong_buffer_len(max_len)
        if buffer == 0 or not samples:
            return [0.0] * len(samples)
        lengths = torch.tensor([longest_turn(s.action_mask) for s in samples])
        return overlong_penalty(lengths, max_len, buffer, self.cfg.algorithm.overlong_penalty).tolist()

    def score_models(self, samples: list[Sample], engines_busy: int = 0) -> list[Sample]:
        """Fill ``old_logprobs`` (unless ``cfg.old_logprobs_are_current``: the train step takes
        them from its own forward; or ``cfg.old_logprobs_from_rollout``: the engines' stand in),
        ``ref_logprobs`` and ``values`` with the model groups.

        All scoring forwards run at once and split the cores between them and the
        ``engines_busy`` engines generating meanwhile (one-step-off)."""
        # Logprobs at the sampling temperature, as the engine reported them and as the policy
        # loss computes them.
        t = self.cfg.rollout.temperature
        skip_actor = self.cfg.old_logprobs_are_current or self.cfg.old_logprobs_from_rollout
        groups = [
            (name, group, temp)
            for name, group, temp in (
                ("old_logprobs", None if skip_actor else self.actor, t),
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

    def rewards(
        self, samples: list[Sample], stats: RolloutStats, errored: set[int] | None = None
    ) -> list[float]:
        """Per sample: the environment's reward where it gave one, else the reward model/function.
        The samples whose reward call raised (``reward.on_error`` zero or drop) go into ``errored``."""
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
            model_scores, parts, errors, counts = self.reward(
                [s.prompt or "" for s in todo],
                [
                    s.final_response
                    if s.final_response is not None
                    else self.tok.decode(s.input_ids[s.prompt_len or 0 :].tolist())
                    for s in todo
                ],
                [s.info for s in todo],
            )
            stats.reward_errors += len(errors)
            add_counts(stats.reward_counts, counts)
            if errored is not None:
                errored.update(rest[i] for i in errors)
            if parts:  # one function too: reward/<fn> names what scored the run
                stats.reward_parts = {k: list(v) for k, v in parts.items()}
        for i, r in zip(rest, model_scores, strict=True):
            scores[i] = r
        return [float(r) for r in scores]
