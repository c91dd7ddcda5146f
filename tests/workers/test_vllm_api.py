"""The vLLM interfaces the rollout engine calls, checked against the installed vLLM's own classes.

The CPU runs exercise most of them for real; the GPU-only ones (weight-transfer engine,
sleep mode) cannot start here, so their names and arguments are checked against vLLM's code
instead. The [gpu] extra pins a newer vLLM than the CPU build: scripts/check_vllm_gpu_api.sh
runs this file against that vLLM's Python sources too.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rlhf.workers.rollout import SAMPLING_KEYS, llm_kwargs, sampling_params

pytestmark = pytest.mark.cpu

# What RolloutEngine and the weight-transfer engines call on each vLLM worker (collective_rpc).
WORKER_METHODS = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "reload_weights",
    "sleep",
    "wake_up",
)


@pytest.mark.parametrize("transfer", ["nccl", "ipc", None])
def test_engine_arguments_are_vllms(tiny_qwen2_dir, transfer):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = llm_kwargs(
        tiny_qwen2_dir,
        64,
        seed=3,
        dtype="bfloat16",
        gpu_memory_utilization=0.4,
        enforce_eager=True,
        tensor_parallel_size=1,
        weight_transfer=transfer,
        sleep_mode=transfer is not None,
        chunked_prefill=transfer is not None,
    )
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}
    assert not unknown, f"vllm.EngineArgs has no {sorted(unknown)}"
    args = EngineArgs(**kwargs)  # vLLM's own validation of each value
    assert args.enable_sleep_mode is (transfer is not None)
    assert args.logprobs_mode == "processed_logprobs"
    # CPU engines (no transfer here) must not chunk a seeded prefill (rollout.llm_kwargs)
    assert args.enable_chunked_prefill is (False if transfer is None else None)
    if transfer is None:
        assert args.weight_transfer_config is None
    else:
        assert args.weight_transfer_config.backend == transfer


def test_worker_serves_every_method_we_call_and_our_extension_does_not_clash():
    from vllm.config import set_current_vllm_config  # the extension's fallback path
    from vllm.v1.worker.gpu_worker import Worker

    from rlhf.workers.vllm_ext import WeightSyncExtension

    assert callable(set_current_vllm_config)
    missing = [m for m in WORKER_METHODS if not callable(getattr(Worker, m, None))]
    assert not missing, f"vLLM's worker has no {missing}"
    ours = [m for m in vars(WeightSyncExtension) if not m.startswith("__")]
    assert ours and not [m for m in ours if hasattr(Worker, m)]
    assert "level" in inspect.signature(Worker.sleep).parameters
    assert "tags" in inspect.signature(Worker.wake_up).parameters


def test_llm_sleep_and_wake_up_take_what_we_pass():
    from vllm import LLM

    assert "level" in inspect.signature(LLM.sleep).parameters
    assert list(inspect.signature(LLM.wake_up).parameters)[1] == "tags"  # passed positionally
    assert "method" in inspect.signature(LLM.collective_rpc).parameters


def test_every_sampling_key_reaches_sampling_params():
    sampling = {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "max_tokens": 100,
        "min_tokens": 2,
        "stop_token_ids": [7, 9],
        "seed": 11,
        "logprobs": 0,
        "ignore_eos": True,
        "repetition_penalty": 1.2,
    }
    assert set(sampling) == SAMPLING_KEYS
    p = sampling_params(sampling, seed=42, max_tokens=17)
    derived = {"max_tokens": 17, "seed": 42}  # clipped to the room left; per prompt
    for key, want in sampling.items():
        assert getattr(p, key) == derived.get(key, want), key
    assert p.flat_logprobs and not p.detokenize


def test_weight_reload_and_flat_logprobs_have_the_fields_we_read():
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # WeightSyncExtension.rlhf_load_weights (object-store sync) reloads through the runner.
    assert "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    # _sampled_logprobs walks these per position.
    fields = {f.name for f in dataclasses.fields(FlatLogprobs)}
    assert {"start_indices", "end_indices", "token_ids", "logprobs"} <= fields
