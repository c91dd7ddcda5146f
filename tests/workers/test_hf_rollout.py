"""The hf rollout backend: a real tiny model sampling with its KV cache, checked against
Hugging Face ``generate`` and a full forward of every completion; then in real Ray actors."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf.workers.hf_rollout import HFRolloutEngine
from rlhf.workers.rollout import RolloutEngineError
from tests.workers.test_rollout import GREEDY, MAX_MODEL_LEN, PROMPTS, hf_greedy, hf_token_logprobs, perturbed


def assert_same_completions(a: list[list[dict]], b: list[list[dict]]) -> None:
    """Same tokens and finish reasons; logprobs equal up to float error (a batch of other
    widths pads differently, which moves the last bits)."""
    assert [[(c["token_ids"], c["finish_reason"]) for c in cs] for cs in a] == [
        [(c["token_ids"], c["finish_reason"]) for c in cs] for cs in b
    ]
    for ca, cb in zip([c for cs in a for c in cs], [c for cs in b for c in cs], strict=True):
        torch.testing.assert_close(
            torch.tensor(ca["logprobs"]), torch.tensor(cb["logprobs"]), atol=1e-5, rtol=1e-5
        )


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_dir(request):
    return str(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir, MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_greedy_equals_hf_generate_in_a_left_padded_batch(engine, hf_model):
    outs = engine.generate(PROMPTS, GREEDY)  # prompts of 2 to 7 tokens share one batch
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        (c,) = comps
        assert c["token_ids"] == hf_greedy(hf_model, prompt, 16)
        assert c["finish_reason"] == ("stop" if c["token_ids"][-1] in engine.stop_ids else "length")


def test_repetition_penalty_counts_prompt_and_output_tokens_as_hf_generate_does(engine, hf_model):
    outs = engine.generate(PROMPTS, {**GREEDY, "repetition_penalty": 1.8})
    plain = engine.generate(PROMPTS, GREEDY)
    assert [c[0]["token_ids"] for c in outs] != [c[0]["token_ids"] for c in plain]
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=16, repetition_penalty=1.8
            )[0, len(prompt) :].tolist()
        assert comps[0]["token_ids"] == ref


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_a_full_forward_at_the_temperature(engine, hf_model, temperature):
    # One token in 12 stops: rows end at different steps and leave the batch (and its cache)
    # while the others go on, so a row mixed up when the batch shrinks would show here.
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    sampling = {
        "n": 3,
        "temperature": temperature,
        "max_tokens": 12,
        "seed": 1,
        "stop_token_ids": list(range(0, vocab, 12)),
    }
    outs = engine.generate(PROMPTS, sampling)
    lengths = [len(c["token_ids"]) for cs in outs for c in cs]
    assert min(lengths) < 6 and max(lengths) == 12 and len(set(lengths)) >= 4, lengths
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        assert len(comps) == 3
        for c in comps:
            ref = hf_token_logprobs(hf_model, prompt, c["token_ids"], temperature)
            torch.testing.assert_close(torch.tensor(c["logprobs"]), ref, atol=1e-5, rtol=1e-5)


def test_seeds_make_each_completion_independent_of_its_batch(engine):
    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 10}
    together = engine.generate(PROMPTS, {**sampling, "seed": 7})
    assert together == engine.generate(PROMPTS, {**sampling, "seed": 7})
    # prompt 2 alone with the seed it had in the batch (7 + 2 * n): the same completions
    alone = engine.generate([PROMPTS[2]], {**sampling, "seed": [7 + 2 * 4]})
    assert_same_completions(alone, together[2:3])
    texts = [tuple(c["token_ids"]) for c in together[2]]
    assert len(set(texts)) > 1, "the n children must not share one seed"
    unseeded = engine.generate(PROMPTS, sampling)
    assert unseeded != engine.generate(PROMPTS, sampling)


def test_stop_tokens_min_tokens_and_room(engine):
    # every token id is a stop token: the first token ends each completion, unless min_tokens holds it
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    every = list(range(vocab))
    outs = engine.generate(
        PROMPTS, {"n": 2, "temperature": 1.0, "max_tokens": 8, "seed": 0, "stop_token_ids": every}
    )
    assert all(len(c["token_ids"]) == 1 and c["finish_reason"] == "stop" for cs in outs for c in cs)
    # every token but 50 stops: min_tokens=3 forces three 50s, then the first other token stops
    held = engine.generate(
        PROMPTS,
        {
            "n": 2,
            "temperature": 1.0,
            "max_tokens": 8,
            "seed": 0,
            "stop_token_ids": every[:50] + every[51:],
            "min_tokens": 3,
        },
    )
    for c in (c for cs in held for c in cs):
        t = c["token_ids"]
        first_other = next((k for k in range(3, len(t)) if t[k] != 50), None)
        assert t[:3] == [50] * 3 and first_other in (len(t) - 1, None)
        assert c["finish_reason"] == ("length" if first_other is None else "stop")
    # a prompt near max_model_len: max_tokens is clipped to the room left
    long_prompt = [1] + [10] * (MAX_MODEL_LEN - 4)
    (comps,) = engine.generate(
        [long_prompt], {"temperature": 1.0, "max_tokens": 50, "seed": 0, "ignore_eos": True}
    )
    assert len(comps[0]["token_ids"]) == 3 and comps[0]["finish_reason"] == "length"


def test_update_weights_serves_the_new_weights_and_refuses_partial_or_foreign_ones(model_dir, hf_model):
    engine = HFRolloutEngine(model_dir, MAX_MODEL_LEN, seed=0)
    new = perturbed(hf_model, seed=5, std=0.2)
    engine.update_weights(new.state_dict().items(), version=3)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [c[0]["token_ids"] for c in outs] == [hf_greedy(new, p, 16) for p in PROMPTS]
    assert [c[0]["token_ids"] for c in outs] != [hf_greedy(hf_model, p, 16) for p in PROMPTS]
    assert engine.stats()["weight_version"] == 3
    named = list(new.named_parameters())
    with pytest.raises(RolloutEngineError, match="left 1 parameters of the engine's model stale"):
        engine.update_weights(named[1:])
    with pytest.raises(RolloutEngineError, match="'model.embed_tokens.weight' .* has shape"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    with pytest.raises(RolloutEngineError, match="'nope' .* no such weight"):
        engine.update_weights([("nope", torch.zeros(3))])


def test_vllm_only_features_are_refused_with_the_fix(model_dir):
    with pytest.raises(RolloutEngineError, match="rollout.weight_sync=object_store"):
        HFRolloutEngine(model_dir, MAX_MODEL_LEN, weight_transfer="nccl")
    with pytest.raises(RolloutEngineError, match="colocate_engines=false"):
        HFRolloutEngine(model_dir, MAX_MODEL_LEN, sleep_mode=True)


@pytest.mark.e2e
def test_a_pool_of_hf_engines_in_ray_matches_one_engine_in_process(ray_session, engine, model_dir, hf_model):
    from rlhf.workers.rollout import default_engine_env
    from rlhf.workers.rollout_pool import RolloutPool

    kwargs = {"model_path": model_dir, "max_model_len": MAX_MODEL_LEN, "dtype": "float32"}
    pool = RolloutPool(2, kwargs, env_vars=default_engine_env(0), engine_cls=HFRolloutEngine)
    try:
        sampling = {"n": 2, "temperature": 1.0, "max_tokens": 10, "seed": 11}
        # two engines, each a shard of the prompts: the same completions as one engine (seeds follow the prompt)
        assert_same_completions(pool.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling))
        new = perturbed(hf_model, seed=9, std=0.2)
        pool.update_weights(new.state_dict())
        outs = pool.generate(PROMPTS, GREEDY)
        assert [c[0]["token_ids"] for c in outs] == [hf_greedy(new, p, 16) for p in PROMPTS]
        assert [s["weight_version"] for s in pool.stats()] == [1, 1]
        cores = len(os.sched_getaffinity(0))
        pool.set_cpu_share(1.0)  # a synchronous run: the engines generate alone
        assert [s["compute_threads"] for s in pool.stats()] == [cores, cores]
        pool.set_cpu_share(0.0)  # next to training: the CPU Ray gave each
        assert [s["compute_threads"] for s in pool.stats()] == [1, 1]
    finally:
        pool.shutdown()
