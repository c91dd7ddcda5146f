"""The PPO/GRPO/REINFORCE++/RLOO driver: a thin ``fit()`` over named steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from rlhf.algorithms.masking import masked_mean
from rlhf.config.schema import PPOConfig
from rlhf.data.packing import concat, plan_bins
from rlhf.data.prompts import Prompt, PromptLoader
from rlhf.data.types import Sample
from rlhf.rewards import Reward
from rlhf.trainer.advantage_step import advantage_step
from rlhf.trainer.checkpoint import latest_checkpoint, load_latest, save_checkpoint, save_final
from rlhf.trainer.dynamic_sampling import collect_informative_groups
from rlhf.trainer.engine_sync import EngineSync
from rlhf.trainer.evaluation import Evaluator
from rlhf.trainer.experience import ExperienceMaker, RolloutStats
from rlhf.trainer.group_rollout import GroupRollout
from rlhf.trainer.objectives import PolicyObjective, ValueObjective
from rlhf.trainer.rollout_pipeline import RolloutPipeline
from rlhf.trainer.run_control import CheckpointPolicy, GracefulStop, Preempted, resolve_resume
from rlhf.trainer.run_output import RunOutput
from rlhf.trainer.streaming import StreamingRollouts, staleness_metrics
from rlhf.trainer.timing import PhaseTimer
from rlhf.trainer.tracking import Tracker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf.trainer.setup import Workers

log = logging.getLogger("rlhf")
PENDING_ROLLOUTS = "pending_rollouts"


def packing_metrics(samples: list[Sample], budget: int, sequence_parallel_size: int = 1) -> dict[str, float]:
    """Packed rows hold only real tokens, so the padding a trainer would waste is reported as
    ``left_pad_fraction``: the share of pads in one left-padded batch of the same samples
    (OpenRLHF/DeepSpeed-Chat layout). ``budget_fill`` is how full the packed rows are;
    ``pad_fraction`` the share of pads in the rows the model runs (a row split over ``k``
    sequence-parallel ranks is padded to a multiple of ``k``; none otherwise)."""
    lens = [len(s) for s in samples]
    prompt = max(s.response_start for s in samples)
    resp = max(len(s) - s.response_start for s in samples)
    bins = plan_bins(lens, budget)
    real = sum(lens)
    k = sequence_parallel_size
    pads = sum(-sum(lens[i] for i in b) % k for b in bins)
    return {
        "packing/pad_fraction": pads / (real + pads),
        "packing/left_pad_fraction": 1.0 - real / (len(samples) * (prompt + resp)),
        "packing/budget_fill": real / (len(bins) * budget),
        "packing/micro_batches": float(len(bins)),
    }


class PPOTrainer:
    """Runs ``train.num_steps`` RL steps with the given workers (see ``setup.build_workers``)."""

    def __init__(
        self,
        cfg: PPOConfig,
        workers: Workers,
        tokenizer: PreTrainedTokenizerBase,
        loader: PromptLoader,
        reward_fn: Reward | Callable | None = None,
        env_factory: Callable | None = None,
        eval_prompts: list[Prompt] | None = None,
    ):
        self.cfg, self.w, self.tok, self.loader = cfg, workers, tokenizer, loader
        # A critic group may exist (shared workers, resumed runs) while the estimator needs none.
        self.critic = workers.critic if cfg.algorithm.uses_critic else None
        self.maker = ExperienceMaker(
            cfg,
            tokenizer,
            workers.rollout,
            workers.actor,
            workers.reference,
            self.critic,
            workers.reward_model,
            reward_fn,
            env_factory,
        )
        a = cfg.algorithm
        self.policy_objective = PolicyObjective(
            policy_loss=a.policy_loss,
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip or None,
            kl_coef_in_loss=0.0 if a.kl_in_reward or workers.reference is None else a.kl_coef,
            kl_kind=a.kl_kind,
            kl_clamp=a.kl_clamp or None,
            entropy_coef=a.entropy_coef,
            temperature=cfg.rollout.temperature,
            aggregation=a.loss_aggregation,
        )
        self.evaluator = (
            Evaluator(self.maker, eval_prompts, cfg.eval, cfg.rollout.max_new_tokens)
            if eval_prompts
            else None
        )
        self.value_objective = ValueObjective(clip_eps=a.value_clip or None, aggregation=a.loss_aggregation)
        self.out = RunOutput(cfg.train.output_dir)
        self.step = 0
        self.pipeline: RolloutPipeline | StreamingRollouts | None = None
        self.threaded_rollouts: bool | None = None  # None: a producer thread iff max_staleness >= 1
        # generated ahead (batch mode) or the stream's state, restored from a checkpoint
        self.pending_rollouts: list = []
        self.run_metrics: dict[str, float] = {}  # constants of the run logged with every step
        self.timer = PhaseTimer()
        self.engine_sync = EngineSync(cfg, workers.rollout, workers.actor)

    def fit(self) -> list[dict]:
        """generate -> score -> advantages -> train -> sync weights, once per step; with
        ``train.max_staleness >= 1`` generation runs ahead on a producer thread. Returns the
        run's metric rows (those of the steps before a resume included).

        Raises:
            Preempted: SIGTERM/SIGINT arrived; the checkpoint was written first.
        """
        t = self.cfg.train
        if resolve_resume(self.out.location, t.resume) is not None:
            self.out.pull()
            self.try_resume()
        tracker = Tracker(
            str(self.out.local), t.num_steps, t.tensorboard, t.wandb_project, asdict(self.cfg), self.step
        )
        self.pipeline = self.make_pipeline().start()
        policy = CheckpointPolicy(t.save_every, t.save_every_min)
        try:
            with GracefulStop(t.stop_grace_s, lambda: str(latest_checkpoint(self.out.location))) as stop:
                if self.evaluator is not None and self.step == 0:
                    tracker.log(self.step, self.evaluate(), advance=False)  # the starting point
                while self.step < t.num_steps:
                    self.step_once(tracker, stop)
                    if policy.due(self.step, self.step == t.num_steps, stop.requested is not None):
                        self.save()
                        policy.saved()
                    if stop.requested is not None and self.step < t.num_steps:
                        stop.finished()
                        raise Preempted(stop.requested, self.step, latest_checkpoint(self.out.location))
                save_final(self.w.actor, self.out.location, self.cfg.model.lora.enabled, t.save_merged)
                self.out.publish(self._all_groups(), self.w.rollout)
        finally:
            self.pipeline.close()
            tracker.close()
        return tracker.history

    def make_pipeline(self) -> RolloutPipeline | StreamingRollouts:
        """Where the steps' samples come from: whole batches (``train.mode=batch``, generated
        ahead up to ``max_staleness`` steps) or a stream of prompt groups (``streaming``)."""
        t = self.cfg.train
        # the engines hold the weights of this step (synced on resume): their tokens say so
        self.w.rollout.set_version(self.step)
        if self.w.rollout.concurrent:  # vLLM engines: the mode decides how weights land
            streaming, r = t.mode == "streaming", self.cfg.rollout
            self.w.rollout.set_inflight_updates(streaming and r.inflight_updates)
            self.w.rollout.set_partial_rollouts(streaming and r.partial_rollouts)
        # Generating alone (the trainer waits for the batch), the engines share the node's cores;
        # next to training (one-step-off, streaming), each keeps the CPUs Ray gave it.
        busy = self.engines_busy_while_training()
        self.w.rollout.set_cpu_share(0.0 if busy else 1.0 / self.w.rollout.num_engines)
        if t.mode == "batch":
            return RolloutPipeline(
                self.collect,
                t.max_staleness,
                self.step,
                t.num_steps,
                timeout_s=t.rollout_timeout_s,
                threaded=self.threaded_rollouts,
                pending=self.pending_rollouts,
            )
        pool, a = self.w.rollout, self.cfg.algorithm
        _ = self.maker.agent_loop  # built once here, not by the first group threads at once
        return StreamingRollouts(
            GroupRollout(self.cfg, self.maker, pool),
            self.loader.next_batch,
            t.rollout_batch_size,
            t.max_staleness,
            self.cfg.rollout.max_in_flight,
            pool.num_engines,
            self.step,
            t.num_steps,
            timeout_s=t.rollout_timeout_s,
            engine_busy=pool.busy_s,
            dynamic_sampling_rounds=a.dynamic_sampling_max_rounds if a.dynamic_sampling else 0,
            group_stride=a.dynamic_sampling_max_rounds * t.rollout_batch_size,  # as collect() numbers them
            pending=self.pending_rollouts,
        )

    def step_once(self, tracker: Tracker, stop: GracefulStop) -> None:
        """One training step and its metrics row; with a stop requested before training
        starts, the step's batch is set aside for the checkpoint instead."""
        with self.timer.phase("step", {}):
            metrics = self.run_step(stop)
        if metrics is None:
            return
        self.step += 1
        if self.evaluator is not None and self.eval_due():
            metrics.update(self.evaluate())
        metrics["rollout/engine_restarts"] = float(sum(self.w.rollout.restarts))
        tracker.log(self.step, {**metrics, **self.run_metrics})

    def run_step(self, stop: GracefulStop | None = None) -> dict[str, float] | None:
        """take the step's batch -> score -> advantages -> train -> sync weights; returns metrics
        (None: a stop was requested, the batch waits in the pipeline for the checkpoint)."""
        t0 = time.perf_counter()
        batch, trainer_wait = self.pipeline.get(self.step)
        if stop is not None and stop.requested is not None:
            self.pipeline.set_aside(batch)
            return None
        samples = batch.samples
        metrics = {
            **batch.metrics,
            "time/trainer_wait_s": trainer_wait,
            "rollout/staleness_mean": float(self.step - batch.weight_version),
        }
        if isinstance(self.pipeline, StreamingRollouts):
            self.w.rollout.reset_restart_budget()  # rollout.max_restarts holds per step
        if not samples:
            # Dynamic sampling found no informative group within its round cap: nothing to learn
            # from, so no update, and the run goes on (the metrics say so).
            log.warning("step %d: no group with differing rewards; skipping the update", self.step + 1)
            metrics["dynamic_sampling/skipped_update"] = 1.0
            # the weights stay: the engines' are version step + 1 as they are
            relabel = lambda: self.w.rollout.set_version(self.step + 1)  # noqa: E731
            metrics["time/sync_wait_s"] = self.pipeline.sync(relabel, self.step + 1)
            metrics["time/engine_wait_s"] = self.pipeline.take_engine_idle()
            metrics["time/step_s"] = time.perf_counter() - t0
            return metrics
        for s in samples:
            if s.weight_version is None:  # engines that report no per-token versions
                s.weight_version = batch.weight_version
        metrics.update(staleness_metrics(samples, self.step))
        self.engine_sync.release()
        with self.timer.phase("score", metrics):
            samples = self.maker.score_models(samples, self.engines_busy_while_training())
        gap = logprob_gap(samples)  # before the behaviour log-probs replace the trainer's
        self.use_behaviour_policy(samples)
        with self.timer.phase("advantage", metrics):
            metrics.update(advantage_step(samples, self.cfg.algorithm))
        with self.timer.phase("train", metrics):
            metrics.update(self.train(samples))
        # The trainer's waits: for its batch (trainer_wait_s) and for the engines to be free
        # (sync_wait_s); the engines' wait: idle between generations (engine_wait_s).
        metrics["time/sync_wait_s"] = self.pipeline.sync(
            lambda: self.sync_weights(self.step + 1, metrics), self.step + 1
        )
        metrics["time/engine_wait_s"] = self.pipeline.take_engine_idle()
        elapsed = time.perf_counter() - t0
        metrics.update(
            self.rollout_metrics(
                samples, batch.stats, self.cfg.train.max_tokens_per_microbatch, self.w.actor.sp_size
            )
        )
        if gap is not None:
            metrics["rollout/logprob_gap"] = gap
        metrics.update({"time/step_s": elapsed, "perf/tokens_per_s": sum(len(s) for s in samples) / elapsed})
        metrics["time/orchestration_s"] = elapsed - self._accounted(metrics)
        return metrics

    def _accounted(self, m: dict[str, float]) -> float:
        """Seconds of the step spent in timed phases or waiting for the engines."""
        own = sum(m.get(f"time/{p}_s", 0.0) for p in ("score", "advantage", "train", "sync"))
        if self.pipeline.threaded:  # generation ran on the producer thread: the trainer only waited
            return own + m["time/trainer_wait_s"] + m["time/sync_wait_s"]
        return own + m.get("time/generate_s", 0.0) + m.get("time/reward_s", 0.0) + m["time/sync_wait_s"]

    def engines_busy_while_training(self) -> int:
        """Engines generating while the groups score and train (one-step-off, streaming), which
        share the cores."""
        t = self.cfg.train
        return self.w.rollout.num_engines if t.max_staleness > 0 or t.mode == "streaming" else 0

    def eval_due(self) -> bool:
        every = self.cfg.eval.every
        return self.step == self.cfg.train.num_steps or (every > 0 and self.step % every == 0)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics with the weights the engines hold (between two generations)."""
        with self.pipeline.engine_lock:
            return self.evaluator.run()

    def use_behaviour_policy(self, samples: list[Sample]) -> None:
        """Samples generated by older weights: the PPO ratio's denominator is the policy that
        generated them (the engine's logprobs), not the current one.

        With ``algorithm.rollout_correction`` set, ``old_logprobs`` stay the current policy's
        (the proximal policy of decoupled PPO) and the TIS/MIS weight corrects from the engine
        to it, staleness included.
        """
        if self.cfg.algorithm.rollout_correction != "none":
            return
        every = self.cfg.old_logprobs_from_rollout  # train.recompute_old_logprobs=false: no scoring forward
        for s in samples:
            if not every and (s.weight_version is None or s.weight_version >= self.step):
                continue
            if s.rollout_logprobs is None:
                why = "train.recompute_old_logprobs=false" if every else "train.max_staleness >= 1"
                raise ValueError(
                    f"{why} makes the engines' logprobs of every sampled token (rollout_logprobs) the PPO "
                    "ratio's denominator; this batch has none"
                )
            kept = torch.zeros_like(s.rollout_logprobs) if s.old_logprobs is None else s.old_logprobs
            s.old_logprobs = torch.where(s.action_mask, s.rollout_logprobs, kept)

    def collect(self, step: int) -> tuple[list[Sample], RolloutStats, dict[str, float]]:
        """Step ``step``'s rewarded samples: one batch of prompts, or with ``algorithm.dynamic_sampling``
        as many rounds as it takes to hold ``train.rollout_batch_size`` informative groups."""
        a, batch_size = self.cfg.algorithm, self.cfg.train.rollout_batch_size
        total = RolloutStats()

        times: dict[str, float] = {}

        def one_round(r: int) -> list[Sample]:
            nonlocal total
            # Distinct group ids per round: groups of different rounds must never merge.
            base = (step * a.dynamic_sampling_max_rounds + r) * batch_size
            with self.timer.phase("generate", times):
                samples, rstats = self.maker.generate(self.loader.next_batch(), step, group_base=base)
            with self.timer.phase("reward", times):
                samples = self.maker.assign_rewards(samples, rstats)
            total = total.merge(rstats)
            return samples

        if not a.dynamic_sampling:
            return one_round(0), total, times
        samples, ds = collect_informative_groups(one_round, batch_size, a.dynamic_sampling_max_rounds)
        if ds.shortfall:
            log.warning(
                "step %d: %d of %d groups informative after %d rounds (algorithm.dynamic_sampling_max_rounds); "
                "training on what there is",
                step + 1,
                ds.groups_kept,
                batch_size,
                ds.rounds,
            )
        return samples, total, {**ds.metrics(), **times}

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """PPO epochs over packed micro-batches for the actor (and the critic for GAE)."""
        t = self.cfg.train
        stats: dict[str, float] = {}
        for epoch in range(t.ppo_epochs):
            # Mini-batches are cut in order, so shuffle: otherwise each optimizer step would see
            # only a few prompts' groups, the same ones in every epoch.
            g = torch.Generator().manual_seed(t.seed * 100_003 + self.step * 101 + epoch)
            samples = [samples[i] for i in torch.randperm(len(samples), generator=g).tolist()]
            # Each group trains alone: its ranks share the cores with the engines generating meanwhile.
            busy = self.engines_busy_while_training()
            if self.critic is not None:
                cstats = self.critic.train(
                    samples,
                    self.value_objective,
                    t.max_tokens_per_microbatch,
                    t.num_minibatches,
                    cpu_share=1.0 / (self.critic.num_ranks + busy),
                )
                stats.update({f"critic/{k}": v for k, v in cstats.items()})
            astats = self.w.actor.train(
                samples,
                self.policy_objective,
                t.max_tokens_per_microbatch,
                t.num_minibatches,
                cpu_share=1.0 / (self.w.actor.num_ranks + busy),
            )
            steps = stats.get("policy/num_optimizer_steps", 0.0) + astats["num_optimizer_steps"]
            stats.update({f"policy/{k}": v for k, v in astats.items()})
            stats["policy/num_optimizer_steps"] = steps  # over all epochs; the rest is the last epoch's
        # Measured by the train step's forward when the scorer skipped the actor (old_logprobs_are_current).
        for mine, name in (("policy/kl_before_update", "kl"), ("policy/logprob_gap", "rollout/logprob_gap")):
            if mine in stats:
                stats[name] = stats.pop(mine)
        return stats

    def sync_weights(self, version: int, metrics: dict[str, float] | None = None) -> None:
        """The actor's weights (``version``: optimizer steps so far) to the engines."""
        with self.timer.phase("sync", {} if metrics is None else metrics):
            self.engine_sync.push(version)

    @staticmethod
    def rollout_metrics(
        samples: list[Sample], rstats: RolloutStats, budget: int, sequence_parallel_size: int = 1
    ) -> dict[str, float]:
        scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
        m = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(samples) > 1 else 0.0,
            "rollout/num_samples": float(len(samples)),
            "response/length_mean": float(
                torch.tensor([s.num_actions for s in samples], dtype=torch.float32).mean()
            ),
            "rollout/empty_responses": rstats.empty_responses,
            "rollout/truncated": rstats.truncated,
            "rollout/dropped_non_finite": rstats.dropped_non_finite,
            "reward/errors": float(rstats.reward_errors),
            "reward/overlong_penalty_mean": rstats.overlong_penalty_mean,
            **{f"reward/{k}": v for k, v in rstats.reward_components.items()},
            **{f"reward/{k}": float(v) for k, v in rstats.reward_counts.items()},
            **rstats.agent,
            # Multi-turn: tokens the environment inserted after the policy's first turn.
            "rollout/observation_tokens_mean": sum(len(s) - s.response_start - s.num_actions for s in samples)
            / len(samples),
        }
        m.update(packing_metrics(samples, budget, sequence_parallel_size))
        return m

    # -- checkpoints ----------------------------------------------------------------------
    def _trained_groups(self) -> dict:
        return {"actor": self.w.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def _all_groups(self) -> list:
        w = self.w
        return [g for g in (w.actor, w.reference, w.critic, w.reward_model) if g is not None]

    def save(self) -> str:
        """Actor/critic DeepSpeed checkpoints, step, data position and the batches generated
        ahead but not trained on yet (``max_staleness >= 1``); updates ``latest``."""
        pending = self.pipeline.drain()
        try:
            state = {"step": self.step, "loader": self.loader.state_dict()}
            blobs = {PENDING_ROLLOUTS: pending} if pending else {}
            keep = self.cfg.train.keep_checkpoints
            path = save_checkpoint(self.out.location, self.step, self._trained_groups(), state, blobs, keep)
            self.out.publish(self._all_groups(), self.w.rollout)
            return path
        finally:
            self.pipeline.resume()

    def try_resume(self) -> bool:
        """Restore the latest checkpoint, if any: models, step, data position, pending rollouts."""
        ckpt = load_latest(self.out.location, self._trained_groups(), blobs=(PENDING_ROLLOUTS,))
        if ckpt is None:
            return False
        self.step = int(ckpt.state["step"])
        self.loader.load_state_dict(ckpt.state["loader"])
        self.pending_rollouts = ckpt.blobs.get(PENDING_ROLLOUTS, [])
        self.sync_weights(self.step)
        return True


def logprob_gap(samples: list[Sample]) -> float | None:
    """Engine vs trainer log-prob gap (token mean of ``|rollout - old|``), None when either is
    missing. Large values mean the weight sync or the sampling is off (~1e-7 when right).
    Under ``train.max_staleness >= 1`` it is taken before ``use_behaviour_policy`` replaces the
    trainer's log-probs with the engine's (after that it would be 0 by construction); the samples
    of older versions then add that policy change to it."""
    batch = concat(samples)
    if batch.rollout_logprobs is None or batch.old_logprobs is None or not batch.action_mask.any():
        return None
    return float(masked_mean((batch.rollout_logprobs - batch.old_logprobs).abs(), batch.action_mask))
