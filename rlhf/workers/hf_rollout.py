"""The ``hf`` rollout backend: a Hugging Face model sampling with its KV cache, in place of vLLM.

``HFRolloutEngine`` serves the same contract as ``rlhf.workers.rollout.RolloutEngine``
(``generate``'s completion format, seeds, lengths, processed logprobs, ``update_weights``
through the object store), so ``RolloutPool`` runs it in Ray actors unchanged
(``rollout.backend=hf``, ``engine_cls=HFRolloutEngine``). It needs no vLLM.

When to use it: small models on CPU, where vLLM's per-decode-step scheduling costs more
than the model (``bench/e2e_step.py`` measures both), machines without vLLM, and debugging.
vLLM stays the default: it batches continuously and pages its KV cache, which wins for real
model sizes and long responses. Not served here: vLLM's weight transfer (nccl/ipc) and sleep
mode; the config refuses them with this backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rlhf.models.decode import sample_completions
from rlhf.models.sampling import SamplingSpec
from rlhf.workers.engine_counters import EngineCounters
from rlhf.workers.placement import use_threads
from rlhf.workers.rollout import (
    RolloutEngineError,
    _per_prompt_seeds,
    check_sampling,
    response_room,
    validate_prompts,
)

__all__ = ["HFRolloutEngine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _eos_ids(model_path: str, model: torch.nn.Module) -> list[int]:
    """The model's end-of-sequence ids: its generation config's, else its config's, plus the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    try:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # a weights-only directory: the configs above are all there is
        eos = None
    if eos is not None:
        ids.add(int(eos))
    return sorted(ids)


class HFRolloutEngine(EngineCounters):
    """One Hugging Face causal LM, token-in/token-out. Plain class: ``RolloutPool`` makes it a Ray actor.

    Args:
        model_path: HF model directory.
        max_model_len: longest prompt + response the engine accepts.
        seed: draws for requests without their own seed.
        dtype: "float32" | "bfloat16" | "float16" ("auto": the checkpoint's).
        weight_transfer, sleep_mode: must be None / False (vLLM-only features, named here so
            that asking for them is a clear error rather than a TypeError).
    """

    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "float32",
        weight_transfer: str | None = None,
        sleep_mode: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if weight_transfer is not None or sleep_mode:
            raise RolloutEngineError(
                "rollout.backend=hf has no vLLM weight transfer or sleep mode; use rollout.weight_sync=object_store "
                "and cluster.colocate_engines=false, or rollout.backend=vllm"
            )
        t0 = time.perf_counter()
        self._own_threads = torch.get_num_threads()  # what the CPUs Ray gave the actor allow
        on_gpu = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        torch_dtype = "auto" if dtype == "auto" else _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.max_model_len = max_model_len
        self.stop_ids = _eos_ids(model_path, self.model)
        self._draws = torch.Generator().manual_seed(seed)
        self._start_counters("hf", t0)

    def _use_threads(self, n: int) -> None:
        use_threads(n)  # a plain (single-threaded) actor: its calls all run on the thread that computes

    def generate(self, prompt_token_ids: list[list[int]], sampling: Mapping[str, Any]) -> list[list[dict]]:
        """Same request and result as ``RolloutEngine.generate`` (see ``rlhf.workers.rollout``)."""
        check_sampling(sampling)
        validate_prompts(prompt_token_ids, self.max_model_len)
        t0 = time.perf_counter()
        n = sampling.get("n", 1)
        spec = SamplingSpec(
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p") or 1.0),
            top_k=int(sampling.get("top_k") or -1),
            min_p=float(sampling.get("min_p") or 0.0),
            min_tokens=int(sampling.get("min_tokens") or 0),
            repetition_penalty=float(sampling.get("repetition_penalty") or 1.0),
        )
        prompt_seeds = _per_prompt_seeds(sampling.get("seed"), len(prompt_token_ids), n)
        seeds = [
            int(torch.randint(0, 2**62, (), generator=self._draws)) + k if s is None else s + k
            for s in prompt_seeds
            for k in range(n)
        ]
        stops = [] if sampling.get("ignore_eos") else list(self.stop_ids)
        stops += list(sampling.get("stop_token_ids") or [])
        max_tokens = [response_room(p, sampling, self.max_model_len) for p in prompt_token_ids]
        done = sample_completions(self.model, prompt_token_ids, n, spec, max_tokens, seeds, stops)
        with_logprobs = sampling.get("logprobs", 0) is not None
        results = [
            [
                {
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs if with_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in comps
            ]
            for comps in done
        ]
        self._count_generate(results, t0)
        return results

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Copy HF-named full tensors into the model; every parameter must be given (tied ones once)."""
        t0 = time.perf_counter()
        # Tied weights answer to each of their names (a state_dict has both); one of them is enough.
        targets = {
            **dict(self.model.named_buffers()),
            **dict(self.model.named_parameters(remove_duplicate=False)),
        }
        loaded: set[int] = set()
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None or target.shape != tensor.shape:
                got = "no such weight" if target is None else f"shape {tuple(target.shape)}"
                raise RolloutEngineError(
                    f"weight sync sent {name!r} {tuple(tensor.shape)}; the engine's model has {got}: "
                    "the actor and rollout.backend=hf engine must load the same architecture"
                )
            target.copy_(tensor)
            loaded.add(id(target))
        missing = [name for name, p in self.model.named_parameters() if id(p) not in loaded]
        if missing:
            raise RolloutEngineError(
                f"weight sync left {len(missing)} parameters of the engine's model stale, e.g. {missing[:3]}; "
                "the sync must send every parameter"
            )
        self._count_update(t0, version)

    def sleep(self, level: int) -> None:
        raise RolloutEngineError(
            "rollout.backend=hf engines cannot sleep; set cluster.colocate_engines=false"
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise RolloutEngineError(
            "rollout.backend=hf engines cannot sleep; set cluster.colocate_engines=false"
        )
