"""vLLM rollout engines (token-in/token-out); the pool that shards prompts over them is in
``rlhf.workers.rollout_pool``.

``RolloutEngine`` is a plain class wrapping one ``vllm.LLM``; ``RolloutPool`` turns it into Ray
actors (``ray.remote(num_cpus=..., num_gpus=...)`` with a ``runtime_env`` carrying the vLLM
environment variables), spreads prompts over them in contiguous shards, syncs weights through
the Ray object store and restarts engines that die.

Completion format (one list of ``n`` completions per prompt, in input order)::

    {"token_ids": [int, ...],        # response only; ends with the stop/eos token if it stopped
     "logprobs": [float, ...],       # logprob of each sampled token (see below); None if not asked
     "finish_reason": "stop" | "length",
     "versions": [int, ...]}         # weight version each token was sampled under

Versions. An engine built with ``inflight_updates=True`` loads new weights between two engine
steps without waiting for the requests in flight (``ContinuousBatcher.between_steps``); their
later tokens are sampled under the new version, their KV cache from older weights is kept, and
prefix caching is off (a cached prefix would carry old weights into new requests for as long
as it stays in use). Otherwise a weight load waits for the requests in flight to finish, and
all tokens of a completion share one version.

Logprobs. The engine is started with ``logprobs_mode="processed_logprobs"``: the logprob of the
sampled token under the distribution it was actually sampled from, i.e. after temperature
scaling AND after top-k/top-p truncation (renormalised over the kept tokens). With top_k off
(0 or -1) and top_p = 1 this is ``log_softmax(logits / temperature)``, which is what the
trainer computes when it divides its logits by the same temperature. With top-k/top-p active
the two differ by the truncation mass; the trainer does not truncate, so keep them off for
on-policy PPO or treat the difference as off-policy-ness. Greedy requests (temperature 0) get
plain ``log_softmax(logits)`` (vLLM applies no temperature to greedy rows). vLLM's default,
``raw_logprobs``, ignores temperature entirely and would bias the importance ratio.

Seeds. ``sampling["seed"] = s`` gives prompt ``i`` (global index in the pool's input) the seed
``s + i * n``, and vLLM gives its ``n`` children ``seed + k``, so every completion has its own
seed, identical prompts do not get identical samples, and the result does not depend on how
many engines there are.

Lengths. A prompt must leave room for one token: ``len(prompt) <= max_model_len - 1``, else the
pool raises ``ValueError`` before anything is sent. ``max_tokens`` is clipped per prompt to
``max_model_len - len(prompt)`` so prompt + response always fits the engine (such a response
ends with ``finish_reason="length"``); a missing ``max_tokens`` means "up to max_model_len".

GPU (untested on the CPU CI machine). ``update_weights`` (object store) works unchanged on
GPU. With ``weight_transfer="nccl" | "ipc"`` the engine also serves vLLM's weight-transfer
protocol (``transfer_*``, driven by ``rlhf.workers.weight_sync``), and with ``sleep_mode`` it
can ``sleep``/``wake_up`` to give its GPU memory to colocated training ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf.envvars import engine_env
from rlhf.workers.continuous import ContinuousBatcher
from rlhf.workers.engine_counters import EngineCounters
from rlhf.workers.errors import WorkerDied

__all__ = [
    "SAMPLING_KEYS",
    "RolloutEngine",
    "RolloutEngineDied",
    "RolloutEngineError",
    "check_sampling",
    "default_engine_env",
    "llm_kwargs",
    "response_room",
    "sampling_params",
    "validate_prompts",
]

# Keys ``generate`` understands; anything else is a typo or an unsupported vLLM option and is refused
# rather than silently ignored.
SAMPLING_KEYS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "seed",
        "logprobs",
        "ignore_eos",
        "repetition_penalty",
    }
)
# Passed to SamplingParams as given (the others are derived: max_tokens is clipped to the room
# left, seed is per prompt, logprobs defaults to 0).
_VLLM_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
)


class RolloutEngineError(RuntimeError):
    """A rollout engine failed (and, for a dead engine, failed again after one restart)."""


class RolloutEngineDied(RolloutEngineError, WorkerDied):
    """An engine process died more often than ``rollout.max_restarts`` allows in one call."""


def default_engine_env(num_gpus: float) -> dict[str, str]:
    """Env vars for an engine actor (``rlhf.envvars.engine_env``)."""
    return engine_env(num_gpus)


def check_sampling(sampling: Mapping[str, Any]) -> None:
    """Raise ValueError naming the key if ``sampling`` cannot be served."""
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling keys {unknown}; supported: {sorted(SAMPLING_KEYS)}")
    n = sampling.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sampling['n'] must be an int >= 1, got {n!r}")
    temperature = float(sampling.get("temperature", 1.0))
    if temperature < 0:
        raise ValueError(f"sampling['temperature'] must be >= 0, got {temperature}")
    if temperature == 0 and n > 1:
        raise ValueError(
            f"sampling['n']={n} with temperature 0 (greedy) would return {n} identical "
            "completions; vLLM refuses it: use n=1 or a temperature > 0"
        )
    max_tokens = sampling.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"sampling['max_tokens'] must be an int >= 1 or None, got {max_tokens!r}")
    logprobs = sampling.get("logprobs", 0)
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"sampling['logprobs'] must be 0 (sampled token) or None, got {logprobs!r}")
    seed = sampling.get("seed")
    if seed is not None and not isinstance(seed, (int, list)):
        raise ValueError(
            f"sampling['seed'] must be an int, a list of ints (one per prompt) or None, got {seed!r}"
        )


def validate_prompts(prompts: list[list[int]], max_model_len: int) -> None:
    """Raise ValueError if there are no prompts, one is empty, or one leaves no room for a token."""
    if not prompts:
        raise ValueError("generate() got an empty prompt list; pass at least one prompt (list of token ids)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. <bos>)")
        if len(p) > max_model_len - 1:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; rollout.max_model_len is {max_model_len}, which leaves no "
                f"room for a response (a prompt may have at most max_model_len - 1 = {max_model_len - 1} "
                "tokens). Raise rollout.max_model_len, lower data.max_prompt_len, or set "
                "data.overlong_prompts=skip"
            )


def response_room(prompt: list[int], sampling: Mapping[str, Any], max_model_len: int) -> int:
    """``sampling["max_tokens"]`` clipped to what ``prompt`` leaves of ``max_model_len`` (all of
    it when unset), so prompt + response always fits the engine."""
    room = max_model_len - len(prompt)
    return min(sampling.get("max_tokens") or room, room)


def llm_kwargs(
    model_path: str,
    max_model_len: int,
    *,
    seed: int,
    dtype: str,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    tensor_parallel_size: int,
    weight_transfer: str | None,
    sleep_mode: bool,
    chunked_prefill: bool = True,
    prefix_caching: bool = True,
) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of a rollout engine (``RolloutEngine`` documents them).

    ``chunked_prefill=False`` is what a CPU engine needs: when a step's token budget
    (``max_num_batched_tokens``, 4096 on CPU) ends inside a prompt, vLLM prefills that prompt in
    two chunks and rewinds the request's seeded generator by the draw it discarded
    (``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner``). Only CUDA's Philox
    generators have an offset; a CPU ``torch.Generator`` raises "CPU Generator does not use
    offset", so any seeded call over ~4k prompt tokens died. Without chunking each prompt is
    prefilled whole (the budget becomes at least ``max_model_len``), the rest wait for the next
    step, and no request is cut or dropped.
    """
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
        worker_extension_cls="rlhf.workers.vllm_ext.WeightSyncExtension",
        # the logprobs the sampler drew from (after temperature/top-p/...), what PPO's ratio needs
        logprobs_mode="processed_logprobs",
        # a progress bar per engine start and restart, for a file that loads in milliseconds
        use_tqdm_on_load=False,
    )
    if weight_transfer is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_transfer}
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if not chunked_prefill:
        kwargs["enable_chunked_prefill"] = False
    if not prefix_caching:
        kwargs["enable_prefix_caching"] = False
    return kwargs


