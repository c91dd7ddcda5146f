"""FAKE of the flash-attn package (GPU-only) on CPU, for transformers' ``flash_attention_2`` path.

Stands in only so that what we hand transformers' flash path (``flash_attention_forward`` ->
``_flash_attention_forward`` -> ``flash_attn_varlen_func``) is checked here: the kernel name it
loads, the row's ``cu_seqlens`` and max lengths, the causal flag, the window and soft-cap
keywords. The math is a plain loop with flash-attn's semantics; the real kernel is checked by
``bench/gpu_step.py`` on a GPU.
"""

from __future__ import annotations

import sys
import types

import torch


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q: [T, H, D], k/v: [T, H_kv, D] (GQA by head groups) -> [T, H, D]."""
    flash_attn_varlen_func.calls += 1
    assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k) and dropout_p == 0.0
    assert int(max_seqlen_q) == int(cu_seqlens_q.diff().max()), "max_seqlen must be the longest segment"
    left = window_size[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for s, e in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
        for i in range(s, e):
            lo = s if left < 0 else max(s, i - left)
            w = torch.einsum("hd,jhd->hj", q[i], k[lo : i + 1]) * scale
            if softcap:
                w = softcap * torch.tanh(w / softcap)
            out[i] = torch.einsum("hj,jhd->hd", torch.softmax(w, -1), v[lo : i + 1])
    return out


flash_attn_varlen_func.calls = 0


def _unused(*args, **kwargs):
    raise AssertionError("the packed path must only call flash_attn_varlen_func")


def install() -> None:
    """Make ``import flash_attn`` find this fake and transformers believe flash-attn 2 is there."""
    from transformers import modeling_flash_attention_utils as fa_utils

    pkg = types.ModuleType("flash_attn")
    pkg.flash_attn_func = pkg.flash_attn_with_kvcache = _unused
    pkg.flash_attn_varlen_func = flash_attn_varlen_func
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input = padding.unpad_input = _unused
    sys.modules.update({"flash_attn": pkg, "flash_attn.bert_padding": padding})
    fa_utils.is_flash_attn_2_available = lambda: True
    fa_utils._loaded_implementation = None  # load again, from the fake
