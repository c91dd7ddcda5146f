"""The agent loop: trajectories that advance on their own.

Each trajectory is generate -> environment -> generate ... on its own clock: when its turn comes
back from the engine it goes to the environment (a daemon thread, at most ``env.max_concurrency`` at once,
bounded by ``env.step_timeout_s``), and its next turn is submitted as soon as the observation is
ready, while other trajectories are still generating. The engines batch whatever requests are in
flight (``rlhf.workers.continuous``), so one slow tool holds back only its own trajectory.

- Token-in/token-out: the policy's tokens are kept as sampled; observations come from the chat
  template (``ChatDelta``) when the environment returns ``messages``.
- All turns of a trajectory go to one engine (the engine of its prompt: its prefix cache holds
  the conversation so far).
- Seeds are a function of (train.seed, batch, trajectory, turn): the same tokens come back
  whatever the order in which turns finish, after an engine restart or a resume.
- Limits per trajectory: ``env.max_turns`` policy turns, ``rollout.max_model_len`` tokens in
  all (a trajectory ends when the next observation leaves no room for another turn),
  ``rollout.max_new_tokens`` per turn; tool results are cut at ``env.max_tool_output_chars``
  and text observations at ``env.max_observation_tokens``.
- ``env.loop=lockstep`` runs the same work turn by turn over the whole batch (every turn waits
  for the slowest trajectory): the comparison point of ``bench/agent_loop.py``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.agents.bounded import BoundedCalls
from rlhf.agents.chat_delta import ChatDelta, TemplateDriftError
from rlhf.data.prompts import Prompt
from rlhf.data.types import Sample, versions_tensor
from rlhf.envs.base import StepResult, ToolStats

log = logging.getLogger("rlhf")
_IDLE_CHECK_S = 30.0  # with nothing reported for this long, look at the oldest engine call

__all__ = ["AgentLoop", "AgentStats", "trajectory_seed"]


def trajectory_seed(seed: int, batch: int, trajectory: int, turn: int) -> int:
    """Sampling seed of one turn of one trajectory."""
    return (seed * 1_000_003 + batch * 1_009 + trajectory * 7_919 + turn * 104_729) % (2**31 - 1)


@dataclass
class AgentStats:
    trajectories: int = 0
    turns: int = 0
    env_errors: int = 0  # env.step raised: the trajectory ends there
    env_timeouts: int = 0  # env.step past env.step_timeout_s: the trajectory ends there
    template_drift: int = 0  # trajectories the chat template renders differently as a whole
    tools: ToolStats = field(default_factory=ToolStats)
    wall_s: float = 0.0
    engine_busy_s: float = 0.0  # summed over engines, from their step counters

    def add(self, other: AgentStats) -> None:
        """Counts of another group of the same step (a streaming run); times summed."""
        for f in ("trajectories", "turns", "env_errors", "env_timeouts", "template_drift", "engine_busy_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.tools.add(other.tools)

    def metrics(self, prefix: str = "agent", num_engines: int = 1) -> dict[str, float]:
        n = max(self.trajectories, 1)
        return {
            f"{prefix}/turns_mean": self.turns / n,
            f"{prefix}/tool_calls": float(self.tools.calls),
            f"{prefix}/tool_errors": float(self.tools.errors),
            f"{prefix}/tool_timeouts": float(self.tools.timeouts),
            f"{prefix}/malformed_calls": float(self.tools.malformed),
            f"{prefix}/tool_time_s": self.tools.time_s,
            f"{prefix}/env_errors": float(self.env_errors + self.env_timeouts),
            f"{prefix}/template_drift": float(self.template_drift),
            f"{prefix}/engine_busy_fraction": self.engine_busy_s / max(self.wall_s * num_engines, 1e-9),
        }


class _Trajectory:
    def __init__(self, index: int, prompt: Prompt, group_id: int, engine: int, env: Any, ids: list[int]):
        self.index, self.prompt, self.group_id, self.engine, self.env = index, prompt, group_id, engine, env
        self.ids, self.mask, self.lp = list(ids), [False] * len(ids), [0.0] * len(ids)
        self.versions: list[int | None] = [None] * len(ids)
        self.prompt_len = len(ids)
        self.turn, self.done, self.env_reward, self.finish_reason = 0, False, None, None
        self.sampling: dict[str, Any] = {}  # the engine sampling of its turns (training or evaluation)
        self.final_response: str | None = None
        self.has_logprobs = True
        # the conversation so far, and where each part starts (the drift check at the end)
        self.messages: list[dict] | None = list(prompt.messages) if prompt.messages is not None else None
        self.parts: list[tuple[int, str]] = [(0, "the prompt (system and user turns)")]
        self.unterminated: list[int] = []  # ends of turns cut before their end-of-turn token
        self.drift: str | None = None

    def append(
        self, ids: list[int], logprobs: list[float] | None, action: bool, versions: list[int] | None = None
    ) -> None:
        self.ids += ids
        self.versions += list(versions) if versions else [None] * len(ids)
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
            prompt_len=self.prompt_len,
            env_reward=self.env_reward,
            finish_reason=self.finish_reason,
            final_response=self.final_response,
            turns=self.turn,
            token_versions=versions_tensor(self.versions),
            info=dict(self.prompt.info),
        )


class AgentLoop:
    """Runs multi-turn trajectories on a ``RolloutPool`` (see the module docstring).

    Args:
        pool: the rollout engines (``submit_turn``/``turn_result``).
        tokenizer: the policy's tokenizer (decodes turns; renders observations).
        env_factory: a fresh environment per trajectory.
        sampling: the engine sampling dict of one turn (``n`` is 1 here).
        seed: ``train.seed``.
        max_turns, max_model_len, max_observation_tokens, step_timeout_s, max_concurrency,
        lockstep: ``env.*`` / ``rollout.*`` settings.
        tools: tool schemas rendered into the prompt (``apply_chat_template(tools=...)``).
        on_template_drift: ``env.on_template_drift``: a trajectory whose tokens are not the
            template's rendering of its whole conversation fails the step (``error``, after
            every trajectory ended, before any update) or leaves out its group (``drop``);
            evaluation keeps it. Counted in ``agent/template_drift``.
    """

    def __init__(
        self,
        pool: Any,
        tokenizer: Any,
        env_factory: Callable[[], Any],
        sampling: dict[str, Any],
        seed: int,
        max_turns: int,
        max_model_len: int,
        max_observation_tokens: int,
        step_timeout_s: float,
        max_concurrency: int,
        lockstep: bool = False,
        tools: list[dict] | None = None,
        on_template_drift: str = "error",
    ):
        self.pool, self.tok, self.env_factory = pool, tokenizer, env_factory
        self.sampling = {**sampling, "n": 1}
        self.seed, self.max_turns, self.max_len = seed, max_turns, max_model_len
        self.max_obs, self.step_timeout_s, self.lockstep = max_observation_tokens, step_timeout_s, lockstep
        self.threads = BoundedCalls(max_concurrency, "env")
        self.delta = ChatDelta(tokenizer, tools) if getattr(tokenizer, "chat_template", None) else None
        self.on_template_drift = on_template_drift

    # ---------------------------------------------------------------- the run
    def run(
        self,
        prompts: list[Prompt],
        n: int,
        batch: int,
        group_base: int,
        sampling: dict[str, Any] | None = None,
    ) -> tuple[list[Sample], AgentStats]:
        """``n`` trajectories per prompt; their samples in (prompt, sample) order. ``sampling``
        overrides the training sampling for this run (evaluation: greedy, its own token limit);
        seeds still come from ``trajectory_seed``."""
        t0, stats = time.perf_counter(), AgentStats()
        busy0 = self._engine_busy()
        trajs = self._start(prompts, n, group_base, {**self.sampling, **(sampling or {}), "n": 1})
        stats.trajectories = len(trajs)
        self.pool.begin_calls()
        if self.lockstep:
            self._run_lockstep(trajs, batch, stats)
        else:
            self._run_independent(trajs, batch, stats)
        stats.wall_s = time.perf_counter() - t0
        stats.engine_busy_s = self._engine_busy() - busy0
        stats.turns = sum(t.turn for t in trajs)
        trajs = self._handle_drift(trajs, stats, training=sampling is None)
        return [t.to_sample() for t in trajs], stats

    def run_group(
        self, prompt: Prompt, n: int, batch: int, group_id: int, first_index: int, engine: int
    ) -> tuple[list[Sample], AgentStats]:
        """One prompt's ``n`` trajectories with the training sampling (a streaming run: many
        groups at once, each on its own thread). Trajectory ``k`` has index ``first_index + k``
        (its seeds: the same as in the batch of ``run`` it would belong to); all its turns go to
        ``engine``. The engine-restart budget is the caller's (``RolloutPool.reset_restart_budget``)."""
        t0, stats = time.perf_counter(), AgentStats()
        trajs = self._start([prompt], n, group_id, self.sampling, first_index, engine=engine)
        stats.trajectories = len(trajs)
        self._run_independent(trajs, batch, stats)
        stats.wall_s = time.perf_counter() - t0
        stats.turns = sum(t.turn for t in trajs)
        trajs = self._handle_drift(trajs, stats, training=True)
        return [t.to_sample() for t in trajs], stats

    def _handle_drift(self, trajs: list[_Trajectory], stats: AgentStats, training: bool) -> list[_Trajectory]:
        """Check each trajectory against the rendering of its whole conversation (one render each)
        and apply ``on_template_drift`` to those that differ."""
        for t in trajs:
            if t.drift is None and self.delta is not None and t.messages is not None:
                t.drift = self.delta.drift(t.ids, t.messages, t.parts, t.unterminated)
        drifted = [t for t in trajs if t.drift is not None]
        stats.template_drift = len(drifted)
        if not drifted or not training:
            return trajs
        if self.on_template_drift == "error":
            raise TemplateDriftError(
                f"{len(drifted)} of {len(trajs)} trajectories are not what the chat template renders for their "
                f"conversation; trajectory {drifted[0].index}: {drifted[0].drift}. Nothing was trained on them. "
                "Use a template that renders each turn independently of later ones, or set "
                "env.on_template_drift=drop to leave such trajectories (and their groups) out"
            )
        groups = {t.group_id for t in drifted}
        kept = [t for t in trajs if t.group_id not in groups]
        log.warning(
            "%d trajectories drifted from the chat template's rendering (%s); dropping their %d groups "
            "(env.on_template_drift=drop)",
            len(drifted),
            drifted[0].drift,
            len(groups),
        )
        if not kept:
            raise TemplateDriftError(
                f"every trajectory of the batch drifted from the chat template: {drifted[0].drift}"
            )
        return kept

    def _start(
        self,
        prompts: list[Prompt],
        n: int,
        group_base: int,
        sampling: dict[str, Any],
        first_index: int = 0,
        engine: int | None = None,
    ) -> list[_Trajectory]:
        trajs = []
        for i, p in enumerate(prompts):
            for _ in range(n):
                env = self.env_factory()
                env.reset(p.text, dict(p.info))
                # p.token_ids already hold the tool schemas (load_prompts(tools=...))
                e = (i if engine is None else engine) % self.pool.num_engines
                t = _Trajectory(first_index + len(trajs), p, group_base + i, e, env, p.token_ids)
                t.sampling = sampling
                trajs.append(t)
        return trajs

    def _submit(self, t: _Trajectory, batch: int) -> Any:
        sampling = {**t.sampling, "seed": trajectory_seed(self.seed, batch, t.index, t.turn)}
        return self.pool.submit_turn(t.engine, t.ids, sampling)

    def _run_independent(self, trajs: list[_Trajectory], batch: int, stats: AgentStats) -> None:
        # Event-driven: engine replies and env steps report on one queue as they finish, so a
        # trajectory's next step starts at once (a poll, e.g. ray.wait with a timeout, would
        # delay each turn of the slowest trajectory by up to its period).
        finished: queue.SimpleQueue = queue.SimpleQueue()
        gen: dict[Any, tuple[_Trajectory, float]] = {}  # engine ref -> (trajectory, submitted)
        envs: dict[Future, tuple[_Trajectory, float]] = {}  # env step -> (trajectory, deadline)

        def generate(t: _Trajectory) -> None:
            ref = self._submit(t, batch)
            gen[ref] = (t, time.monotonic())
            ref.future().add_done_callback(lambda _, ref=ref: finished.put(ref))

        def step_env(t: _Trajectory, comp: dict) -> None:
            fut = self.threads.submit(t.env.step, self._decode_turn(t, comp))
            envs[fut] = (t, time.monotonic() + self.step_timeout_s)
            fut.add_done_callback(finished.put)

        for t in trajs:
            generate(t)
        while gen or envs:
            now = time.monotonic()
            wake = min((d for _, d in envs.values()), default=now + _IDLE_CHECK_S)
            try:
                key = finished.get(timeout=max(wake - now, 0.0))
            except queue.Empty:
                key = self._overdue(gen, envs)
                if key is None:
                    continue
            if key in gen:
                t, _ = gen.pop(key)
                comp = self.pool.turn_result(t.engine, key, lambda t=t: self._submit(t, batch))
                if self._after_generation(t, comp):
                    step_env(t, comp)
            elif key in envs:  # not already ended by its deadline
                t, _ = envs.pop(key)
                if self._after_env(t, key, stats):
                    generate(t)

    def _overdue(self, gen: dict, envs: dict) -> Any:
        """Something to act on when nothing reported: an env step past its deadline (it ends as
        a timeout); with no env step pending, an engine call silent for ``_IDLE_CHECK_S`` (a hung
        engine: ``turn_result`` then waits at most the pool's call timeout)."""
        now = time.monotonic()
        if envs:
            return next((f for f, (_, d) in envs.items() if d <= now), None)
        return next((r for r, (_, t0) in gen.items() if now - t0 >= _IDLE_CHECK_S), None)

    def _run_lockstep(self, trajs: list[_Trajectory], batch: int, stats: AgentStats) -> None:
        live = list(trajs)
        while live:
            refs = [(t, self._submit(t, batch)) for t in live]
            comps = [
                (t, self.pool.turn_result(t.engine, r, lambda t=t: self._submit(t, batch))) for t, r in refs
            ]
            stepping = [
                (t, self.threads.submit(t.env.step, self._decode_turn(t, c)))
                for t, c in comps
                if self._after_generation(t, c)
            ]
            deadline = time.monotonic() + self.step_timeout_s
            for _, fut in stepping:
                while not fut.done() and time.monotonic() < deadline:
                    time.sleep(0.001)
            live = [t for t, fut in stepping if self._after_env(t, fut, stats)]

    # ---------------------------------------------------------------- one trajectory's steps
    def _decode_turn(self, t: _Trajectory, comp: dict) -> str:
        text = self.tok.decode(comp["token_ids"], skip_special_tokens=True)
        t.final_response = text
        return text

    def _after_generation(self, t: _Trajectory, comp: dict) -> bool:
        """Append the turn; True if the environment should answer it."""
        t.parts.append((len(t.ids), f"assistant turn {t.turn + 1}"))
        t.append(comp["token_ids"], comp["logprobs"], action=True, versions=comp.get("versions"))
        if t.messages is not None and self.delta is not None:
            t.messages.append(
                {"role": "assistant", "content": self.delta.assistant_content(comp["token_ids"])}
            )
        t.turn += 1
        t.finish_reason = comp.get("finish_reason")
        # a turn cut at max_new_tokens still goes to the environment: it decides (e.g. a malformed call)
        ended = t.turn >= self.max_turns or len(t.ids) >= self.max_len - 1
        if ended:
            t.done = True
            t.final_response = self.tok.decode(comp["token_ids"], skip_special_tokens=True)
        return not ended

    def _after_env(self, t: _Trajectory, fut: Future, stats: AgentStats) -> bool:
        """Append the observation; True if the trajectory goes on."""
        if not fut.done():
            self.threads.abandon(fut)
            stats.env_timeouts += 1
            log.warning(
                "env.step of trajectory %d took over env.step_timeout_s=%g s: it ends there",
                t.index,
                self.step_timeout_s,
            )
            t.done = True
            return False
        try:
            res: StepResult = fut.result()
        except Exception as e:  # noqa: BLE001 - user code: reported, the run goes on
            stats.env_errors += 1
            log.warning(
                "env.step of trajectory %d raised %s: %s; it ends there", t.index, type(e).__name__, e
            )
            t.done = True
            return False
        if res.tools is not None:
            stats.tools.add(res.tools)
        if res.done:
            t.done, t.env_reward = True, res.reward
            return False
        try:
            obs = self._observation_tokens(res)
        except TemplateDriftError as e:  # e.g. the template's date changed: the trajectory ends
            t.done, t.drift = True, str(e)
            return False
        if len(obs) >= self.max_len - 1 - len(t.ids):
            t.done = True  # no room for another policy turn
            return False
        if self.delta is not None and t.mask[-1] and t.ids[-1] != self.delta.end_of_turn:
            t.unterminated.append(len(t.ids))
        t.parts.append((len(t.ids), f"the observation after assistant turn {t.turn}"))
        t.append(obs, None, action=False)
        if t.messages is not None:
            if res.messages is None:
                t.messages = None  # a text observation: no conversation to render, no check
            else:
                t.messages.extend(res.messages)
        return True

    def _observation_tokens(self, res: StepResult) -> list[int]:
        if res.messages is not None:
            if self.delta is None:
                raise ValueError("the environment returned messages but the tokenizer has no chat template")
            return self.delta.observation(res.messages)  # bounded by env.max_tool_output_chars
        return list(self.tok(res.observation, add_special_tokens=False)["input_ids"])[: self.max_obs]

    def _engine_busy(self) -> float:
        try:
            return self.pool.busy_s()
        except Exception:  # noqa: BLE001 - a metric only
            return 0.0

    def close(self) -> None:
        pass  # nothing to join: a hung env step's daemon thread is abandoned (BoundedCalls)
