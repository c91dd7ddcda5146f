"""Rollout engines: real vLLM (CPU) in real Ray actors, checked against Hugging Face on the same weights.

Engines take 12-20 s to start, so one pool of two engines is shared by the module; the tests
that change its state (weight sync, engine kill) run last.
"""

from __future__ import annotations

import copy
import os
import re
import time
from pathlib import Path

import pytest
import torch

from rlhf.workers.rollout import (
    RolloutEngineError,
    _per_prompt_seeds,
    check_sampling,
    default_engine_env,
    validate_prompts,
)
from rlhf.workers.rollout_pool import RolloutPool

MAX_MODEL_LEN = 64
PROMPTS = [[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33, 34, 35], [1, 40, 41]]
TIMINGS: dict[str, float] = {}


# ---------------------------------------------------------------- no vLLM needed


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens; rollout.max_model_len is 64"):
        validate_prompts([[1, 2], [1] * 64], MAX_MODEL_LEN)
    validate_prompts([[1] * 63], MAX_MODEL_LEN)  # room for exactly one token
    with pytest.raises(ValueError, match="empty prompt list"):
        validate_prompts([], MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        validate_prompts([[]], MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=r"unknown sampling keys \['max_new_tokens'\]"):
        check_sampling({"max_new_tokens": 3})
    with pytest.raises(ValueError, match="temperature 0"):
        check_sampling({"n": 2, "temperature": 0.0})


def test_per_prompt_seeds_are_distinct_per_completion() -> None:
    # prompt i gets seed + i*n and vLLM gives child k seed + k: all 3*4 completions differ
    seeds = _per_prompt_seeds(7, 3, 4)
    assert seeds == [7, 11, 15]
    assert len({s + k for s in seeds for k in range(4)}) == 12
    assert _per_prompt_seeds(None, 2, 4) == [None, None]


# ---------------------------------------------------------------- fixtures


# ray_session: the session-wide Ray of tests/conftest.py.


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> Path:
    try:
        return Path(request.getfixturevalue("tiny_llama_dir"))
    except pytest.FixtureLookupError:
        from rlhf.models.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pool(ray_session, model_dir):
    env = {**default_engine_env(0), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    p = RolloutPool(
        num_engines=2,
        engine_kwargs={
            "model_path": str(model_dir),
            "max_model_len": MAX_MODEL_LEN,
            "dtype": "float32",
            "threads_min_hidden": 0,  # the tiny model takes the cores it is offered too
        },
        num_cpus_per_engine=1,
        num_gpus_per_engine=0,
        env_vars=env,
    )
    TIMINGS["pool_start_s"] = time.perf_counter() - t0
    yield p
    p.shutdown()
    print(f"\nrollout timings: {TIMINGS}")


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def hf_token_logprobs(
    model, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log p(response_t | prefix) under ``log_softmax(logits / temperature)``."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return lp[pos, torch.tensor(response)]


def perturbed(model, seed: int, std: float = 0.05):
    """A copy of ``model`` with Gaussian noise on every parameter (a stand-in for a training step)."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return new


GREEDY = {"temperature": 0.0, "max_tokens": 16}


# ---------------------------------------------------------------- engines (vLLM)


@pytest.mark.e2e
def test_bf16_engine_loads_fp32_weights(ray_session, model_dir, hf_model) -> None:
    """bf16 engine (AMX attention on this CPU) fed fp32 trainer weights. Runs before the shared
    pool exists so that at most two engines are alive at once."""
    env = {**default_engine_env(0), "HF_HUB_OFFLINE": "1"}
    kwargs = {"model_path": str(model_dir), "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16"}
    bf16 = RolloutPool(1, kwargs, num_cpus_per_engine=1, env_vars=env)
    try:
        new_model = perturbed(hf_model, seed=3)
        bf16.update_weights(new_model.state_dict())
        outs = bf16.generate(PROMPTS[:2], {"temperature": 1.0, "max_tokens": 8, "seed": 0})
        for prompt, comps in zip(PROMPTS[:2], outs, strict=True):
            c = comps[0]
            ref = hf_token_logprobs(new_model, prompt, c["token_ids"])
            # bf16 rounding of weights and activations: ~1e-2; stale (unsynced) weights: ~1
            assert (torch.tensor(c["logprobs"]) - ref).abs().max().item() < 0.1
    finally:
        bf16.shutdown()


@pytest.mark.e2e
def test_greedy_matches_hf_generate(pool, hf_model) -> None:
    t0 = time.perf_counter()
    outs = pool.generate(PROMPTS, GREEDY)
    TIMINGS["generate_greedy_4x16_s"] = time.perf_counter() - t0
    assert len(outs) == len(PROMPTS)
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        assert len(comps) == 1
        c = comps[0]
        assert c["token_ids"] == hf_greedy(hf_model, prompt, 16)
        # greedy rows get plain log_softmax(logits) (no temperature)
        ref = hf_token_logprobs(hf_model, prompt, c["token_ids"])
        assert torch.allclose(torch.tensor(c["logprobs"]), ref, atol=1e-4)


@pytest.mark.e2e
def test_logprobs_are_temperature_scaled_and_match_hf(pool, hf_model) -> None:
    temperature = 0.7
    outs = pool.generate(PROMPTS, {"n": 2, "temperature": temperature, "max_tokens": 12, "seed": 1})
    worst = 0.0
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        assert len(comps) == 2
        for c in comps:
            assert len(c["logprobs"]) == len(c["token_ids"]) > 0
            ref = hf_token_logprobs(hf_model, prompt, c["token_ids"], temperature)
            worst = max(worst, (torch.tensor(c["logprobs"]) - ref).abs().max().item())
            # the untempered logprobs differ, so the check above is a real test of the scaling
            raw = hf_token_logprobs(hf_model, prompt, c["token_ids"], 1.0)
            assert (raw - ref).abs().max().item() > 1e-2
    assert worst < 1e-4, worst


@pytest.mark.e2e
def test_n_samples_stop_and_length(pool, hf_model, model_dir) -> None:
    from transformers import PreTrainedTokenizerFast

    eos = PreTrainedTokenizerFast.from_pretrained(str(model_dir)).eos_token_id
    n, max_tokens = 8, 40
    # temperature 2 makes the random model's next-token distribution nearly uniform, so <eos>
    # (1 of ~170 tokens) shows up in some of the 32 samples; seeded, so always the same ones.
    outs = pool.generate(PROMPTS, {"n": n, "temperature": 2.0, "max_tokens": max_tokens, "seed": 0})
    stopped = 0
    for comps in outs:
        assert len(comps) == n
        assert len({tuple(c["token_ids"]) for c in comps}) == n  # children have distinct seeds
        for c in comps:
            ids = c["token_ids"]
            assert len(c["logprobs"]) == len(ids)
            if c["finish_reason"] == "stop":
                stopped += 1
                assert ids[-1] == eos and eos not in ids[:-1]  # eos kept, with its logprob
            else:
                assert c["finish_reason"] == "length"
                assert len(ids) == max_tokens and eos not in ids
    assert stopped > 0

    # identical prompts with one seed still get different samples (per-prompt seeds)
    same = pool.generate([PROMPTS[0]] * 2, {"temperature": 1.0, "max_tokens": 8, "seed": 5})
    assert same[0][0]["token_ids"] != same[1][0]["token_ids"]

    # a stop token id ends the completion at its first occurrence, token included
    greedy = hf_greedy(hf_model, PROMPTS[0], 16)
    cut = next(k for k in range(2, len(greedy)) if greedy[k] not in greedy[:k])
    out = pool.generate([PROMPTS[0]], {**GREEDY, "stop_token_ids": [greedy[cut]]})[0][0]
    assert out["token_ids"] == greedy[: cut + 1] and out["finish_reason"] == "stop"

    # max_tokens is clipped so prompt + response fits max_model_len
    long_prompt = [1] + [10] * (MAX_MODEL_LEN - 4)  # room for 3 tokens
    out = pool.generate([long_prompt], {**GREEDY, "max_tokens": 16, "ignore_eos": True})[0][0]
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"


@pytest.mark.e2e
def test_overlong_prompt_is_refused_before_sending(pool) -> None:
    before = sum(s["generate_calls"] for s in pool.stats())
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens; rollout.max_model_len is 64"):
        pool.generate([PROMPTS[0], [1] * MAX_MODEL_LEN], GREEDY)
    with pytest.raises(ValueError, match="empty prompt list"):
        pool.generate([], GREEDY)
    assert sum(s["generate_calls"] for s in pool.stats()) == before


@pytest.mark.e2e
def test_seeded_call_of_20k_prompt_tokens_is_served_whole(pool) -> None:
    """Regression: a seeded call whose prompts pass vLLM's CPU token budget per step (4096)
    died with "CPU Generator does not use offset" (chunked prefill rewinds a CPU generator).
    It must now return every completion, and each completion must be the one its seed gives in
    a small call: the big call neither drops, cuts nor reseeds anything."""
    n, prompt_len = 2, MAX_MODEL_LEN - 4
    prompts = [[1] + [10 + (i * 7 + j) % 90 for j in range(prompt_len - 1)] for i in range(340)]
    assert sum(map(len, prompts)) >= 20_000
    sampling = {"n": n, "temperature": 1.0, "max_tokens": 3, "seed": 11, "ignore_eos": True}
    t0 = time.perf_counter()
    big = pool.generate(prompts, sampling)
    TIMINGS["generate_20k_prompt_tokens_s"] = time.perf_counter() - t0
    assert [len(c) for c in big] == [n] * len(prompts)
    assert all(len(c["token_ids"]) == 3 for comps in big for c in comps)
    for i in (0, 170, 339):  # prompt i's seed is 11 + i*n whatever call it comes in
        small = pool.generate([prompts[i]], {**sampling, "seed": [11 + i * n]})[0]
        assert [c["token_ids"] for c in small] == [c["token_ids"] for c in big[i]]


@pytest.mark.e2e
def test_weight_sync_changes_output_to_new_weights(pool, hf_model) -> None:
    old = [c[0]["token_ids"] for c in pool.generate(PROMPTS, GREEDY)]
    new_model = perturbed(hf_model, seed=1)
    sd = new_model.state_dict()
    t0 = time.perf_counter()
    pool.update_weights(sd)
    TIMINGS["update_weights_s"] = time.perf_counter() - t0
    new = [c[0]["token_ids"] for c in pool.generate(PROMPTS, GREEDY)]
    assert new == [hf_greedy(new_model, p, 16) for p in PROMPTS]
    assert new != old
    assert [s["weight_version"] for s in pool.stats()] == [pool.weight_version] * 2


@pytest.mark.e2e
def test_killed_engine_is_restarted_with_synced_weights(pool, hf_model, ray_session) -> None:
    new_model = perturbed(hf_model, seed=2)
    pool.update_weights(new_model.state_dict())
    # every core per engine (a synchronous run's engines generate alone); the replacement too
    pool.set_cpu_share(1.0)
    before = pool.generate(PROMPTS, GREEDY)
    cores = len(os.sched_getaffinity(0))
    assert [s["compute_threads"] for s in pool.stats()] == [cores, cores]
    assert [c[0]["token_ids"] for c in before] == [hf_greedy(new_model, p, 16) for p in PROMPTS]
    old_pid = pool.stats()[1]["pid"]

    ray_session.kill(pool.engines[1])
    t0 = time.perf_counter()
    after = pool.generate(PROMPTS, GREEDY)
    TIMINGS["generate_with_restart_s"] = time.perf_counter() - t0
    # engine 1 served prompts 2 and 3; a replacement left on the on-disk weights would differ
    assert after == before
    assert [hf_greedy(hf_model, p, 16) for p in PROMPTS[2:]] != [c[0]["token_ids"] for c in before[2:]]
    stats = pool.stats()
    assert pool.restarts == [0, 1]
    assert stats[1]["pid"] != old_pid
    assert stats[1]["weight_version"] == pool.weight_version
    assert [s["compute_threads"] for s in stats] == [cores, cores]
    TIMINGS["engine_startup_s"] = stats[1]["startup_s"]
    pool.set_cpu_share(0.0)  # back to the CPU Ray gave each engine
    assert pool.generate(PROMPTS, GREEDY) == before
    assert [s["compute_threads"] for s in pool.stats()] == [1, 1]


# ---------------------------------------------------------------- an engine that cannot come back


@pytest.mark.e2e
def test_dead_engine_past_max_restarts_or_unable_to_restart_is_a_clear_error(
    pool, ray_session, monkeypatch, tmp_path
) -> None:
    """Runs last: it leaves engine 1 dead (the pool would restart it on its next call)."""
    restarts = list(pool.restarts)
    ray_session.kill(pool.engines[1])

    # No restarts allowed: the death itself is the error, naming the engine and the cause.
    monkeypatch.setattr(pool, "max_restarts", 0)
    with pytest.raises(
        RolloutEngineError, match=r"rollout engine 1 died \(rollout.max_restarts=0\); last cause: "
    ):
        pool.generate(PROMPTS, GREEDY)
    assert pool.restarts == restarts

    # One restart allowed, but the replacement cannot start (its model dir is gone): the error
    # names the engine, the original death and what broke the replacement.
    missing = tmp_path / "no_such_model"
    monkeypatch.setattr(pool, "max_restarts", 1)
    monkeypatch.setitem(pool.engine_kwargs, "model_path", str(missing))
    with pytest.raises(RolloutEngineError) as err:
        pool.generate(PROMPTS, GREEDY)
    msg = str(err.value)
    assert re.match(r"rollout engine 1 died \(\w+Error: .*\) and its replacement failed to start", msg, re.S)
    assert str(missing) in msg.split("and its replacement failed", 1)[1]
    assert pool.restarts == [restarts[0], restarts[1] + 1]