def sampling_params(sampling: Mapping[str, Any], *, seed: int | None, max_tokens: int) -> Any:
    """One prompt's ``vllm.SamplingParams`` for a ``check_sampling``-valid ``sampling``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    given = {k: sampling[k] for k in _VLLM_SAMPLING_KEYS if sampling.get(k) is not None}
    return SamplingParams(
        n=sampling.get("n", 1),
        max_tokens=max_tokens,
        seed=seed,
        logprobs=sampling.get("logprobs", 0),
        detokenize=False,
        flat_logprobs=True,
        # each step's new tokens: ContinuousBatcher knows how far every request got when the
        # weights change under it (per-token versions)
        output_kind=RequestOutputKind.DELTA,
        **given,
    )


def _per_prompt_seeds(
    seed: int | list[int] | None, num_prompts: int, n: int, offset: int = 0
) -> list[int | None]:
    if seed is None:
        return [None] * num_prompts
    if isinstance(seed, list):
        if len(seed) != num_prompts:
            raise ValueError(f"sampling['seed'] has {len(seed)} entries for {num_prompts} prompts")
        return list(seed)
    return [seed + (offset + i) * n for i in range(num_prompts)]


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position logprobs (flat or list-of-dicts)."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: no per-position dicts are built
        out = []
        for pos, tok in enumerate(token_ids):
            lo, hi = logprobs.start_indices[pos], logprobs.end_indices[pos]
            for j in range(lo, hi):
                if logprobs.token_ids[j] == tok:
                    out.append(float(logprobs.logprobs[j]))
                    break
            else:
                raise RuntimeError(f"vLLM returned no logprob for sampled token {tok} at position {pos}")
        return out
    return [float(logprobs[pos][tok].logprob) for pos, tok in enumerate(token_ids)]


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state before vLLM's CPU attention uses it.

    On x86 with AMX, vLLM 0.32 picks its AMX attention kernel for bfloat16 but never requests
    the XTILEDATA permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so the first bf16 forward
    dies with SIGILL unless something else (torch's oneDNN) asked first. torch's helper makes
    that request; it is a no-op returning False on CPUs without AMX.
    """
    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init_amx is not None:
        with contextlib.suppress(Exception):
            init_amx()


