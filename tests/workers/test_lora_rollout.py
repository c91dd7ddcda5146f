"""vLLM (CPU) engines serving a LoRA policy, checked against PEFT on the same weights (fp32):
after an adapter-only sync (``rollout.lora_sync=adapter``) and after a merged sync (``merged``),
greedy tokens are PEFT's and logprobs agree to 1e-4."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.lora import LoraSettings, adapter_config, adapter_tensors, merged_tensors
from rlhf.workers.rollout import default_engine_env
from rlhf.workers.rollout_pool import RolloutPool

from ..models.test_lora import trained_lora_model
from .test_continuous import submit_under_way

pytestmark = pytest.mark.e2e
LORA = LoraSettings(rank=4, alpha=8.0)
PROMPTS = [[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33, 34, 35]]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
MAX_MODEL_LEN = 64
WORST: dict[str, float] = {}


def _policy(model_dir, seed: int):
    return trained_lora_model(model_dir, LORA, seed, scale=0.3)


def _check_against(model, outs, what: str) -> None:
    worst = 0.0
    for prompt, comps in zip(PROMPTS, outs, strict=True):
        c = comps[0]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt) :]
            ids = torch.tensor([prompt + c["token_ids"]])
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        assert c["token_ids"] == ref.tolist()[: len(c["token_ids"])], what
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(c["token_ids"]))
        worst = max(
            worst, (torch.tensor(c["logprobs"]) - lp[pos, torch.tensor(c["token_ids"])]).abs().max().item()
        )
    WORST[what] = worst
    print(f"\nLoRA engine vs PEFT, {what}: max logprob diff {worst:.2e}")
    assert worst < 1e-4, (what, worst)


def test_adapter_sync_serves_the_peft_policy_and_keeps_k_plus_1_versions(ray_session, tiny_llama_dir):
    from rlhf.workers.lora_rollout import LoraRolloutEngine

    env = {**default_engine_env(0), "HF_HUB_OFFLINE": "1"}
    kwargs = {
        "model_path": str(tiny_llama_dir),
        "max_model_len": 512,  # room for the long request in flight below
        "lora_rank": LORA.rank,
        "adapter_config": adapter_config(LORA, "llama", str(tiny_llama_dir)),
        "keep_versions": 2,  # train.max_staleness=1
    }
    pool = RolloutPool(1, kwargs, engine_cls=LoraRolloutEngine, env_vars=env)
    try:
        base = [c[0]["token_ids"] for c in pool.generate(PROMPTS, GREEDY)]
        for version, seed in ((1, 1), (2, 2), (3, 3)):
            policy = _policy(tiny_llama_dir, seed)
            adapter = adapter_tensors(policy.named_parameters())
            pool.update_weights(adapter)
            assert pool.weight_version == version
            _check_against(policy, pool.generate(PROMPTS, GREEDY), f"adapter v{version}")
        assert [c[0]["token_ids"] for c in pool.generate(PROMPTS, GREEDY)] != base
        import ray

        assert ray.get(pool.engines[0].loaded_versions.remote()) == [2, 3]  # k + 1 = 2 kept
        full = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" not in n)
        sent = sum(t.numel() * t.element_size() for t in adapter.values())
        assert sent < 0.1 * full  # what one sync ships
        v4 = _inflight_adapter_update(pool, policy, tiny_llama_dir)
        _partial_adapter_update(pool, v4, tiny_llama_dir)
    finally:
        pool.shutdown()


def _inflight_adapter_update(pool, policy_v3, model_dir):
    """Streaming (in-flight updates on): adapter v4 lands while a request started under v3 is
    generating; vLLM binds the adapter to the request, so all its tokens are v3's (PEFT's
    log-probs of v3), v3 stays registered while in use, and the next request takes v4."""
    import ray

    pool.set_inflight_updates(True)
    sampling = {"n": 1, "temperature": 1.0, "max_tokens": 400, "ignore_eos": True, "seed": [5]}
    ref = submit_under_way(pool, PROMPTS[0], sampling)
    v4 = _policy(model_dir, 4)
    pool.update_weights(adapter_tensors(v4.named_parameters()))
    assert ray.get(pool.engines[0].loaded_versions.remote()) == [3, 4]  # v2 gone, v3 in use
    comp = pool.group_result(0, ref, lambda: pytest.fail("the engine died"))[0]
    assert pool.stats()[0]["inflight_updates"] == 1, "the update must land with the request in flight"
    assert comp["versions"] == [3] * 400
    ids = torch.tensor([PROMPTS[0] + comp["token_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(policy_v3(input_ids=ids).logits[0].float(), -1)
    pos = torch.arange(len(PROMPTS[0]) - 1, ids.shape[1] - 1)
    torch.testing.assert_close(
        torch.tensor(comp["logprobs"]), lp[pos, ids[0, len(PROMPTS[0]) :]], atol=1e-4, rtol=0
    )
    _check_against(v4, pool.generate(PROMPTS, GREEDY), "adapter v4 after an in-flight update")
    return v4


def _partial_adapter_update(pool, v4, model_dir) -> None:
    """Partial rollouts: adapter v5 lands while a request started under v4 is generating; the
    request is aborted and goes on under v5 from its tokens so far, so its log-probs are PEFT
    v4's before the switch and PEFT v5's (over the whole prefix) after it."""
    import ray

    pool.set_inflight_updates(False)
    pool.set_partial_rollouts(True)
    stats0 = pool.stats()[0]
    sampling = {"n": 1, "temperature": 1.0, "max_tokens": 400, "ignore_eos": True, "seed": [6]}
    ref = submit_under_way(pool, PROMPTS[0], sampling)
    v5 = _policy(model_dir, 5)
    pool.update_weights(adapter_tensors(v5.named_parameters()))
    comp = pool.group_result(0, ref, lambda: pytest.fail("the engine died"))[0]
    assert pool.stats()[0]["continued"] == stats0["continued"] + 1
    assert ray.get(pool.engines[0].loaded_versions.remote()) == [4, 5]  # nothing runs under v3
    k = comp["versions"].index(5)
    assert 0 < k < 400 and comp["versions"] == [4] * k + [5] * (400 - k)
    n = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0] + comp["token_ids"]])
    tokens = ids[0, n:]
    with torch.no_grad():
        old = torch.log_softmax(v4(input_ids=ids).logits[0].float(), -1)[
            torch.arange(n - 1, n - 1 + k), tokens[:k]
        ]
        new = torch.log_softmax(v5(input_ids=ids).logits[0].float(), -1)[
            torch.arange(n - 1 + k, ids.shape[1] - 1), tokens[k:]
        ]
    torch.testing.assert_close(torch.tensor(comp["logprobs"]), torch.cat([old, new]), atol=1e-4, rtol=0)


def test_merged_sync_serves_the_peft_policy(ray_session, tiny_llama_dir):
    env = {**default_engine_env(0), "HF_HUB_OFFLINE": "1"}
    pool = RolloutPool(1, {"model_path": str(tiny_llama_dir), "max_model_len": MAX_MODEL_LEN}, env_vars=env)
    try:
        policy = _policy(tiny_llama_dir, 7)
        pool.update_weights(dict(merged_tensors(policy.named_parameters(), LORA.scaling)))
        _check_against(policy, pool.generate(PROMPTS, GREEDY), "merged")
    finally:
        pool.shutdown()
