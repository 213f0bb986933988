"""Decoding steps: plain, DFLASH linear verify, and DDTree (shadow-linear, full) through the payload.

The tree and the walk are the host's own `sglang.srt.speculative.ddtree_utils.build_ddtree` and
`follow_verified_tree` (passed in as `ddtree`, the imported module), so whatever `push` installed is
what decides which tokens a full-mode step emits. The rest follows the payload's worker
(`ddtree_worker.py`): full mode verifies every step on the tree, greedy and sampled requests alike
(a sampled request's choice at each node is the seeded sample of `sampling.Choice`, so the walk emits
what plain sampling emits); shadow-linear builds and measures the tree each step and verifies linearly.

Invariant of a request: its KV cache holds every token but the last (`cache.length == len(tokens)-1`);
the last one is the next step's root (SGLang's bonus token).
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from .draft import DraftModel, Lookahead
from .model import KVCache, TinyLM
from .sampling import Choice


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    choice: Choice
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    eos_token_id: int
    tokens: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    cache: KVCache | None = None
    lookahead: Lookahead | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        """Add one output token and update the finish state the way SGLang's Req does."""
        self.output_ids.append(int(token))
        self.tokens.append(int(token))
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        elif not self.ignore_eos and (token in self.stop_token_ids or token == self.eos_token_id):
            self.finish_reason = {"type": "stop", "matched": int(token)}


def _median(values: Any) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


@dataclass
class TreeStats:
    """The payload worker's `DDTreeStats`, reported under the same keys (`internal_state`)."""

    mode: str
    budget: int
    topk_cap: int | None
    keep_chain: bool = False
    steps: int = 0
    tree_steps: int = 0
    fallback_steps: int = 0
    # The engine never shrinks a tree nor falls back to linear (no device memory to run out of),
    # and has no CUDA graphs; the keys are there because the worker reports them.
    shrunk_steps: int = 0
    fallback_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    nodes_sum: int = 0
    requests_sum: int = 0
    greedy_requests: int = 0
    sampled_requests: int = 0
    build_ms_n: int = 0
    build_ms_first: float | None = None
    build_ms_recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=256))
    accepted_depth_hist: collections.Counter[int] = field(default_factory=collections.Counter)
    # --speculative-ddtree-budget auto: the payload's AutoBudget (budget is then its maximum), and the
    # steps it gave the chain (linear verify).
    auto: Any = None
    chain_steps: int = 0
    # A v2 base's shadow-linear worker builds no trees (upstream's draft graph returns tokens only).
    builds_trees: bool = True

    def record_build(self, ms: float) -> None:
        if self.build_ms_first is None:
            self.build_ms_first = ms
        else:
            self.build_ms_recent.append(ms)
        self.build_ms_n += 1

    def internal_state(self) -> dict[str, Any]:
        n_req = max(1, sum(self.accepted_depth_hist.values()))
        return {
            "mode": self.mode,
            "budget": "auto" if self.auto is not None else self.budget,
            "budget_max": self.budget if self.auto is not None else None,
            "auto": None if self.auto is None else self.auto.as_dict(),
            "chain_steps": self.chain_steps,
            "topk_cap": self.topk_cap,
            "verify_graph_width": None,
            "verify_graph_max_bs": None,
            "build_graph_bs": None,
            "build_budgets": ([c.budget for c in self.auto.candidates if c.budget > 0] if self.auto is not None
                              else [self.budget] if self.builds_trees else []),
            "hybrid": None,
            "verify_kernels": False,
            "profile": None,
            "keep_chain": self.keep_chain,
            "steps": self.steps,
            "tree_steps": self.tree_steps,
            "fallback_steps": self.fallback_steps,
            "shrunk_steps": self.shrunk_steps,
            "padded_steps": 0,
            "fallback_reasons": dict(sorted(self.fallback_reasons.items())),
            "avg_tree_nodes": round(self.nodes_sum / max(1, self.requests_sum), 3),
            "greedy_requests": self.greedy_requests,
            "sampled_requests": self.sampled_requests,
            "logit_adjusted_steps": 0,
            "graph_steps": 0,
            "build_graph_steps": 0,
            "build_ms_median": round(_median(self.build_ms_recent), 4),
            "build_ms_max": round(max(self.build_ms_recent, default=0.0), 4),
            "build_ms_first": None if self.build_ms_first is None else round(self.build_ms_first, 3),
            "build_samples": self.build_ms_n,
            "accepted_depth_hist": {str(k): v for k, v in sorted(self.accepted_depth_hist.items())},
            "avg_accepted_depth": round(sum(k * v for k, v in self.accepted_depth_hist.items()) / n_req, 4),
        }


