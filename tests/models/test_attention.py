"""Packed attention on ten decoder families against a per-sample eager forward.

Sliding-window models get samples both shorter and longer than the window (the band only
matters in the longer ones); Gemma2 also caps its attention logits. The reference is each
sample alone through transformers' eager attention, which implements both features itself.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rlhf.data.packing import pack, unpack
from rlhf.data.types import Sample
from rlhf.models import attention
from rlhf.models.attention import (
    PACKED_SDPA,
    PACKED_VARLEN,
    VarlenKernel,
    choose_attn_impl,
    prepare_model_for_packing,
)
from rlhf.models.forward import packed_logprobs

pytestmark = pytest.mark.cpu

WINDOW = 16
# Shorter than, equal to, just over and far over the window; 70 spans several query chunks
# when the chunk is shrunk below.
LENGTHS = (5, 16, 17, 40, 70, 3)
VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# name -> (config class, extra fields). Qwen2 is also run with its sliding window switched on.
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_sliding": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    # Larger init and softcap 1.0: random-init attention logits would otherwise stay far
    # below the cap, and the cap would change nothing.
    "gemma2": (
        "Gemma2Config",
        {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0, "head_dim": 16, "initializer_range": 0.3},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16},
    ),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW, "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None, "hidden_act": "gelu"}),
    "granite": ("GraniteConfig", {}),
}


def build(name: str, **overrides) -> torch.nn.Module:
    cls_name, extra = ARCHS[name]
    fields = {**COMMON, **extra, **overrides}
    if fields.get("num_key_value_heads") is None:
        fields.pop("num_key_value_heads")
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**fields)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def make_samples(seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(input_ids=torch.randint(1, VOCAB, (n,), generator=g), action_mask=torch.arange(n) > 0)
        for n in LENGTHS
    ]


def eager_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """One sample alone, transformers' eager attention, full log_softmax."""
    model.set_attn_implementation("eager")
    logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    lp = torch.zeros(len(ids))
    lp[1:] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    return lp


def packed_per_sample(model, samples: list[Sample], impl: str) -> list[torch.Tensor]:
    (batch,) = pack(samples, budget=sum(len(s) for s in samples))
    assert prepare_model_for_packing(model, impl) == impl
    lp, _ = packed_logprobs(model, batch)
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for i, part in zip(batch.sample_index.tolist(), unpack(lp, batch.cu_seqlens), strict=True):
        out[i] = part
    return out


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    model = build(request.param)
    samples = make_samples()
    with torch.no_grad():
        refs = [eager_logprobs(model, s.input_ids) for s in samples]
    return request.param, model, samples, refs


@pytest.mark.parametrize("chunk", [1024, 8])
def test_packed_sdpa_matches_per_sample_eager(arch, chunk, monkeypatch):
    """chunk=8 sends every long sample of a windowed/capped layer through several query chunks."""
    name, model, samples, refs = arch
    monkeypatch.setattr(attention, "_QUERY_CHUNK", chunk)
    with torch.no_grad():
        got = packed_per_sample(model, samples, PACKED_SDPA)
    for s, g, r in zip(samples, got, refs, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0, msg=f"{name}, sample of {len(s)} tokens")


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen2_sliding"])
def test_the_window_and_cap_change_the_reference(name):
    """Without these features the long samples would differ: the comparison above can fail."""
    samples = make_samples()
    plain = {"sliding_window": None, "use_sliding_window": False} if name != "gemma2" else {}
    if name == "gemma2":
        plain = {"attn_logit_softcapping": None, "sliding_window": 4096}
    with torch.no_grad():
        a = [eager_logprobs(build(name), s.input_ids) for s in samples]
        b = [eager_logprobs(build(name, **plain), s.input_ids) for s in samples]
    for s, x, y in zip(samples, a, b, strict=True):
        diff = (x - y).abs().max().item()
        # The last position predicts nothing, so a window first matters at WINDOW + 2 tokens.
        if len(s) > WINDOW + 1 or (name == "gemma2" and len(s) > 2):
            assert diff > 1e-3, f"{name}: window/cap made no difference on {len(s)} tokens"
        else:
            assert diff < 1e-5, f"{name}: a sample within the window changed ({diff})"


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_banded_gradients_match_per_sample(name, monkeypatch):
    monkeypatch.setattr(attention, "_QUERY_CHUNK", 8)
    model = build(name)
    samples = make_samples()
    model.zero_grad(set_to_none=True)
    for s in samples:
        eager_logprobs(model, s.input_ids).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sum(lp.sum() for lp in packed_per_sample(model, samples, PACKED_SDPA)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-4, rtol=1e-4, msg=f"grad of {n}")


