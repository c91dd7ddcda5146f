"""DAPO's reward shaping and batch filtering (Yu et al. 2025), as pure functions.

- :func:`overlong_penalty`: a linear penalty over the last ``buffer_len`` tokens before the
  generation limit, added to the score ("soft overlong punishment"). Multi-turn: the limit
  is per policy turn (``rollout.max_new_tokens``), so the length it is compared with is the
  trajectory's longest policy turn (:func:`longest_turn`), not the sum over turns: ten short
  tool calls are not "overlong"; one turn that ran into the limit is.
- :func:`informative_samples`: which samples belong to a group whose scores are not all
  equal; a group where every sample scored the same has zero advantage under any group
  estimator and only dilutes the batch ("dynamic sampling" keeps generating until the batch
  holds enough informative groups).
"""

from __future__ import annotations

import torch

__all__ = ["informative_samples", "longest_turn", "overlong_penalty"]


def longest_turn(action_mask: torch.Tensor) -> int:
    """Length of the longest run of policy tokens in one sample's ``[T]`` action mask (its
    longest policy turn; a single-turn sample's whole response).

    Args:
        action_mask (torch.Tensor): ``[T]`` bool, True on tokens the policy sampled.
    """
    if action_mask.numel() == 0:
        return 0
    count = torch.cumsum(action_mask.long(), 0)
    # the count at the last non-policy token before each position; the run is what came since
    before = torch.cummax(torch.where(action_mask.bool(), 0, count), 0).values
    return int((count - before).max())


def overlong_penalty(
    response_lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment.

    With ``expected = max_len - buffer_len``::

        penalty = 0                                          if len <= expected
                = -(len - expected) / buffer_len * factor    if expected < len <= max_len
                = -factor                                    beyond max_len

    i.e. ``min(-(len - expected) / buffer_len * factor, 0)`` as verl computes it, bounded
    below by ``-factor``.

    Args:
        response_lengths (torch.Tensor): ``[B]`` policy tokens per sample (multi-turn: of its
            longest turn, :func:`longest_turn`).
        max_len (int): the generation limit (``rollout.max_new_tokens``).
        buffer_len (int): length of the penalty ramp, ``1 <= buffer_len <= max_len``.
        penalty_factor (float): the penalty at ``max_len``. Default 1.0.

    Returns:
        torch.Tensor: ``[B]`` float32 penalties, ``<= 0``.
    """
    if not 1 <= buffer_len <= max_len:
        raise ValueError(f"overlong buffer must be in [1, max_len={max_len}] tokens, got {buffer_len}")
    exceed = response_lengths.float() - (max_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(min=-abs(penalty_factor), max=0.0)


def informative_samples(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: True for samples whose group's scores are not all equal.

    A group of one sample is never informative (nothing to compare it with).

    Args:
        scores (torch.Tensor): ``[B]`` final sequence scores.
        group_ids (torch.Tensor): ``[B]`` integer group id per sample.
    """
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be [B]")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    x = scores.float()
    hi = torch.full((n,), -torch.inf).scatter_reduce(0, inverse, x, reduce="amax")
    lo = torch.full((n,), torch.inf).scatter_reduce(0, inverse, x, reduce="amin")
    return (hi > lo)[inverse]