def _route_engine_logs(log_dir: Path) -> Path:
    """vLLM's INFO lines and its start-up noise to ``engine-<pid>.log``, real warnings to the console.

    vLLM's documented hook (``VLLM_LOGGING_CONFIG_PATH``) configures its loggers when
    ``vllm.logger`` is imported, but some modules warn while vLLM is still being imported,
    before that: the same config is applied here first. Python ``FutureWarning``s raised
    inside vLLM's own code are about vLLM's use of torch, not the user's.
    """
    import logging.config
    import warnings

    from rlhf.workers.logs import vllm_logging_config

    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"engine-{os.getpid()}.log"
    config = vllm_logging_config(log_file)
    conf = log_dir / f"vllm-logging-{os.getpid()}.json"
    conf.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(conf)
    logging.config.dictConfig(config)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    return log_file


class RolloutEngine(EngineCounters):
    """One vLLM engine, token-in/token-out. Plain class: ``RolloutPool`` makes it a Ray actor.

    Args:
        model_path: HF model directory (config, safetensors, tokenizer).
        max_model_len: longest prompt + response the engine accepts.
        seed: engine seed (requests without their own seed draw from it).
        dtype: "float32" or "bfloat16" ("auto"/"float16" are passed through to vLLM).
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (ignored on CPU,
            where VLLM_CPU_KVCACHE_SPACE sets the KV cache size in GiB).
        enforce_eager: no CUDA graphs / torch.compile (fast start-up; required on CPU here).
        tensor_parallel_size: GPUs per engine; >1 needs a multi-process executor
            (``extra={"distributed_executor_backend": "ray"}``) and is untested here.
        extra: more ``vllm.LLM`` keyword arguments.
        weight_transfer: "nccl" | "ipc" to receive weights through vLLM's weight-transfer engine
            (``weight_transfer_config``); None = object store only. GPU only.
        sleep_mode: build the engine with ``enable_sleep_mode`` (GPU only) for ``sleep``/``wake_up``.
        inflight_updates: load weights between two engine steps, requests in flight included
            (``rollout.inflight_updates`` of a streaming run; see "Versions" above).
        log_dir: where vLLM's INFO lines go (``engine-<pid>.log``); the console keeps warnings.
            None leaves vLLM's logging as it is.
        threads_min_hidden: models narrower than this keep the CPUs Ray gave the engine when a
            run offers more (``set_cpu_share``): their GEMMs are too small for a second thread
            to pay off. Measured on 2 cores (2026-12-07, fresh engines each): hidden 128 x 2
            layers, synchronous long-tail bench 27.8 and 28.8 samples/s on 2 threads against
            53.0 and 40.5 on 1; hidden 512 x 8 layers, 64 x 128 tokens in process, 3.1 s on 2
            threads against 4.4 s on 1.
    """

    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        extra: dict[str, Any] | None = None,
        log_dir: str | None = None,
        weight_transfer: str | None = None,
        sleep_mode: bool = False,
        inflight_updates: bool = False,
        threads_min_hidden: int = 512,
    ) -> None:
        t0 = time.perf_counter()
        self.threads_min_hidden = threads_min_hidden
        self._own_threads = torch.get_num_threads()  # what the CPUs Ray gave the actor allow
        if not torch.cuda.is_available():
            # vLLM reads these when the engine starts; an engine built outside the pool still needs them.
            for key, value in engine_env(0).items():
                os.environ.setdefault(key, value)
            _request_amx_permission()
        self.log_file = _route_engine_logs(Path(log_dir)) if log_dir else None
        from vllm import LLM

        self.llm = LLM(
            **llm_kwargs(
                model_path,
                max_model_len,
                seed=seed,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
                weight_transfer=weight_transfer,
                sleep_mode=sleep_mode,
                # seeded requests + chunked prefill crash on CPU generators (see llm_kwargs)
                chunked_prefill=torch.cuda.is_available(),
                prefix_caching=not inflight_updates,
            ),
            **(extra or {}),
        )
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.inflight_updates = self._no_prefix_cache = inflight_updates
        self.partial_rollouts = False
        self.batcher = ContinuousBatcher(self.llm.llm_engine, _sampled_logprobs, threads=self._own_threads)
        self._start_counters("vllm", t0)

    def _use_threads(self, n: int) -> None:
        if self.llm.llm_engine.model_config.get_hidden_size() < self.threads_min_hidden:
            n = self._own_threads
        self.batcher.threads = n  # the step thread computes: it sets its own (see ContinuousBatcher)

    def generate(self, prompt_token_ids: list[list[int]], sampling: Mapping[str, Any]) -> list[list[dict]]:
        """Sample ``sampling["n"]`` completions per prompt; see the module docstring for the format.

        ``sampling["seed"]`` may be an int (prompt ``i`` gets ``seed + i * n``) or one seed per prompt.
        """
        from vllm.inputs import TokensPrompt

        check_sampling(sampling)
        validate_prompts(prompt_token_ids, self.max_model_len)
        t0 = time.perf_counter()
        logprobs = sampling.get("logprobs", 0)
        seeds = _per_prompt_seeds(sampling.get("seed"), len(prompt_token_ids), sampling.get("n", 1))
        params = [
            self.request_params(p, sampling, seed) for p, seed in zip(prompt_token_ids, seeds, strict=True)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_token_ids]
        lora = self._lora_request()
        outputs = self.batcher.run([(p, sp, lora) for p, sp in zip(prompts, params, strict=True)])
        results = [
            [
                {
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs if logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "versions": c.token_versions(),
                }
                for c in comps
            ]
            for comps in outputs
        ]
        self._count_generate(results, t0)
        return results

    def set_inflight_updates(self, on: bool) -> None:
        """Switch in-flight weight loads on or off (a streaming run, or a batch run on the same
        engines); on needs an engine built with ``inflight_updates=True`` (no prefix cache)."""
        if on and not self._no_prefix_cache:
            raise RolloutEngineError(
                "in-flight weight updates need an engine built without a prefix cache (inflight_updates=True): "
                "its cached prefixes would carry old weights into new requests"
            )
        self.inflight_updates = bool(on)

    def set_partial_rollouts(self, on: bool) -> None:
        """A weight load without in-flight updates aborts the requests in flight and continues
        them under the new weights (on), or waits for them (off); see ``ContinuousBatcher.preempting``."""
        self.partial_rollouts = bool(on)

    def request_params(self, prompt: list[int], sampling: Mapping[str, Any], seed: int | None) -> Any:
        """One prompt's ``vllm.SamplingParams`` (a subclass may shape one request's sampling,
        e.g. ``bench/streaming.py``'s long-tailed lengths)."""
        return sampling_params(
            sampling, seed=seed, max_tokens=response_room(prompt, sampling, self.max_model_len)
        )

    def set_version(self, version: int) -> None:
        """Number the weights held now ``version``; tokens sampled from now on record it."""
        super().set_version(version)
        self.batcher.set_version(int(version))

    def expect_version(self, version: int) -> None:
        """The next weight transfer (``transfer_*``) carries ``version``."""
        self._next_version = int(version)

    def _lora_request(self) -> Any:
        """The adapter generation runs with (``LoraRolloutEngine``); None = the model's own weights."""
        return None

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load HF-named full tensors into every worker (see ``_loading`` for the requests in flight)."""
        t0 = time.perf_counter()
        named_tensors = list(named_tensors)
        version = self._stats["weight_version"] + 1 if version is None else int(version)
        with self._loading(version):
            self.llm.collective_rpc("rlhf_load_weights", kwargs={"named_tensors": named_tensors})
        self._count_update(t0, version)

    # The prefix cache holds KV computed with the old weights; reusing it would make the first
    # tokens of every new rollout come from the previous policy. (LoRA: vLLM keys cached blocks
    # by adapter, so a new adapter never reuses another's.)
    _cache_holds_weights = True

    @contextlib.contextmanager
    def _loading(self, version: int, switch_in_flight: bool = True) -> Iterator[None]:
        """The span of a weight load, after which new tokens are sampled under ``version``:
        between two engine steps with the requests in flight kept (in-flight updates), with them
        aborted and continued after it (partial rollouts), or with none in flight (they finish
        first). The prefix cache is dropped after it where it is on."""
        if self.inflight_updates:  # the prefix cache is off
            with self.batcher.between_steps(version, switch_in_flight):
                yield
            return
        hold = (
            self.batcher.preempting(version, self._lora_request)
            if self.partial_rollouts
            else self.batcher.exclusive()
        )
        with hold:
            yield
            if self._cache_holds_weights:
                self._reset_prefix_cache()
            if not self.partial_rollouts:
                self.batcher.set_version(version)

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RolloutEngineError(
                "vLLM refused to reset the prefix cache after a weight update "
                "(requests still running?); stale KV would mix old and new weights"
            )

    # ------------------------------------------------------------------ GPU (untested on CPU CI)
    # vLLM's RL interfaces, driven by weight_sync.EnginePoolClient from the actor's rank 0. The
    # engine must be built with weight_transfer="nccl" | "ipc" (and sleep_mode for sleep/wake_up).
    def transfer_init(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer (vLLM ``init_weight_transfer_engine``); NCCL blocks in the rendezvous."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def transfer_start(self) -> None:
        self._transfer_t0 = time.perf_counter()
        expected = getattr(self, "_next_version", None)
        self._transfer_version = self._stats["weight_version"] + 1 if expected is None else expected
        self._next_version = None
        # no engine step between start and finish: the transfer spans several calls
        self._transfer = contextlib.ExitStack()
        self._transfer.enter_context(self._loading(self._transfer_version))
        self.llm.collective_rpc("start_weight_update")

    def transfer_update(self, update_info: Any) -> None:
        """Receive one round (NCCL: blocks until rank 0 broadcasts; IPC: opens the handles)."""
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def transfer_finish(self) -> None:
        with self._transfer:  # leaves _loading, with this call's error if it failed
            self.llm.collective_rpc("finish_weight_update")
        self._count_update(self._transfer_t0, self._transfer_version)

    def sleep(self, level: int) -> None:
        """Free GPU memory while the trainer runs: level 1 offloads weights to CPU and drops the
        KV cache, level 2 drops both (the next weight sync refills them)."""
        with self.batcher.exclusive():
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate ``tags`` (``"weights"``, ``"kv_cache"``; None = all) after ``sleep``."""
        with self.batcher.exclusive():
            self.llm.wake_up(tags)
