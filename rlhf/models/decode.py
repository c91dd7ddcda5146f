"""Batched sampling with a Hugging Face causal LM and its KV cache: the ``hf`` rollout backend.

Every prompt is prefilled once and its cache copied to its ``n`` completions; prompts are
left-padded (the attention mask hides the pads, position ids start at each prompt's first
real token). A completion that stops leaves the batch, so the last decode steps compute only
the rows still running. Sampling is ``rlhf.models.sampling``: one seeded generator per
completion, vLLM's processed logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rlhf.models.sampling import SamplingSpec, draw, sampling_logprobs

__all__ = ["Completion", "sample_completions"]

# Rows that stopped are dropped from the batch (and the cache) once they are this share of it:
# dropping copies the whole cache, so it is batched rather than done for every finished row.
_PRUNE_SHARE = 0.125


@dataclass
class Completion:
    """One sampled response: its tokens (ending with the stop token if it stopped), the
    logprob of each under the distribution it was drawn from, and ``"stop"`` | ``"length"``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def _left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _uniforms(seeds: list[int], steps: int) -> torch.Tensor:
    """``[rows, steps]`` draws in (0, 1], row ``r`` from its own generator seeded ``seeds[r]``."""
    out = torch.empty(len(seeds), steps, dtype=torch.float64)
    for r, seed in enumerate(seeds):
        out[r] = 1.0 - torch.rand(steps, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return out


class _Batch:
    """The rows still decoding: their original index, attention mask and next position."""

    def __init__(self, rows: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor):
        self.rows, self.mask, self.next_pos = rows, mask, next_pos

    def keep(self, keep: torch.Tensor, cache: DynamicCache) -> None:
        idx = keep.nonzero().squeeze(-1)
        cache.batch_select_indices(idx)
        self.rows, self.mask, self.next_pos = self.rows[idx], self.mask[idx], self.next_pos[idx]

    def step(self, model: torch.nn.Module, tokens: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Feed each row its last token; returns the next-token logits ``[rows, V]``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=-1)
        logits = model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.mask,
            position_ids=self.next_pos,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        self.next_pos = self.next_pos + 1
        return logits


def _prefill(
    model: torch.nn.Module, prompts: list[list[int]], n: int, device: torch.device
) -> tuple[torch.Tensor, DynamicCache, _Batch]:
    """Each prompt's forward once, then its cache, mask and last logits copied to its ``n`` rows.

    Returns ``(next-token logits [rows, V], cache, batch)``."""
    ids, mask = _left_padded(prompts, device)
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits, mask, pos = (x.repeat_interleave(n, 0) for x in (logits, mask, pos))
    return logits, cache, _Batch(torch.arange(len(prompts) * n, device=device), mask, pos[:, -1:] + 1)


def _seen_tokens(
    model: torch.nn.Module, prompts: list[list[int]], n: int, device: torch.device
) -> torch.Tensor:
    """``[prompts * n, V]`` bool: the tokens of each row's prompt (for the repetition penalty)."""
    seen = torch.zeros(len(prompts), model.get_output_embeddings().weight.shape[0], dtype=torch.bool)
    for i, p in enumerate(prompts):
        seen[i, p] = True
    return seen.repeat_interleave(n, 0).to(device)


@torch.inference_mode()
def sample_completions(
    model: torch.nn.Module,
    prompts: list[list[int]],
    n: int,
    spec: SamplingSpec,
    max_tokens: list[int],
    seeds: list[int],
    stop_ids: list[int],
) -> list[list[Completion]]:
    """``n`` completions of each prompt, in prompt order (completion ``k`` of prompt ``i`` is
    row ``i * n + k``).

    Args:
        model: a causal LM in eval mode (any HF ``AutoModelForCausalLM``).
        prompts: token ids, each non-empty.
        n: completions per prompt.
        spec: the sampling settings.
        max_tokens: per prompt, the most tokens a completion may have.
        seeds: per completion (``len(prompts) * n``), the seed of its generator.
        stop_ids: tokens that end a completion (eos, ``stop_token_ids``); the token is kept.
    """
    device = next(model.parameters()).device
    rows = len(prompts) * n
    if len(seeds) != rows or len(max_tokens) != len(prompts):
        raise ValueError(
            f"need {rows} seeds and {len(prompts)} max_tokens, got {len(seeds)} and {len(max_tokens)}"
        )
    limit = torch.tensor(max_tokens, dtype=torch.long).repeat_interleave(n).to(device)
    uniforms = _uniforms(seeds, int(limit.max())).to(device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    logits, cache, batch = _prefill(model, prompts, n, device)
    seen = _seen_tokens(model, prompts, n, device) if spec.repetition_penalty != 1.0 else None
    out = [Completion([], [], "length") for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    for t in range(uniforms.shape[1]):
        lp = sampling_logprobs(
            logits, spec, step=t, stop_ids=stops, seen=None if seen is None else seen[batch.rows]
        )
        tok = draw(lp, uniforms[batch.rows, t], spec.greedy)
        live = ~done[batch.rows]
        stopped = torch.isin(tok, stops) & live
        picked = zip(
            batch.rows[live].tolist(),
            tok[live].tolist(),
            lp.gather(-1, tok.unsqueeze(-1))[live, 0].tolist(),
            strict=True,
        )
        for r, token, logprob in picked:
            out[r].token_ids.append(token)
            out[r].logprobs.append(logprob)
        for r in batch.rows[stopped].tolist():
            out[r].finish_reason = "stop"
        done[batch.rows] |= stopped | (limit[batch.rows] <= t + 1)
        if bool(done.all()):
            break
        if seen is not None:
            seen[batch.rows, tok] = True
        finished = done[batch.rows]
        if int(finished.sum()) >= max(1, int(_PRUNE_SHARE * len(batch.rows))):
            batch.keep(~finished, cache)
            tok = tok[~finished]
        logits = batch.step(model, tok, cache)
    return [out[i * n : (i + 1) * n] for i in range(len(prompts))]
