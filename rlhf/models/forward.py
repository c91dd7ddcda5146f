"""Forward passes on a packed ``FlatBatch``: per-token logprobs/entropy, values, sequence scores.

A packed micro-batch is ONE row ``[1, T]`` holding several samples back to back; position_ids
restart at 0 for each sample and ``cu_seqlens`` marks the boundaries. No token may attend to
another sample: the attention paths that guarantee it are in ``rlhf.models.attention``
(``prepare_model_for_packing`` picks one). Outputs are aligned to the token (see
``rlhf.data.types``): ``logprobs[t] = log p(x_t | x_<t)``, ``entropy[t]`` / ``values[t]`` come
from the hidden state that predicted token ``t``, and every sample's first position
(``cu_seqlens[:-1]``) is 0.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rlhf.config.schema import ATTN_IMPLS
from rlhf.data.types import FlatBatch
from rlhf.models.attention import (
    PACKED_SDPA,
    PACKED_VARLEN,
    VARLEN_KWARG_IMPLS,
    prepare_model_for_packing,
    resolve_attn_impl,
    unwrap_model,
)
from rlhf.models.sequence_parallel import gather_row, sequence_parallel_of, split_row

__all__ = [
    "ATTN_IMPLS",
    "PACKED_SDPA",
    "PACKED_VARLEN",
    "build_value_model",
    "logprobs_from_logits",
    "packed_hidden_values",
    "packed_logprobs",
    "packed_model_kwargs",
    "packed_sequence_scores",
    "prepare_model_for_packing",
    "resolve_attn_impl",
]

# Rows of logits upcast to float32 at once: bounds the temporary copy to ~512 MiB under no_grad.
_LOGIT_CHUNK_ELEMS = 1 << 27


def packed_model_kwargs(model: torch.nn.Module, batch: FlatBatch) -> dict:
    """Keyword arguments for a packed forward of ``batch`` (rows [1, T]) on ``model``."""
    impl = unwrap_model(model).config._attn_implementation or ""
    kw = {
        "input_ids": batch.input_ids.unsqueeze(0),
        "position_ids": batch.position_ids.unsqueeze(0),
        "attention_mask": None,
        "use_cache": False,
    }
    if impl in VARLEN_KWARG_IMPLS:
        cu = batch.cu_seqlens.to(device=batch.input_ids.device, dtype=torch.int32)
        max_len = int(batch.seqlens.max()) if batch.num_samples else 0
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    return kw


# ---------------------------------------------------------------------------- outputs
def _first_positions(batch: FlatBatch, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool, device=device)
    mask[batch.cu_seqlens[:-1].to(device=device, dtype=torch.long)] = True
    return mask


def _shift_to_tokens(pred: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
    """``pred[i]`` was computed at position i for token i+1 ([T-1]) -> aligned [T], 0 at sample starts."""
    out = torch.cat([pred.new_zeros(1), pred])
    return out.masked_fill(_first_positions(batch, out.device), 0.0)


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[target]`` (and entropy) per row, in float32.

    Uses ``logit[target] - logsumexp(logits)`` instead of a full log_softmax, in row chunks so
    the float32 copy of a bf16 ``[N, V]`` logits tensor is never made whole when not training.
    ``entropy_grad=False`` computes the entropy from detached logits under ``no_grad`` (a
    statistic only): no ``[N, V]`` softmax is kept in the autograd graph for it.
    """
    rows = max(1, _LOGIT_CHUNK_ELEMS // max(1, logits.shape[-1]))
    lps, ents = [], []
    for lg, tg in zip(logits.split(rows), targets.split(rows), strict=True):
        lg = lg.float()
        if temperature != 1.0:
            lg = lg / temperature
        lse = torch.logsumexp(lg, dim=-1)
        lps.append(lg.gather(-1, tg.unsqueeze(-1)).squeeze(-1) - lse)
        if return_entropy:
            # H = lse - sum(p * logit), with p = softmax(logit).
            if entropy_grad:
                ents.append(lse - (torch.softmax(lg, dim=-1) * lg).sum(-1))
            else:
                with torch.no_grad():
                    lg_d = lg.detach()
                    ents.append(lse.detach() - (torch.softmax(lg_d, dim=-1) * lg_d).sum(-1))
    lp = torch.cat(lps) if lps else logits.new_zeros(0, dtype=torch.float32)
    ent = (torch.cat(ents) if ents else lp.new_zeros(0)) if return_entropy else None
    return lp, ent


def packed_logprobs(
    model: torch.nn.Module,
    batch: FlatBatch,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs ``[T]`` (float32, differentiable) and optionally entropy ``[T]``.

    ``logprobs[t] = log p(x_t | x_<t)`` under ``softmax(logits / temperature)``;
    ``entropy[t]`` is the entropy of that same distribution. Both are 0 at ``cu_seqlens[:-1]``.
    ``entropy_grad=False``: the entropy is a detached statistic (no graph kept for it).
    ``model`` is a causal LM (or a wrapper whose forward takes the HF kwargs).
    """
    sp = sequence_parallel_of(model)
    if sp is None:
        logits = model(**packed_model_kwargs(model, batch)).logits[0]
        lp, ent = logprobs_from_logits(
            logits[:-1], batch.input_ids[1:], temperature, return_entropy, entropy_grad=entropy_grad
        )
    else:
        # This rank's slice of the row; the last position of the row predicts nothing.
        split = split_row(sp, batch)
        logits = model(**split.model_kwargs()).logits[0]
        lp, ent = logprobs_from_logits(
            logits, split.targets, temperature, return_entropy, entropy_grad=entropy_grad
        )
        lp = gather_row(lp, split)[:-1]
        ent = gather_row(ent, split)[:-1] if ent is not None else None
    return _shift_to_tokens(lp, batch), (_shift_to_tokens(ent, batch) if ent is not None else None)


def _head_per_position(model: torch.nn.Module, batch: FlatBatch) -> torch.Tensor:
    """``score(hidden[t])`` for every position of the row: ``[T]`` float32."""
    m = unwrap_model(model)
    head = getattr(m, "score", None)
    if head is None:
        raise TypeError(f"{type(m).__name__} has no `.score` head; build it with build_value_model")
    sp = sequence_parallel_of(m)
    if sp is None:
        hidden = m.base_model(**packed_model_kwargs(m, batch)).last_hidden_state[0]
        return head(hidden).squeeze(-1).float()
    split = split_row(sp, batch)
    hidden = m.base_model(**split.model_kwargs()).last_hidden_state[0]
    return gather_row(head(hidden).squeeze(-1).float(), split)


def packed_hidden_values(model: torch.nn.Module, batch: FlatBatch) -> torch.Tensor:
    """Critic values ``[T]`` float32: ``values[t] = score(hidden[t-1])``, 0 at each sample's start.

    The value of token ``t`` is that of the state before it, the same shift as the logprobs,
    so values, logprobs and the action mask line up index by index.
    """
    return _shift_to_tokens(_head_per_position(model, batch)[:-1], batch)


def packed_sequence_scores(model: torch.nn.Module, batch: FlatBatch) -> torch.Tensor:
    """Reward-model scores ``[B]`` float32: the head on each sample's LAST token (no pad lookup)."""
    per_position = _head_per_position(model, batch)
    last = batch.cu_seqlens[1:].to(device=per_position.device, dtype=torch.long) - 1
    return per_position[last]


# ---------------------------------------------------------------------------- value models
def build_value_model(
    path_or_model_dir: str | Path,
    init_from_causal_lm: bool,
    *,
    dtype: torch.dtype = torch.float32,
    attn_impl: str | None = None,
) -> PreTrainedModel:
    """Load ``AutoModelForSequenceClassification`` with ``num_labels=1`` (critic or reward model).

    ``init_from_causal_lm=True``: the directory holds a causal LM, so the ``score`` head is new;
    it is drawn from a normal with std 1/(hidden_size+1), as OpenRLHF does for its value heads:
    small enough that initial values/rewards are near 0 whatever the hidden-state scale, but
    not zero, so the head gets gradients through every hidden unit from the first step.
    ``False``: the head is loaded from the directory (a trained reward model or critic); a
    missing head is warned about.
    ``attn_impl`` (optional) is applied with ``prepare_model_for_packing``.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    # From a causal LM the report "lm_head UNEXPECTED, score MISSING" is the expected outcome,
    # printed on every start; the keys are checked here instead, and anything else is an error.
    verbosity = hf_logging.get_verbosity()
    if init_from_causal_lm:
        hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(path_or_model_dir), num_labels=1, dtype=dtype, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info.get("missing_keys", []) if k.startswith("score.")]
    if init_from_causal_lm:
        other = [k for k in info.get("missing_keys", []) if not k.startswith("score.")]
        if other:
            raise ValueError(f"{path_or_model_dir} lacks weights of the model body: {sorted(other)[:8]}")
        _init_value_head(model.score.weight, std=1.0 / (model.config.hidden_size + 1))
    elif missing:
        warnings.warn(
            f"{path_or_model_dir} has no trained score head ({missing}); its scores are random. "
            "Pass init_from_causal_lm=True for a critic initialised from a causal LM.",
            stacklevel=2,
        )
    if getattr(model.config, "pad_token_id", None) is None:
        # Only transformers' own forward needs it; set it so that forward works for debugging.
        model.config.pad_token_id = model.config.eos_token_id
    if attn_impl is not None:
        prepare_model_for_packing(model, attn_impl)
    return model


def _init_value_head(weight: torch.Tensor, std: float) -> None:
    if hasattr(weight, "ds_id"):
        # Partitioned by ZeRO-3 (from_pretrained under zero.Init): gather, set on rank 0, scatter.
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            weight.normal_(mean=0.0, std=std)
        return
    with torch.no_grad():
        weight.normal_(mean=0.0, std=std)
