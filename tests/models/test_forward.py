"""Packed forward helpers against independent per-sample references (each sample alone, batch of 1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.config import schema
from rlhf.data.packing import pack, unpack
from rlhf.data.types import FlatBatch, Sample
from rlhf.models import forward
from rlhf.models.forward import (
    PACKED_SDPA,
    build_value_model,
    logprobs_from_logits,
    packed_hidden_values,
    packed_logprobs,
    packed_model_kwargs,
    packed_sequence_scores,
    prepare_model_for_packing,
    resolve_attn_impl,
)

pytestmark = pytest.mark.cpu

CPU_PATHS = (PACKED_SDPA, "sdpa", "eager")
# Very different lengths on purpose: a short sample next to a long one is where leaks show.
LENGTHS = (3, 17, 250, 40)
ATOL = 1e-5


def make_samples(vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in LENGTHS:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2 :] = True
        samples.append(Sample(input_ids=torch.randint(8, vocab, (n,), generator=g), action_mask=mask))
    # Multi-turn: user, assistant, tool output (not actions), assistant.
    mask = torch.zeros(60, dtype=torch.bool)
    mask[10:25] = True
    mask[35:] = True
    samples.append(Sample(input_ids=torch.randint(8, vocab, (60,), generator=g), action_mask=mask))
    return samples


def one_batch(samples: list[Sample]) -> FlatBatch:
    (batch,) = pack(samples, budget=sum(len(s) for s in samples))
    return batch


def in_sample_order(flat: torch.Tensor, batch: FlatBatch) -> list[torch.Tensor]:
    parts = unpack(flat, batch.cu_seqlens)
    out: list[torch.Tensor] = [torch.empty(0)] * len(parts)
    for i, p in zip(batch.sample_index.tolist(), parts, strict=True):
        out[i] = p
    return out


def set_impl(model, name: str) -> None:
    model.set_attn_implementation(name)


def reference_logprobs(
    model, ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock sdpa, one unpadded sample, plain ``model(input_ids).logits`` and a full log_softmax."""
    set_impl(model, "sdpa")
    logits = model(input_ids=ids[None]).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logits.new_zeros(len(ids))
    lp[1:] = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    ent = logits.new_zeros(len(ids))
    ent[1:] = -(logp.exp() * logp).sum(-1)[:-1]
    return lp, ent


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_dir(request):
    return request.param, request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def causal_lm(arch_dir):
    return AutoModelForCausalLM.from_pretrained(arch_dir[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def samples(causal_lm) -> list[Sample]:
    return make_samples(causal_lm.config.vocab_size)


@pytest.fixture(scope="module")
def references(causal_lm, samples):
    with torch.no_grad():
        return {t: [reference_logprobs(causal_lm, s.input_ids, t) for s in samples] for t in (1.0, 0.7)}


@pytest.mark.parametrize("impl", CPU_PATHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_match_per_sample(causal_lm, samples, references, impl, temperature):
    batch = one_batch(samples)
    assert prepare_model_for_packing(causal_lm, impl) == impl
    with torch.no_grad():
        lp, ent = packed_logprobs(causal_lm, batch, temperature=temperature, return_entropy=True)
    assert lp.shape == ent.shape == (batch.num_tokens,) and lp.dtype == torch.float32
    starts = batch.cu_seqlens[:-1].long()
    assert torch.all(lp[starts] == 0) and torch.all(ent[starts] == 0)
    for s, got_lp, got_ent, (ref_lp, ref_ent) in zip(
        samples, in_sample_order(lp, batch), in_sample_order(ent, batch), references[temperature], strict=True
    ):
        torch.testing.assert_close(got_lp, ref_lp, atol=ATOL, rtol=0, msg=f"logprobs, len {len(s)}, {impl}")
        torch.testing.assert_close(got_ent, ref_ent, atol=ATOL, rtol=0, msg=f"entropy, len {len(s)}, {impl}")
        # Same on the action tokens only (multi-turn masks select non-contiguous spans).
        m = s.action_mask
        torch.testing.assert_close(got_lp[m].sum(), ref_lp[m].sum(), atol=1e-4, rtol=0)


def test_naive_packing_differs(causal_lm, samples, references):
    """One causal sequence over the whole row lets samples attend to each other: must be far off."""
    batch = one_batch(samples)
    naive = FlatBatch(**{**batch.__dict__, "position_ids": torch.arange(batch.num_tokens)})
    set_impl(causal_lm, "sdpa")
    with torch.no_grad():
        lp, _ = packed_logprobs(causal_lm, naive)
    ref = torch.zeros(batch.num_tokens)
    for i, part in zip(batch.sample_index.tolist(), unpack(ref, batch.cu_seqlens), strict=True):
        part.copy_(references[1.0][i][0])
    err = (lp - ref).abs().max().item()
    # Measured 0.59 (llama) and 0.72 (qwen2) vs ~1e-6 for correct packing.
    assert err > 0.05, f"naive packing agreed with the reference (max err {err}): the test cannot fail"


def test_packed_sdpa_derives_boundaries_from_position_ids(causal_lm, samples, references):
    batch = one_batch(samples)
    prepare_model_for_packing(causal_lm, PACKED_SDPA)
    kw = packed_model_kwargs(causal_lm, batch)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kw.pop(k)
    with torch.no_grad():
        logits = causal_lm(**kw).logits[0]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, batch.input_ids[1:, None]).squeeze(-1)
    for i, (s, e) in enumerate(
        zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist(), strict=True)
    ):
        ref = references[1.0][batch.sample_index[i]][0]
        torch.testing.assert_close(lp[s : e - 1], ref[1:], atol=ATOL, rtol=0)


def test_packed_sdpa_padded_batch_falls_back_to_sdpa(causal_lm):
    """A left-padded batch with an attention mask must behave like stock sdpa (mask honoured)."""
    ids = torch.randint(8, causal_lm.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = {}
    for impl in ("sdpa", PACKED_SDPA):
        set_impl(causal_lm, impl)
        with torch.no_grad():
            outs[impl] = causal_lm(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
            ).logits
    torch.testing.assert_close(outs[PACKED_SDPA][mask.bool()], outs["sdpa"][mask.bool()], atol=ATOL, rtol=0)


def test_auto_picks_packed_sdpa_on_cpu(causal_lm):
    assert resolve_attn_impl(causal_lm, "auto") == PACKED_SDPA
    assert prepare_model_for_packing(causal_lm) == PACKED_SDPA


def test_attn_impls_are_the_config_schema_list():
    assert forward.ATTN_IMPLS is schema.ATTN_IMPLS
    assert PACKED_SDPA in forward.ATTN_IMPLS and "flex_attention" not in forward.ATTN_IMPLS


@pytest.mark.parametrize("bad", ["flex_attention", "flash_attn", "bogus"])
def test_unknown_attn_impl_is_rejected(causal_lm, bad):
    before = causal_lm.config._attn_implementation
    for fn in (resolve_attn_impl, prepare_model_for_packing):
        with pytest.raises(
            ValueError, match=r"model\.attn_impl=.*packed_sdpa, packed_varlen, sdpa, eager"
        ) as e:
            fn(causal_lm, bad)
        assert repr(bad) in str(e.value)
    assert causal_lm.config._attn_implementation == before


def test_entropy_without_grad_matches_graph_version(causal_lm, samples):
    batch = one_batch(samples)
    prepare_model_for_packing(causal_lm, PACKED_SDPA)
    lp_g, ent_g = packed_logprobs(causal_lm, batch, temperature=0.7, return_entropy=True)
    lp_n, ent_n = packed_logprobs(causal_lm, batch, temperature=0.7, return_entropy=True, entropy_grad=False)
    assert ent_g.requires_grad and lp_n.requires_grad and lp_n.grad_fn is not None
    assert not ent_n.requires_grad and ent_n.grad_fn is None
    torch.testing.assert_close(ent_n, ent_g.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(lp_n.detach(), lp_g.detach(), atol=1e-6, rtol=0)


def test_entropy_without_grad_chunked(monkeypatch):
    """Several row chunks (and bf16 logits): same values, no graph for the entropy, logprobs differentiable."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=g) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=g)
    monkeypatch.setattr(forward, "_LOGIT_CHUNK_ELEMS", 50 * 8)
    lp_g, ent_g = logprobs_from_logits(logits, targets, 0.7, return_entropy=True)
    lp_n, ent_n = logprobs_from_logits(logits, targets, 0.7, return_entropy=True, entropy_grad=False)
    assert ent_g.requires_grad and not ent_n.requires_grad
    torch.testing.assert_close(ent_n, ent_g.detach(), atol=1e-6, rtol=0)
    ref = torch.log_softmax(logits.detach().float() / 0.7, -1)
    torch.testing.assert_close(ent_n, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    lp_n.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("impl", [PACKED_SDPA, "sdpa"])
def test_gradients_equal_sum_of_per_sample_gradients(causal_lm, samples, impl):
    weights = [s.action_mask.float() for s in samples]
    causal_lm.zero_grad(set_to_none=True)
    set_impl(causal_lm, "sdpa")
    for s, w in zip(samples, weights, strict=True):
        logits = causal_lm(input_ids=s.input_ids[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, s.input_ids[1:, None]).squeeze(-1)
        (lp * w[1:]).sum().backward()
    ref = {n: p.grad.clone() for n, p in causal_lm.named_parameters()}

    causal_lm.zero_grad(set_to_none=True)
    batch = one_batch(samples)
    prepare_model_for_packing(causal_lm, impl)
    lp, _ = packed_logprobs(causal_lm, batch)
    w = torch.cat([weights[i] for i in batch.sample_index.tolist()])
    (lp * w).sum().backward()
    for n, p in causal_lm.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-4, rtol=1e-4, msg=f"grad of {n}")
    causal_lm.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- value / reward heads
@pytest.fixture(scope="module")
def value_model(arch_dir):
    torch.manual_seed(0)
    return build_value_model(arch_dir[1], init_from_causal_lm=True).eval()


def test_value_head_init(value_model):
    w = value_model.score.weight
    assert w.shape == (1, value_model.config.hidden_size)
    std = 1.0 / (value_model.config.hidden_size + 1)
    assert 0.5 * std < w.std().item() < 1.5 * std


@pytest.mark.parametrize("impl", CPU_PATHS)
def test_values_and_scores_match_per_sample(value_model, samples, impl):
    batch = one_batch(samples)
    prepare_model_for_packing(value_model, impl)
    with torch.no_grad():
        values = packed_hidden_values(value_model, batch)
        scores = packed_sequence_scores(value_model, batch)
        set_impl(value_model, "sdpa")
        for s, got in zip(samples, in_sample_order(values, batch), strict=True):
            hidden = value_model.model(input_ids=s.input_ids[None]).last_hidden_state[0]
            ref = torch.zeros(len(s))
            ref[1:] = value_model.score(hidden).squeeze(-1)[:-1]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        # transformers' own sequence-classification forward picks the last token when no pads.
        ref_scores = torch.stack([value_model(input_ids=s.input_ids[None]).logits[0, 0] for s in samples])
    torch.testing.assert_close(scores, ref_scores[batch.sample_index], atol=ATOL, rtol=0)


def test_value_gradients(value_model, samples):
    value_model.zero_grad(set_to_none=True)
    set_impl(value_model, "sdpa")
    for s in samples:
        hidden = value_model.model(input_ids=s.input_ids[None]).last_hidden_state[0]
        v = value_model.score(hidden).squeeze(-1)[:-1]
        ((v * s.action_mask[1:]).sum() + v[-1]).backward()
    ref = {n: p.grad.clone() for n, p in value_model.named_parameters()}
    value_model.zero_grad(set_to_none=True)
    batch = one_batch(samples)
    prepare_model_for_packing(value_model, PACKED_SDPA)
    values = packed_hidden_values(value_model, batch)
    last = (batch.cu_seqlens[1:] - 1).long()
    ((values * batch.action_mask).sum() + values[last].sum()).backward()
    for n, p in value_model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-4, rtol=1e-4, msg=f"grad of {n}")
    value_model.zero_grad(set_to_none=True)


def test_reward_model_round_trip(value_model, tmp_path):
    value_model.save_pretrained(tmp_path)
    rm = build_value_model(tmp_path, init_from_causal_lm=False, attn_impl="auto")
    assert rm.config._attn_implementation == PACKED_SDPA
    torch.testing.assert_close(rm.score.weight, value_model.score.weight)


def test_missing_head_warns(arch_dir):
    with pytest.warns(UserWarning, match="no trained score head"):
        build_value_model(arch_dir[1], init_from_causal_lm=False)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["flash_attention_2", PACKED_SDPA])
def test_gpu_varlen_bf16(tiny_llama_dir, impl):
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).cuda().eval()
    samples = make_samples(model.config.vocab_size)
    batch = one_batch(samples).to("cuda")
    refs = []
    with torch.no_grad():
        for s in samples:
            refs.append(reference_logprobs(model, s.input_ids.cuda())[0].float())
        prepare_model_for_packing(model, impl)
        lp, _ = packed_logprobs(model, batch)
    for got, ref in zip(in_sample_order(lp, batch), refs, strict=True):
        torch.testing.assert_close(got, ref.to(got.device), atol=5e-2, rtol=0)