@dataclass
class SpecTotals:
    """What SGLang's metrics reporter accumulates for `avg_spec_accept_length` and the gauges."""

    accept_tokens: int = 0  # accepted drafts + 1 bonus, summed over request-steps
    forward_ct: int = 0  # request-steps
    proposed_drafts: int = 0

    @property
    def accept_length(self) -> float | None:
        return self.accept_tokens / self.forward_ct if self.forward_ct else None

    @property
    def accept_rate(self) -> float | None:
        if not self.proposed_drafts:
            return None
        return (self.accept_tokens - self.forward_ct) / self.proposed_drafts


@dataclass
class Corruption:
    """Fault switch WRONG_TOKENS_AFTER: in full mode, a request's bonus tokens go wrong once it has
    this many output tokens (what a lossy tree walk would serve)."""

    after_tokens: int | None = None

    def apply(self, token: int, output_len: int, vocab: int) -> int:
        """The token to emit at output index `output_len` in place of the target's `token`."""
        if self.after_tokens is not None and output_len >= self.after_tokens:
            return (token + 1) % vocab
        return token


class Decoder:
    """Steps a batch of requests with one target model; speculative when `draft` is given."""

    def __init__(
        self,
        model: TinyLM,
        *,
        capacity: int,
        draft: DraftModel | None = None,
        block_size: int = 16,
        mode: str = "off",
        budget: int | None = None,
        topk_cap: int | None = None,
        keep_chain: bool = False,
        ddtree: ModuleType | None = None,
        corruption: Corruption | None = None,
        auto: Any = None,
        shadow_builds_trees: bool = True,
    ) -> None:
        if mode != "off" and ddtree is None:
            raise ValueError(f"DDTree mode {mode} needs the payload's ddtree_utils module")
        self.model = model
        self.capacity = capacity
        self.draft = draft
        self.block_size = block_size
        self.depth = block_size - 1
        self.mode = mode
        self.budget = int(budget or self.depth)
        self.topk_cap = topk_cap
        self.keep_chain = keep_chain
        self.ddtree = ddtree
        self.corruption = corruption or Corruption()
        self.tree_stats = TreeStats(mode, self.budget, topk_cap, keep_chain) if mode != "off" else None
        # As the host's payload does: v1's shadow-linear builds and measures the tree it never verifies, a v2
        # base's (`ddtree_v2_shadow`) builds none and reports no build figures.
        if self.tree_stats is not None and mode == "shadow-linear":
            self.tree_stats.builds_trees = shadow_builds_trees
        # The payload's ddtree_auto_budget.AutoBudget (full mode, --speculative-ddtree-budget auto).
        self.auto = auto
        if self.tree_stats is not None:
            self.tree_stats.auto = auto
        self.spec = SpecTotals()

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    # ------------------------------------------------------------------ prefill
    def prefill(self, req: Request) -> None:
        """Compute the prompt's KV and the first output token (SGLang's prefill/extend)."""
        req.tokens = list(req.input_ids)
        req.cache = self.model.new_cache(self.capacity)
        if self.speculative:
            req.lookahead = Lookahead(self.model, self.capacity, req.choice)
        if req.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return
        n = len(req.tokens)
        out = self.model.forward(torch.tensor(req.tokens), torch.arange(n), req.cache)
        req.cache.commit(out.k, out.v)
        req.append(req.choice.pick(out.logits[-1:], [n])[0])

    # ------------------------------------------------------------------ one decode step
    def step(self, reqs: list[Request]) -> None:
        """One decode step for every unfinished request: one token (plain) or one verify (DFLASH)."""
        reqs = [r for r in reqs if not r.finished]
        if not reqs:
            return
        if not self.speculative:
            for r in reqs:
                self._plain(r)
            return
        draft_logits = torch.stack([self._draft_logits(r) for r in reqs])  # [bs, depth, vocab]
        if self.mode == "full" and self.auto is not None:
            self._auto_step(reqs, draft_logits)
        elif self.mode == "full":
            self._tree_verify(reqs, draft_logits)
        else:
            if self.mode == "shadow-linear" and self.tree_stats.builds_trees:
                self._build_tree(draft_logits, self.budget)  # built and measured, never used: the verify stays linear
            self._linear_verify(reqs, draft_logits)

    def _plain(self, r: Request) -> None:
        pos = len(r.tokens) - 1
        out = self.model.forward(torch.tensor([r.tokens[-1]]), torch.tensor([pos]), r.cache)
        r.cache.commit(out.k, out.v)
        r.append(r.choice.pick(out.logits, [pos + 1])[0])

    def _draft_logits(self, r: Request) -> torch.Tensor:
        r.lookahead.sync(r.tokens)
        return r.lookahead.draft_logits(self.draft, len(r.tokens) - 1, self.depth)

    def _build_tree(self, draft_logits: torch.Tensor, budget: int) -> Any:
        t0 = time.perf_counter()
        tree = self.ddtree.build_ddtree(draft_logits, budget, topk_cap=self.topk_cap, keep_chain=self.keep_chain)
        self.tree_stats.record_build((time.perf_counter() - t0) * 1e3)
        self.tree_stats.nodes_sum += int(tree.num_nodes.sum())
        self.tree_stats.requests_sum += int(draft_logits.shape[0])
        return tree

    def _linear_verify(self, reqs: list[Request], draft_logits: torch.Tensor) -> None:
        drafts = draft_logits.argmax(-1).tolist()  # DFLASH's linear path: the top-1 token per position
        for r, draft in zip(reqs, drafts, strict=True):
            root = len(r.tokens) - 1
            n = min(self.block_size, self.capacity - root)
            tokens = [r.tokens[-1], *draft[: n - 1]]
            out = self.model.forward(torch.tensor(tokens), torch.arange(root, root + n), r.cache)
            target = r.choice.pick(out.logits, list(range(root + 1, root + 1 + n)))
            accepted = 0
            while accepted < n - 1 and tokens[accepted + 1] == target[accepted]:
                accepted += 1
            self._commit(r, out, list(range(accepted + 1)), [*tokens[1 : accepted + 1], target[accepted]])
        if self.tree_stats is not None:
            self.tree_stats.steps += 1

    def _auto_step(self, reqs: list[Request], draft_logits: torch.Tensor) -> None:
        """A step whose budget the payload's AutoBudget picks for this batch (the chain: a linear verify),
        then observed: its wall time and what every smaller budget would have accepted."""
        # The payload's own observation class, however its module was imported (the host's sglang, a test).
        observation = sys.modules[type(self.auto).__module__].StepObservation
        started = time.perf_counter()
        step = self.tree_stats.steps
        sampled = [not r.choice.greedy for r in reqs]
        pick = self.auto.choose(len(reqs), step, sampled=sum(sampled))
        budgets = self.auto.budgets
        if pick.is_chain:
            before = [r.spec_num_correct_drafts for r in reqs]
            self.tree_stats.chain_steps += 1
            self._linear_verify(reqs, draft_logits)
            rows = [[0.0] * (len(budgets) + 1) for _ in range(2)]  # greedy, sampled; the chain's last
            for r, was, kind in zip(reqs, before, sampled, strict=True):
                rows[int(kind)][-1] += r.spec_num_correct_drafts - was
        else:
            rows = self._tree_verify(reqs, draft_logits, budget=pick.budget,
                                     acceptance_budgets=torch.tensor(budgets, dtype=torch.int64),
                                     sampled=torch.tensor(sampled, dtype=torch.bool)).tolist()
        (accepted, chain), (s_accepted, s_chain) = ((row[:-1], row[-1]) for row in rows)
        self.auto.observe(observation(budget=pick.budget, width=pick.width, batch_size=len(reqs),
                                      seconds=time.perf_counter() - started, accepted=accepted, chain=chain,
                                      requests=len(reqs) - sum(sampled), sampled_accepted=s_accepted,
                                      sampled_chain=s_chain, sampled_requests=sum(sampled)))
        if self.auto.due(step):
            self.auto.refresh()

    def _tree_verify(self, reqs: list[Request], draft_logits: torch.Tensor, *, budget: int | None = None,
                     acceptance_budgets: torch.Tensor | None = None,
                     sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """One tree step (the tree of `budget` when given: auto's pick, built at its own budget as the worker
        builds it); with `acceptance_budgets`, returns the payload's `acceptance_by_budget` of its walk
        (`sampled`: which requests are sampled)."""
        tree = self._build_tree(draft_logits, self.budget if budget is None else budget)
        self.tree_stats.tree_steps += 1
        n_sampled = sum(1 for r in reqs if not r.choice.greedy)
        self.tree_stats.sampled_requests += n_sampled
        self.tree_stats.greedy_requests += len(reqs) - n_sampled
        n = tree.parents.shape[1]
        all_tokens = tree.full_token_ids(torch.tensor([r.tokens[-1] for r in reqs]))
        all_positions = tree.positions(torch.tensor([len(r.tokens) - 1 for r in reqs]))
        targets = []
        outs = []
        for i, r in enumerate(reqs):
            positions = all_positions[i]
            out = self.model.forward(all_tokens[i], positions, r.cache, mask=tree.tree_mask[i])
            outs.append(out)
            # the target's choice after each node is the token at that node's position + 1
            targets.append(r.choice.pick(out.logits, (positions + 1).tolist()))
        accepted_nodes, accept_lengths, bonus = self.ddtree.follow_verified_tree(
            tree, torch.tensor(targets, dtype=torch.int64).view(len(reqs), n)
        )
        vocab = self.model.shape.vocab_size
        for i, r in enumerate(reqs):
            path = accepted_nodes[i, : int(accept_lengths[i]) + 1].tolist()
            emitted = [int(tree.token_ids[i, j - 1]) for j in path[1:]]
            emitted.append(self.corruption.apply(int(bonus[i]), len(r.output_ids) + len(emitted), vocab))
            self._commit(r, outs[i], path, emitted)
        self.tree_stats.steps += 1
        if acceptance_budgets is None:
            return None
        return self.ddtree.acceptance_by_budget(tree, accepted_nodes, acceptance_budgets, sampled)

    def _commit(self, r: Request, out: Any, path: list[int], emitted: list[int]) -> None:
        """Append emitted tokens until the request finishes; keep the KV of the path nodes whose
        successor was appended (the root and the accepted drafts), in path order."""
        appended = 0
        for token in emitted:
            r.append(token)
            appended += 1
            if r.finished:
                break
        r.cache.commit(out.k, out.v, rows=torch.tensor(path[:appended]))
        correct = appended - 1
        r.spec_verify_ct += 1
        r.spec_num_correct_drafts += correct
        self.spec.accept_tokens += appended
        self.spec.forward_ct += 1
        self.spec.proposed_drafts += self.depth
        if self.tree_stats is not None:
            self.tree_stats.accepted_depth_hist[correct] += 1
