"""The target's choice of a token from its logits: argmax, or a seeded sample.

A sample is a function of the logits, the request's seed and the token's absolute position only
(inverse CDF at a uniform drawn from (seed, position)), so a sampled request gives the same tokens
in every mode and in any batch: verify passes see the target's logits at a node and pick what plain
decoding would have picked there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """splitmix64 over a tuple of integers: a cheap, well-spread, stable hash."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def uniform01(*values: int) -> float:
    return (mix64(*values) >> 11) / float(1 << 53)


@dataclass(frozen=True)
class Choice:
    """How one request turns logits into a token (from SGLang's normalised SamplingParams)."""

    greedy: bool
    temperature: float = 1.0
    top_k: int = 1 << 30
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def pick(self, logits: torch.Tensor, positions: list[int]) -> list[int]:
        """One token per row of `logits` ([n, vocab]); row i is the choice for positions[i]."""
        if self.greedy:
            return logits.argmax(-1).tolist()
        return [self._sample(row, pos) for row, pos in zip(logits, positions, strict=True)]

    def _sample(self, logits: torch.Tensor, position: int) -> int:
        probs = torch.softmax(logits / self.temperature, -1)
        values, ids = probs.sort(descending=True, stable=True)
        keep = torch.ones_like(values, dtype=torch.bool)
        keep[min(self.top_k, values.numel()) :] = False
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep &= (values.cumsum(0) - values) < self.top_p
        keep &= values >= self.min_p * values[0]
        values = values * keep
        cdf = values.cumsum(0)
        u = uniform01(self.seed, position) * float(cdf[-1])
        index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
        return int(ids[min(index, int(keep.sum()) - 1)])
