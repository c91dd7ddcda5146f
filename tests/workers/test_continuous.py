"""In-flight weight updates on a real vLLM CPU engine (``ContinuousBatcher.between_steps``).

A long request is in flight when new weights arrive: the engine loads them between two engine
steps, the request goes on, and every token reports the version it was sampled under. The
engine's log-probs are checked against Hugging Face: tokens before the switch under the old
weights; tokens after it under the new weights attending over the KV cache the old weights
computed (the cache is kept, as PipelineRL does), rebuilt here with ``past_key_values``.
"""

from __future__ import annotations

import time

import pytest
import torch

from rlhf.workers.continuous import Completion
from rlhf.workers.rollout import default_engine_env
from rlhf.workers.rollout_pool import RolloutPool
from tests.workers.test_rollout import perturbed

MAX_MODEL_LEN = 512
PROMPT = [1, 10, 11, 12]


def test_token_versions_follow_the_switches() -> None:
    c = Completion(token_ids=[5, 6, 7, 8, 9], versions=[(0, 3), (2, 4), (2, 5), (4, 6)])
    assert c.token_versions() == [3, 3, 5, 5, 6]
    assert Completion(token_ids=[1, 2], versions=[(0, 0)]).token_versions() == [0, 0]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inflight_pool(ray_session, tiny_llama_dir):
    p = RolloutPool(
        num_engines=1,
        engine_kwargs={
            "model_path": str(tiny_llama_dir),
            "max_model_len": MAX_MODEL_LEN,
            "dtype": "float32",
            "inflight_updates": True,
        },
        env_vars={**default_engine_env(0), "HF_HUB_OFFLINE": "1"},
    )
    yield p
    p.shutdown()


def submit_under_way(pool, prompt: list[int], sampling: dict, steps: int = 20):
    """Send one request to engine 0; return its ref once the engine took ``steps`` steps since
    (the request is well under way when the caller's weight update lands)."""
    steps0 = pool.stats()[0]["steps"]
    ref = pool.submit_turn(0, prompt, sampling)
    deadline = time.monotonic() + 60
    while pool.stats()[0]["steps"] < steps0 + steps:
        assert time.monotonic() < deadline, "the engine took no steps"
        time.sleep(0.01)
    return ref


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]


def _kept_cache_reference(old, new, prompt: list[int], tokens: list[int], k: int) -> torch.Tensor:
    """Log-probs of ``tokens`` when tokens ``[0, k)`` were sampled under ``old`` and the rest under
    ``new`` with the KV cache of everything before token ``k - 1`` computed by ``old`` (the
    decode step that samples token ``k`` computes token ``k - 1``'s KV, under the new weights)."""
    ids = torch.tensor([prompt + tokens])
    n = len(prompt)
    with torch.no_grad():
        before = _logprobs(old(input_ids=ids).logits[0, n - 1 : n - 1 + k], tokens[:k])
        cached = old(input_ids=ids[:, : n + k - 1], use_cache=True).past_key_values
        logits = new(input_ids=ids[:, n + k - 1 : -1], past_key_values=cached, use_cache=True).logits[0]
    return torch.cat([before, _logprobs(logits, tokens[k:])])


@pytest.mark.e2e
def test_an_update_lands_between_engine_steps_with_a_request_in_flight(inflight_pool, hf_model) -> None:
    pool = inflight_pool
    sampling = {"n": 1, "temperature": 1.0, "max_tokens": 400, "ignore_eos": True, "seed": [7]}
    ref = submit_under_way(pool, PROMPT, sampling)
    new_model = perturbed(hf_model, seed=3)
    pool.update_weights(new_model.state_dict())
    comp = pool.group_result(0, ref, lambda: pytest.fail("the engine died"))[0]

    versions, tokens = comp["versions"], comp["token_ids"]
    assert len(tokens) == 400
    k = versions.index(1)  # the first token sampled under the new weights
    assert 0 < k < len(tokens), "the update must land with the request in flight"
    assert versions == [0] * k + [1] * (len(tokens) - k)
    assert pool.stats()[0]["inflight_updates"] == 1
    engine = torch.tensor(comp["logprobs"])
    expected = _kept_cache_reference(hf_model, new_model, PROMPT, tokens, k)
    torch.testing.assert_close(engine, expected, atol=2e-4, rtol=1e-4)
    # neither the old weights alone nor a recomputed cache under the new ones gives these numbers
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        all_new = _logprobs(new_model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1], tokens)
        all_old = _logprobs(hf_model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1], tokens)
    assert (engine[k + 1 :] - all_new[k + 1 :]).abs().max() > 1e-2
    assert (engine[k:] - all_old[k:]).abs().max() > 1e-2

    # a request that starts after the update is all new version and matches the new weights
    after = pool.generate([PROMPT], {**sampling, "max_tokens": 32})[0][0]
    assert after["versions"] == [1] * 32
    ids = torch.tensor([PROMPT + after["token_ids"]])
    with torch.no_grad():
        lp = _logprobs(new_model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1], after["token_ids"])
    torch.testing.assert_close(torch.tensor(after["logprobs"]), lp, atol=2e-4, rtol=1e-4)


@pytest.mark.e2e
def test_partial_rollouts_abort_and_continue_with_the_prefix_recomputed(inflight_pool, hf_model) -> None:
    """``rollout.partial_rollouts``: the update aborts the requests in flight; each completion
    goes on from its tokens so far under the new weights, which compute its prefix again."""
    pool = inflight_pool
    old, new = perturbed(hf_model, seed=4), perturbed(hf_model, seed=5)
    pool.update_weights(old.state_dict())
    v = pool.weight_version
    pool.set_inflight_updates(False)
    pool.set_partial_rollouts(True)
    try:
        stats0 = pool.stats()[0]
        sampling = {"n": 2, "temperature": 1.0, "max_tokens": 300, "ignore_eos": True, "seed": [11]}
        ref = submit_under_way(pool, PROMPT, sampling)
        pool.update_weights(new.state_dict())
        comps = pool.group_result(0, ref, lambda: pytest.fail("the engine died"))
        stats = pool.stats()[0]
    finally:
        pool.set_partial_rollouts(False)
        pool.set_inflight_updates(True)

    assert len(comps) == 2 and comps[0]["token_ids"] != comps[1]["token_ids"]
    assert stats["continued"] - stats0["continued"] == 2  # both completions of the request
    assert stats["inflight_updates"] == stats0["inflight_updates"]  # aborted, not kept in flight
    for comp in comps:
        versions, tokens = comp["versions"], comp["token_ids"]
        assert len(tokens) == 300 and comp["finish_reason"] == "length"
        k = versions.index(v + 1)
        assert 0 < k < len(tokens), "the update must land with the request in flight"
        assert versions == [v] * k + [v + 1] * (len(tokens) - k)
        engine = torch.tensor(comp["logprobs"])
        ids = torch.tensor([PROMPT + tokens])
        n = len(PROMPT)
        with torch.no_grad():
            under_old = _logprobs(old(input_ids=ids).logits[0, n - 1 : n - 1 + k], tokens[:k])
            under_new = _logprobs(new(input_ids=ids).logits[0, n - 1 + k : -1], tokens[k:])
        torch.testing.assert_close(engine, torch.cat([under_old, under_new]), atol=2e-4, rtol=1e-4)
        # not the kept-cache numbers of in-flight updates: the prefix was computed again
        kept = _kept_cache_reference(old, new, PROMPT, tokens, k)
        assert (engine[k + 1 :] - kept[k + 1 :]).abs().max() > 1e-2
