"""Token sampling for the Hugging Face rollout backend: pure torch, one decode step at a time.

``SamplingSpec`` holds the request-wide settings (the keys of ``rlhf.workers.rollout.SAMPLING_KEYS``
that shape the distribution). ``sampling_logprobs`` turns the logits of one step into the
log-distribution the token is drawn from, in vLLM's order and with vLLM's meaning
(``logprobs_mode="processed_logprobs"``): repetition penalty -> stop tokens masked before
``min_tokens`` -> temperature -> min-p -> top-k -> top-p, renormalised over the kept tokens.
The logprob the engine reports for a sampled token is read from that same distribution, so
with top-k/top-p/min-p off and no penalty it is ``log_softmax(logits / temperature)``, what the
trainer computes. Greedy (temperature 0) rows take the argmax and report the plain
``log_softmax(logits)`` (vLLM applies no temperature or truncation to greedy rows).

``draw`` samples by inverse CDF from one uniform per row. The uniforms come from one
``torch.Generator`` per completion seeded by the caller, so a completion's tokens depend on its
seed and its own logits only: not on the batch it shares, nor on how many engines there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingSpec", "draw", "sampling_logprobs"]


@dataclass(frozen=True)
class SamplingSpec:
    """Request-wide sampling settings (vLLM's meaning; ``top_k`` <= 0 and ``top_p`` = 1 are off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    # vLLM/HF (CTRL paper): a seen token's positive logit is divided by the penalty, a negative one multiplied.
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches ``p`` (the most likely is always kept)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _keep_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < floor, float("-inf"))


def sampling_logprobs(
    logits: torch.Tensor,
    spec: SamplingSpec,
    *,
    step: int = 0,
    stop_ids: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The log-distribution one decode step samples from.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        spec: the request's settings.
        step: how many tokens each row has generated so far (for ``min_tokens``).
        stop_ids: ``[S]`` token ids that end a completion (eos and ``stop_token_ids``); masked
            while ``step < spec.min_tokens``.
        seen: ``[B, V]`` bool, tokens in each row's prompt or output (repetition penalty).

    Returns:
        ``[B, V]`` float32 log-probabilities (``-inf`` for tokens that cannot be drawn).
    """
    x = logits.float()
    if spec.repetition_penalty != 1.0 and seen is not None:
        x = _repetition_penalty(x, seen, spec.repetition_penalty)
    if stop_ids is not None and stop_ids.numel() and step < spec.min_tokens:
        x = x.index_fill(-1, stop_ids.to(x.device), float("-inf"))
    if spec.greedy:
        return torch.log_softmax(x, dim=-1)
    if spec.temperature != 1.0:
        x = x / spec.temperature
    x = _keep_top_p(_keep_top_k(_keep_min_p(x, spec.min_p), spec.top_k), spec.top_p)
    return torch.log_softmax(x, dim=-1)


def draw(logprobs: torch.Tensor, uniforms: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """One token per row: the argmax (greedy), else inverse CDF at ``uniforms`` ``[B]`` in (0, 1].

    A token with probability 0 is never drawn: the CDF does not rise at it, and ``u > 0``.
    """
    if greedy:
        return logprobs.argmax(dim=-1)
    cdf = torch.cumsum(logprobs.exp().double(), dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target).squeeze(-1)
    return idx.clamp_(max=logprobs.shape[-1] - 1)
