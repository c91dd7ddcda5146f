"""Random packed batches (multi-turn action masks, very different lengths) for the algorithm tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass
class PackedBatch:
    masks: list[list[bool]]  # per-sample action masks, plain python for the loop references
    seed: int

    @property
    def lengths(self) -> list[int]:
        return [len(m) for m in self.masks]

    @property
    def num_samples(self) -> int:
        return len(self.masks)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def action_mask(self) -> torch.Tensor:
        return torch.tensor([b for m in self.masks for b in m], dtype=torch.bool)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        cu = [0]
        for n in self.lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32)

    def spans(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:], strict=True))

    def action_indices(self) -> list[list[int]]:
        """Global indices of each sample's action tokens, in order."""
        out = []
        for (start, _), m in zip(self.spans(), self.masks, strict=True):
            out.append([start + j for j, b in enumerate(m) if b])
        return out

    def randn(self, offset: int = 0, poison: float | None = float("nan")) -> torch.Tensor:
        """Random ``[T]`` float64 tensor; non-action positions hold ``poison`` (unless None)."""
        g = torch.Generator().manual_seed(self.seed + offset)
        x = torch.randn(self.total, generator=g, dtype=torch.float64)
        if poison is not None:
            x[~self.action_mask] = poison
        return x


@st.composite
def sample_masks(draw: st.DrawFn, max_span: int = 8) -> list[bool]:
    """One sample: prompt, then alternating action / observation spans, optional trailing tokens."""
    prompt = draw(st.integers(1, 4))
    n_turns = draw(st.integers(1, 3))
    span = st.one_of(st.just(1), st.integers(1, max_span), st.integers(20, 60))
    mask = [False] * prompt
    for turn in range(n_turns):
        if turn > 0:
            mask += [False] * draw(st.integers(1, 4))
        mask += [True] * draw(span)
    mask += [False] * draw(st.integers(0, 2))
    return mask


@st.composite
def packed_batches(draw: st.DrawFn, max_samples: int = 6) -> PackedBatch:
    masks = draw(st.lists(sample_masks(), min_size=1, max_size=max_samples))
    return PackedBatch(masks=masks, seed=draw(st.integers(0, 2**31 - 1)))


def fixed_batch() -> PackedBatch:
    """Deterministic batch covering: single action token, multi-turn, very long and short samples."""
    masks = [
        [False, True],
        [False, False, True, True, True, False, False, True, True],
        [False] * 3 + [True] * 50 + [False] * 5 + [True] * 7 + [False],
        [False, True, False, True, False, True],
    ]
    return PackedBatch(masks=masks, seed=1234)