def test_packed_row_builds_no_dense_mask(monkeypatch):
    """Neither the causal nor the sliding-window mask builder runs for a packed row."""

    def refuse(*a, **k):
        raise AssertionError("a dense attention mask was built for a packed row")

    monkeypatch.setattr(attention, "sdpa_mask", refuse)
    with torch.no_grad():
        packed_per_sample(build("gemma3"), make_samples(), PACKED_SDPA)


def test_attention_sinks_are_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="s_aux"):
        attention.packed_sdpa_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


# ---------------------------------------------------------------------------- CUDA varlen plumbing
def fake_flash_varlen_cpu(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), is_causal=None, enable_gqa=False
):
    """FAKE of torch's GPU-only varlen_attn (flash semantics), a plain loop on CPU.

    Stands in for the CUDA kernel only so that the layout, boundary, window and GQA plumbing
    of ``packed_varlen`` is checked here; the real kernel is checked by bench/gpu_step.py.
    """
    fake_flash_varlen_cpu.calls += 1
    left, right = window_size
    if is_causal:
        left, right = -1, 0
    assert right == 0, "packed_varlen must ask for causal attention"
    assert max_q == max(cu_q.diff().tolist()) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    assert k.shape[1] == q.shape[1], "GQA needs enable_gqa or repeated heads"
    out = torch.empty_like(q)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        for i in range(s, e):
            lo = s if left < 0 else max(s, i - left)
            w = torch.einsum("hd,jhd->hj", q[i], k[lo : i + 1]) * scale
            out[i] = torch.einsum("hj,jhd->hd", torch.softmax(w, -1), v[lo : i + 1])
    return out


@pytest.mark.parametrize(
    "kernel_kw",
    [
        dict(has_window=True, has_is_causal=False, has_gqa=True),
        dict(has_window=False, has_is_causal=True, has_gqa=False),  # first torch release's keywords
    ],
    ids=["window_kw", "is_causal_kw"],
)
@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma2"])
def test_packed_varlen_plumbing(name, kernel_kw, monkeypatch):
    kernel = VarlenKernel(fn=fake_flash_varlen_cpu, **kernel_kw)
    monkeypatch.setattr(attention, "torch_varlen_kernel", lambda: kernel)
    fake_flash_varlen_cpu.calls = 0
    model = build(name)
    samples = make_samples()
    with torch.no_grad():
        refs = [eager_logprobs(model, s.input_ids) for s in samples]
        got = packed_per_sample(model, samples, PACKED_VARLEN)
    for s, g, r in zip(samples, got, refs, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0, msg=f"{name}, {len(s)} tokens")
    # Which layers the kernel serves: all, except soft-capped ones and windows it cannot express.
    served = {"qwen2": 2, "mistral": 2 if kernel.has_window else 0, "gemma2": 0}[name]
    assert fake_flash_varlen_cpu.calls == served


