"""Driver-side pool of vLLM rollout engines: shards prompts, syncs weights, restarts dead engines.

See ``rlhf.workers.rollout`` for the engine, the completion format, logprob and seed rules.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from rlhf.data.packing import shard_bounds
from rlhf.workers.errors import is_process_death
from rlhf.workers.rollout import (
    RolloutEngine,
    RolloutEngineDied,
    RolloutEngineError,
    _per_prompt_seeds,
    check_sampling,
    default_engine_env,
    validate_prompts,
)

log = logging.getLogger("rlhf")
# Calls one engine actor serves at once (each waits in its own thread for its requests).
MAX_CALLS_IN_FLIGHT = 256


class RolloutPool:
    """Driver-side pool of ``RolloutEngine`` Ray actors.

    Args:
        num_engines: number of engines (data parallel; each holds a full copy of the model).
        engine_kwargs: ``RolloutEngine`` arguments (``model_path``, ``max_model_len``, ...).
            Engine ``i`` gets ``seed = engine_kwargs.get("seed", 0) + i``.
        num_cpus_per_engine, num_gpus_per_engine: Ray resources of each actor.
        placement_group, bundle_indices: pin engine ``i`` to bundle ``bundle_indices[i]``
            (default ``i``) of ``placement_group``.
        env_vars: actor env vars; default ``default_engine_env(num_gpus_per_engine)``.
        max_restarts: restarts of one engine within one ``generate``/``update_weights`` call
            before ``RolloutEngineError`` (1 = restart and retry once).
        wait: wait for the engines to start here (else call ``wait_started``).
        keep_last_weights: keep the last synced weights in the object store so a restarted
            engine gets them (costs one model copy of object-store memory). Without it a
            restarted engine would silently serve the initial weights, so restarts are refused.
        engine_cls: the engine class made into actors (``RolloutEngine``, or a subclass of it).
        startup_timeout_s: longest wait for an engine to be scheduled and load the model.
        call_timeout_s: longest wait for one ``generate``/``update_weights`` call of an engine.
    """

    def __init__(
        self,
        num_engines: int,
        engine_kwargs: dict[str, Any],
        num_cpus_per_engine: float = 1,
        num_gpus_per_engine: float = 0,
        placement_group: Any = None,
        bundle_indices: list[int] | None = None,
        env_vars: dict[str, str] | None = None,
        max_restarts: int = 1,
        keep_last_weights: bool = True,
        wait: bool = True,
        engine_cls: type = RolloutEngine,
        startup_timeout_s: float = 300.0,
        call_timeout_s: float = 3600.0,
    ) -> None:
        import ray

        if num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {num_engines}")
        if "model_path" not in engine_kwargs or "max_model_len" not in engine_kwargs:
            raise ValueError("engine_kwargs needs 'model_path' and 'max_model_len' (rollout.max_model_len)")
        if placement_group is not None:
            bundle_indices = list(range(num_engines)) if bundle_indices is None else list(bundle_indices)
            if len(bundle_indices) != num_engines:
                raise ValueError(
                    f"{len(bundle_indices)} bundle_indices for {num_engines} rollout engines; "
                    "give one bundle per engine"
                )
        self.num_engines = num_engines
        self.engine_kwargs = dict(engine_kwargs)
        self.max_model_len = int(engine_kwargs["max_model_len"])
        self.num_cpus_per_engine = num_cpus_per_engine
        self.num_gpus_per_engine = num_gpus_per_engine
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        self.env_vars = default_engine_env(num_gpus_per_engine) if env_vars is None else dict(env_vars)
        self.max_restarts = max_restarts
        self.keep_last_weights = keep_last_weights
        self.startup_timeout_s, self.call_timeout_s = startup_timeout_s, call_timeout_s
        self.restarts = [0] * num_engines
        self.restarts_this_call = [0] * num_engines
        # submit_turn ref -> restarts[engine] when it was sent: a failure of a call sent to an
        # engine that was replaced since is no new death (many turns are in flight on one engine)
        self._turn_sent_to: dict[Any, int] = {}
        self.weight_version = 0
        self._synced = False  # weights other than the model directory's were loaded
        self._weights_ref: Any = None
        # streaming runs wait for many engine calls on many threads: one restart per death
        self._restart_lock = threading.RLock()
        self._settings: dict[str, tuple] = {}  # set_* calls a restarted engine gets again
        self._actor_cls = ray.remote(engine_cls)
        # engines with a ContinuousBatcher serve calls concurrently; the hf backend is lockstep
        self.concurrent = issubclass(engine_cls, RolloutEngine)
        self.engines = [self._create(i) for i in range(num_engines)]
        self._start_refs = [e.ping.remote() for e in self.engines]
        if wait:
            self.wait_started()

    def wait_started(self) -> RolloutPool:
        """Wait for all engines together (they start in parallel); say which one failed or
        what it is waiting for."""
        for i, ref in enumerate(self._start_refs):
            try:
                self._await(ref, self.startup_timeout_s, f"rollout engine {i} to start")
            except Exception as e:
                self.shutdown()
                if isinstance(e, RolloutEngineError):
                    raise
                raise RolloutEngineError(f"rollout engine {i} failed to start: {e}") from e
        self._start_refs = []
        return self

    def _await(self, ref: Any, timeout_s: float, what: str) -> Any:
        """``ray.get`` bounded by ``timeout_s``, with a message naming what is missing."""
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            from rlhf.workers.placement import describe_resources

            raise RolloutEngineError(
                f"waited {timeout_s:.0f} s for {what}: each engine asks {self.num_cpus_per_engine:g} CPU and "
                f"{self.num_gpus_per_engine:g} GPU and the cluster has {describe_resources(ray.available_resources())} "
                "free. Give the cluster more (cluster.num_cpus for a local Ray), "
                "ask less (rollout.num_engines, cluster.cpus_per_engine), or raise cluster.startup_timeout_s "
                "/ train.rollout_timeout_s if it is just slow"
            ) from None

    def _create(self, i: int) -> Any:
        opts: dict[str, Any] = {
            "num_cpus": self.num_cpus_per_engine,
            "num_gpus": self.num_gpus_per_engine,
            "runtime_env": {"env_vars": self.env_vars},
            # The pool does the restarting: it must re-sync weights before the engine serves again.
            "max_restarts": 0,
        }
        if self.concurrent:  # a threaded actor: concurrent calls share engine steps (ContinuousBatcher)
            opts["max_concurrency"] = MAX_CALLS_IN_FLIGHT
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_indices[i],
                placement_group_capture_child_tasks=True,
            )
        kwargs = dict(self.engine_kwargs)
        kwargs["seed"] = int(kwargs.get("seed", 0)) + i
        return self._actor_cls.options(**opts).remote(**kwargs)

    def _restart(self, i: int, cause: BaseException) -> None:
        """Replace engine ``i`` by a fresh actor and give it the last synced weights."""
        import ray

        done = self.restarts_this_call[i]
        if done >= self.max_restarts:
            what = f"died again after {done} restart(s) in this call" if done else "died"
            raise RolloutEngineDied(
                f"rollout engine {i} {what} (rollout.max_restarts={self.max_restarts}); "
                f"last cause: {type(cause).__name__}: {cause}"
            ) from cause
        if self._synced and self._weights_ref is None:
            raise RolloutEngineError(
                f"rollout engine {i} died ({type(cause).__name__}) and cannot be restarted: the last weights "
                "are not in the object store (keep_last_weights=False, or sent by rollout.weight_sync=nccl/ipc), "
                "so a new engine would serve stale weights"
            ) from cause
        self.restarts_this_call[i] += 1
        self.restarts[i] += 1
        with contextlib.suppress(Exception):  # usually already dead; kill in case it is only unreachable
            ray.kill(self.engines[i], no_restart=True)
        self.engines[i] = self._create(i)
        log.warning(
            "rollout engine %d died (%s); restarting it (restart %d of this engine in the run)",
            i,
            type(cause).__name__,
            self.restarts[i],
        )
        try:
            self._await(self.engines[i].ping.remote(), self.startup_timeout_s, f"restarted engine {i}")
            for method, args in self._settings.items():
                self._await(getattr(self.engines[i], method).remote(*args), 60.0, f"engine {i}")
            if self._weights_ref is not None:
                ref = self.engines[i].update_weights.remote(self._weights_ref, self.weight_version)
            else:  # the model directory's weights, numbered as the trainer numbers them
                ref = self.engines[i].set_version.remote(self.weight_version)
            self._await(ref, self.call_timeout_s, f"restarted engine {i} to load weights")
        except Exception as e:
            raise RolloutEngineDied(
                f"rollout engine {i} died ({type(cause).__name__}: {cause}) and its replacement failed to "
                f"start or to load weights version {self.weight_version}: {type(e).__name__}: {e}"
            ) from e

    def _result_or_restart(self, i: int, ref: Any, what: str, sent_to: int | None = None) -> tuple[bool, Any]:
        """``(True, result)`` of engine ``i``'s call, or ``(False, None)`` once a dead engine was
        restarted (the caller sends the call again); any other failure raises. ``sent_to`` is
        ``restarts[i]`` when the call was sent (default: now): a call to an engine replaced since
        is sent again without another restart."""
        try:
            return True, self._await(ref, self.call_timeout_s, f"engine {i} to finish {what}")
        except RolloutEngineError:
            raise
        except Exception as e:
            if not is_process_death(e):
                raise RolloutEngineError(
                    f"rollout engine {i} failed in {what}: {type(e).__name__}: {e}"
                ) from e
            with self._restart_lock:
                if sent_to is None or sent_to == self.restarts[i]:
                    self._restart(i, e)
            return False, None

    def _call_all(self, method: str, args_per_engine: dict[int, tuple]) -> dict[int, Any]:
        """Call ``method`` on the given engines in parallel; restart dead ones and retry their call."""

        self.restarts_this_call = [0] * self.num_engines
        pending = {i: getattr(self.engines[i], method).remote(*args) for i, args in args_per_engine.items()}
        results: dict[int, Any] = {}
        while pending:
            retry: dict[int, Any] = {}
            for i, ref in pending.items():
                ok, result = self._result_or_restart(i, ref, method)
                if ok:
                    results[i] = result
                else:
                    retry[i] = getattr(self.engines[i], method).remote(*args_per_engine[i])
            pending = retry
        return results

    def generate(self, prompts: list[list[int]], sampling: Mapping[str, Any]) -> list[list[dict]]:
        """``n`` completions per prompt, in input order (see the module docstring).

        Prompts are split into contiguous shards, one per engine, run in parallel. A dead engine
        is restarted (weights re-synced) and its shard retried; a second failure raises
        ``RolloutEngineError``. Nothing is dropped: the result has one entry per prompt.
        """
        check_sampling(sampling)
        validate_prompts(prompts, self.max_model_len)
        n = sampling.get("n", 1)
        seeds = _per_prompt_seeds(sampling.get("seed"), len(prompts), n)
        args: dict[int, tuple] = {}
        bounds = shard_bounds(len(prompts), self.num_engines)
        for i, (lo, hi) in enumerate(bounds):
            if hi > lo:
                shard_sampling = dict(sampling)
                if sampling.get("seed") is not None:
                    shard_sampling["seed"] = seeds[lo:hi]
                args[i] = ([list(map(int, p)) for p in prompts[lo:hi]], shard_sampling)
        results = self._call_all("generate", args)
        out: list[list[dict]] = []
        for i, (lo, hi) in enumerate(bounds):
            if hi > lo:
                shard = results[i]
                if len(shard) != hi - lo:
                    raise RolloutEngineError(
                        f"rollout engine {i} returned {len(shard)} results for {hi - lo} prompts"
                    )
                out.extend(shard)
        return out

    # ------------------------------------------------------------ one turn at a time (agent loop)
    def begin_calls(self) -> None:
        """Start counting restarts anew (``rollout.max_restarts`` holds per agent-loop batch)."""
        self.restarts_this_call = [0] * self.num_engines
        self._turn_sent_to.clear()

    def reset_restart_budget(self) -> None:
        """``rollout.max_restarts`` holds anew (a streaming run: per step), calls in flight kept."""
        self.restarts_this_call = [0] * self.num_engines

    def submit_turn(self, engine: int, prompt: list[int], sampling: Mapping[str, Any]) -> Any:
        """One request (``n`` completions of ``prompt``) on engine ``engine``, without waiting:
        the engine batches it with whatever else is in flight. Returns the ref for ``turn_result``."""
        check_sampling(sampling)
        validate_prompts([prompt], self.max_model_len)
        ref = self.engines[engine].generate.remote([list(map(int, prompt))], dict(sampling))
        self._turn_sent_to[ref] = self.restarts[engine]
        return ref

    def turn_result(self, engine: int, ref: Any, resubmit: Callable[[], Any]) -> dict:
        """The first completion of a ``submit_turn`` request. A dead engine is restarted (weights
        re-synced) and the request sent again with ``resubmit()`` (same seed: same tokens); the
        other turns that were in flight on it are sent again to the replacement."""
        return self.group_result(engine, ref, resubmit)[0]

    def group_result(self, engine: int, ref: Any, resubmit: Callable[[], Any]) -> list[dict]:
        """All ``n`` completions of a ``submit_turn`` request, restarting a dead engine as
        ``turn_result`` does."""
        while True:
            ok, result = self._result_or_restart(engine, ref, "a turn", self._turn_sent_to.pop(ref, None))
            if ok:
                return result[0]
            ref = resubmit()

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Any,
        version: int | None = None,
    ) -> None:
        """Have every engine load HF-named tensors, put in the object store once.

        ``state_dict`` is a mapping / ``(name, tensor)`` pairs, or an ``ObjectRef`` of such CPU
        pairs already in the object store (``ModelGroup.get_weights_ref``: no copy through the
        driver). Tensors given directly are detached and copied to CPU first (a CUDA tensor in
        the object store would pin the trainer's device). The ref is kept
        (``keep_last_weights``) for restarted engines. ``version`` numbers the weights (the
        trainer's optimizer steps; default: one more than the last), as the engines record it
        per sampled token.
        """
        import ray

        if isinstance(state_dict, ray.ObjectRef):
            ref = state_dict
        else:
            items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
            named = [(str(k), v.detach().to("cpu").contiguous()) for k, v in items]
            if not named:
                raise ValueError("update_weights got an empty state_dict")
            ref = ray.put(named)
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self._synced = True
        # Set before loading: an engine that dies mid-sync is restarted with THESE weights.
        self._weights_ref = ref
        try:
            self._call_all("update_weights", {i: (ref, self.weight_version) for i in range(self.num_engines)})
        finally:
            if not self.keep_last_weights:
                self._weights_ref = None

    # ------------------------------------------------------------------ GPU (untested on CPU CI)
    @property
    def engine_workers(self) -> int:
        """vLLM workers over all engines (tensor-parallel ranks): the NCCL group's receivers."""
        return self.num_engines * int(self.engine_kwargs.get("tensor_parallel_size", 1))

    def transferred(self, version: int | None = None) -> None:
        """Record a weight version sent by the trainer's transfer engine (nccl | ipc).

        Such weights are not kept in the object store, so a dead engine is not restarted
        (it would have to rejoin the transfer group): the step fails with a clear error.
        """
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self._synced = True
        self._weights_ref = None

    def set_inflight_updates(self, on: bool) -> None:
        """Every engine loads weights between engine steps with requests in flight (on), or
        waits for them (off); see ``RolloutEngine.set_inflight_updates``."""
        self._set_all("set_inflight_updates", bool(on))

    def set_partial_rollouts(self, on: bool) -> None:
        """Every engine aborts the requests in flight at a weight load and continues them under
        the new weights (on); see ``RolloutEngine.set_partial_rollouts``."""
        self._set_all("set_partial_rollouts", bool(on))

    def set_cpu_share(self, share: float) -> None:
        """On CPU, every engine generates with ``share`` of its node's cores (0: the CPUs Ray
        gave it); see ``RolloutEngine.set_cpu_share``."""
        self._set_all("set_cpu_share", float(share))

    def _set_all(self, method: str, *args: Any) -> None:
        self._settings[method] = args  # a restarted engine gets it too
        self._call_all(method, {i: args for i in range(self.num_engines)})

    def expect_version(self, version: int) -> None:
        """The next transfer (nccl | ipc) carries weight version ``version`` (set before it starts)."""
        self._call_all("expect_version", {i: (version,) for i in range(self.num_engines)})

    def set_version(self, version: int) -> None:
        """Number the engines' current weights ``version`` (a run starting or resuming at that
        step, or a step that changed no weight); tokens sampled from now on record it."""
        self.weight_version = int(version)
        self._call_all("set_version", {i: (version,) for i in range(self.num_engines)})

    def sleep(self, level: int) -> None:
        """Every engine releases its GPU memory (level 1: weights to CPU, KV dropped; 2: both dropped)."""
        self._call_all("sleep", {i: (level,) for i in range(self.num_engines)})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every engine re-allocates ``tags`` ("weights", "kv_cache"; None = all)."""
        self._call_all("wake_up", {i: (tags,) for i in range(self.num_engines)})

    def upload_logs(self, output_dir: str, timeout_s: float = 120.0) -> None:
        """Every engine copies its log file to ``<output_dir>/logs/`` (bounded: logs are not worth a hang)."""
        import ray

        ray.get([e.upload_log.remote(output_dir) for e in self.engines], timeout=timeout_s)

    def ping(self) -> list[str]:
        import ray

        return ray.get([e.ping.remote() for e in self.engines])

    def busy_s(self) -> float:
        """Seconds all engines spent generating so far (vLLM: in engine steps; hf: in generate calls)."""
        return sum(float(s.get("busy_s", s.get("generate_s", 0.0))) for s in self.stats())

    def stats(self) -> list[dict[str, Any]]:
        """Per-engine ``RolloutEngine.stats()`` plus the pool's restart count for that engine."""
        import ray

        stats = ray.get([e.stats.remote() for e in self.engines])
        for i, s in enumerate(stats):
            s["restarts"] = self.restarts[i]
        return stats

    def shutdown(self) -> None:
        """Kill all engine actors (idempotent)."""
        import ray

        for e in getattr(self, "engines", []):
            with contextlib.suppress(Exception):  # already dead
                ray.kill(e, no_restart=True)
        self.engines = []
        self._weights_ref = None
