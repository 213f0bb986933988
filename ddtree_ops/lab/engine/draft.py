"""The draft: a noisy oracle of the target, standing in for DFlash's block-diffusion drafter.

For a block rooted at position L it gives, like DFlash, one distribution per future position
L+1 … L+depth, all at once. It knows what the target will choose there (its `Lookahead` runs the
target ahead of the committed text with the request's own choice rule) and then errs on purpose:
at each position, with probability `quality` it ranks the target's token first; otherwise its first
choice is another of the target's top tokens and the target's token sits at rank 1 … top_k-1, where
a draft *tree* still reaches it but the linear top-1 path does not. The coin is a hash of
(seed, position, previous token, token), so every mode sees the same drafts for the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .model import DTYPE, KVCache, TinyLM, read_config
from .sampling import Choice, mix64, uniform01

_REST_MASS = 1e-3  # the probability the draft leaves for tokens outside its top_k


@dataclass(frozen=True)
class DraftModel:
    quality: float
    top_k: int
    seed: int
    bias: torch.Tensor  # [vocab]: the draft's own preference among the target's runner-ups
    low_acceptance: bool = False  # fault switch: the target's token is ranked last everywhere

    @classmethod
    def load(cls, model_dir: str | Path, *, low_acceptance: bool = False) -> DraftModel:
        from safetensors.torch import load_file

        spec = read_config(model_dir).get("ddtree_lab_draft")
        if not isinstance(spec, dict):
            raise ValueError(
                f"{model_dir}/config.json has no 'ddtree_lab_draft' section: not a lab draft model "
                "(write the lab's models with `python -m ddtree_lab_engine.model_files DIR`)"
            )
        quality, top_k = float(spec["quality"]), int(spec["top_k"])
        if not 0.0 < quality < 1.0 - _REST_MASS or top_k < 2:
            raise ValueError(f"{model_dir}: ddtree_lab_draft needs 0 < quality < 0.999 and top_k >= 2, got {spec}")
        bias = load_file(Path(model_dir) / "model.safetensors")["lm_head.bias"].to(DTYPE)
        return cls(quality, top_k, int(spec["seed"]), bias, low_acceptance)

    def position_logits(self, target_logits: torch.Tensor, prev_token: int, token: int, position: int) -> torch.Tensor:
        """The draft's logits at `position`, where the target's logits are `target_logits` and it
        will choose `token` (after `prev_token`)."""
        logits = target_logits + self.bias
        if self.low_acceptance:
            out = logits.clone()
            out[token] = logits.min() - 10.0
            return out
        order = [t for t in torch.topk(logits, self.top_k + 1).indices.tolist() if t != token][: self.top_k - 1]
        if uniform01(self.seed, position, prev_token, token) < self.quality:
            ranked = [token, *order]
        else:
            rank = 1 + mix64(self.seed, position, token) % (self.top_k - 1)
            ranked = [*order[:rank], token, *order[rank:]]
        # Calibrated, as a trained draft is: its first choice gets probability `quality`, the other
        # top_k - 1 share the rest, so a tree's best-first scores mean what they say.
        probs = torch.full_like(logits, _REST_MASS / (logits.numel() - self.top_k))
        probs[ranked[0]] = self.quality
        probs[torch.tensor(ranked[1:])] = (1.0 - self.quality - _REST_MASS) / (self.top_k - 1)
        # the tail keeps the target's order (tiny spread), so ranks below top_k are still defined
        return probs.log() + 1e-3 * (logits - logits.max())


class Lookahead:
    """The target run ahead of one request's committed tokens, with the request's choice rule."""

    def __init__(self, model: TinyLM, capacity: int, choice: Choice) -> None:
        self.model = model
        self.choice = choice
        self.cache: KVCache = model.new_cache(capacity)
        self.capacity = capacity
        self.tokens: list[int] = []
        self.logits: dict[int, torch.Tensor] = {}  # position -> target logits for the token there

    def sync(self, committed: list[int]) -> None:
        """Adopt the committed tokens, keeping whatever lookahead still agrees with them."""
        same = 0
        limit = min(len(self.tokens), len(committed))
        while same < limit and self.tokens[same] == committed[same]:
            same += 1
        if same < len(committed):
            self.tokens = list(committed)
            self.cache.truncate(same)
            self.logits = {p: v for p, v in self.logits.items() if p <= same}
        for p in [p for p in self.logits if p < len(committed) - 1]:
            del self.logits[p]

    def extend(self, upto: int) -> None:
        """Make tokens[: upto] known (capped at the capacity), computing the target's choices."""
        upto = min(upto, self.capacity - 1)
        if self.cache.length < len(self.tokens):
            start = self.cache.length
            pending = torch.tensor(self.tokens[start:])
            out = self.model.forward(pending, torch.arange(start, len(self.tokens)), self.cache)
            self.cache.commit(out.k, out.v)
            for j in range(out.logits.shape[0]):
                self.logits[start + j + 1] = out.logits[j]
        while len(self.tokens) < upto:
            position = len(self.tokens)
            token = self.choice.pick(self.logits[position][None], [position])[0]
            self.tokens.append(token)
            if len(self.tokens) < upto:
                out = self.model.forward(torch.tensor([token]), torch.tensor([position]), self.cache)
                self.cache.commit(out.k, out.v)
                self.logits[position + 1] = out.logits[0]

    def draft_logits(self, draft: DraftModel, root_position: int, depth: int) -> torch.Tensor:
        """[depth, vocab] draft logits for the positions after the root (the last committed token)."""
        self.extend(root_position + 1 + depth)
        rows = []
        for p in range(root_position + 1, root_position + 1 + depth):
            if p >= len(self.tokens):  # past the context: nothing to know, nothing to accept
                rows.append(torch.zeros(draft.bias.shape[0], dtype=DTYPE))
                continue
            rows.append(draft.position_logits(self.logits[p], self.tokens[p - 1], self.tokens[p], p))
        return torch.stack(rows)