@pytest.mark.parametrize("gqa_kw", [True, False], ids=["enable_gqa", "repeated_heads"])
@pytest.mark.parametrize("window", [None, 3])
def test_packed_varlen_call_fits_torchs_real_op_on_the_meta_device(gqa_kw, window):
    """The installed torch's real varlen_attn (GPU-only kernels, but shape functions for the
    meta device) accepts our call, forward and backward: argument order, int32 offsets, the
    window tuple and, when torch lacks ``enable_gqa`` (2.11), the repeated KV heads."""
    real = attention.torch_varlen_kernel()
    if real is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    if gqa_kw and not real.has_gqa:
        pytest.skip("this torch's varlen_attn has no enable_gqa")
    kernel = VarlenKernel(
        fn=real.fn, has_window=real.has_window, has_is_causal=real.has_is_causal, has_gqa=gqa_kw
    )
    if not kernel.supports(window):
        pytest.skip("this torch's varlen_attn cannot express a window")
    t, heads, kv_heads, dim = 10, 4, 2, 16
    q, k, v = (
        torch.randn(t, h, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    out = kernel(q, k, v, cu, 6, scale=dim**-0.5, window=window)
    assert out.shape == (t, heads, dim) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_packed_varlen_without_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(attention, "torch_varlen_kernel", lambda: None)
    with pytest.raises(ValueError, match="packed_varlen needs torch.nn.attention.varlen"):
        prepare_model_for_packing(build("llama"), PACKED_VARLEN)


@pytest.mark.parametrize(
    "device,dtype,flash,varlen,want",
    [
        ("cpu", torch.float32, False, False, PACKED_SDPA),
        ("cpu", torch.bfloat16, True, True, PACKED_SDPA),
        ("cuda", torch.bfloat16, True, True, "flash_attention_2"),
        ("cuda", torch.float16, False, True, PACKED_VARLEN),
        ("cuda", torch.bfloat16, False, False, PACKED_SDPA),
        # fp32 on CUDA: flash kernels take no fp32, and a dense mask is never the answer.
        ("cuda", torch.float32, True, True, PACKED_SDPA),
    ],
)
def test_auto_rule(device, dtype, flash, varlen, want):
    assert choose_attn_impl(device, dtype, flash_attn=flash, torch_varlen=varlen) == want


def test_dense_mask_paths_warn():
    with pytest.warns(UserWarning, match=r"dense \[T, T\] mask"):
        prepare_model_for_packing(build("llama"), "sdpa")


# ---------------------------------------------------------------------------- length groups
SIMILAR = (40, 40, 38, 35, 33, 31, 30, 13, 12, 12, 3)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_similar_lengths_are_batched_in_padded_groups(name):
    """Samples of close lengths share padded SDPA calls: same logprobs and gradients as each alone."""
    g = torch.Generator().manual_seed(1)
    samples = [
        Sample(input_ids=torch.randint(1, VOCAB, (n,), generator=g), action_mask=torch.arange(n) > 0)
        for n in SIMILAR
    ]
    bounds = [0]
    for n in SIMILAR:
        bounds.append(bounds[-1] + n)
    plan = attention._plan_groups(bounds, torch.device("cpu"))
    # Fewer calls than samples, and some groups padded, some not.
    assert len(plan.groups) < len(SIMILAR) and len(plan.groups) > 1
    assert any(gr.keep is not None for gr in plan.groups) and any(gr.keep is None for gr in plan.groups)
    model = build(name, sliding_window=64) if name == "mistral" else build(name)
    model.zero_grad(set_to_none=True)
    refs = []
    for s in samples:
        lp = eager_logprobs(model, s.input_ids)
        lp.sum().backward()
        refs.append(lp.detach())
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = packed_per_sample(model, samples, PACKED_SDPA)
    sum(lp.sum() for lp in got).backward()
    for s, gl, r in zip(samples, got, refs, strict=True):
        torch.testing.assert_close(gl.detach(), r, atol=1e-5, rtol=0, msg=f"{name}, {len(s)} tokens")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-4, rtol=1e-4, msg=f"grad of {n}")
