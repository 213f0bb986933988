"""The per-step tree budget chosen for throughput, `--speculative-ddtree-budget auto` (installed as
`sglang/srt/speculative/ddtree_auto_budget.py` by the ddtree-ops payload; pure Python, no torch, so the
lab engine and the CPU tests run the same decisions as a GPU server).

A verify step of budget `b` costs `T(width(b), batch)` seconds and commits `1 + E[accepted | b]` tokens
per request. Each step takes the candidate with the most expected tokens per second for its batch:

- Candidates: the chain (linear DFLASH: the draft's top-1 path, `block_size` verify tokens) and the
  budgets whose verify CUDA graphs are captured (`auto_budgets`: the maximum, then `2^k - 1` down to the
  block's depth). The chain is always one, so a step never pays more than DFLASH's for fewer expected
  tokens than DFLASH's.
- Acceptance by budget, measured online: nodes are numbered best-first and the order does not depend on
  the budget, so the first `b'` nodes of a budget-`b` tree are the budget-`b'` tree (with the same top-k
  cap), and the accepted path is a prefix of it: a step's walk tells, for every `b' <= b`, how many
  tokens the budget-`b'` tree would have accepted (`ddtree_utils.acceptance_by_budget`). Exact for greedy requests;
  for sampled ones exact in distribution (the target's sample at a node does not depend on which other
  nodes the tree holds). With keep-chain the prefix is what a shrunk keep-chain step verifies
  (`ddtree_utils.shrink_tree`), which is what auto runs. The chain's acceptance from a tree walk is a
  lower bound where the walk ends on the chain and the tree lacks the chain's next node; chain steps
  measure it exactly and replace it once there are enough of them.
- The curve is estimated paired: the smallest budget's acceptance from every tree step, and for each larger
  budget only its gain over the next smaller one, from the steps that measured both. Larger budgets are
  measured only by the rarer steps that verify them (exploration), at other moments of the traffic; their
  own means move with whatever those few steps met (on the H200 budget 31 came out below budget 15), while
  a gain measured on the same walks does not, and the curve cannot fall with the budget. The curve is per
  request, not per batch: a gain is kept relative to the smallest budget's acceptance on its own walks and
  forgets slowly (`SHAPE_DECAY`), the smallest budget's level (measured by every tree step) quickly, so what
  steps at a cheap batch size learnt serves every other one and need not be explored again where it is
  dear; the chain likewise, against the tree walks' bound for it in the same refreshes.
- Greedy and sampled requests accept differently (a sampled walk accepts less, and less so on wide
  trees): acceptance is kept for each kind, and a step scores the candidates for its batch's mix.
- Costs, measured on this server, per candidate, batch bucket and kind of request (the chain and the tree
  of the same width differ: a tree step also builds, masks and walks the tree; a sampled walk builds the
  target's distribution at every verified node, so its cost grows with the tree's width, where a greedy
  walk's hardly does: on the H100 pooled cells, taught by greedy steps, made auto pick trees 1.5-2x too dear
  for sampled batches): the verify graphs' replays timed at start (`seed_start_costs`, seconds per
  `(width, batch bucket)`), then every step's own wall time, in the cell of its majority kind; a batch's
  cost is its kinds' cells interpolated by its share of sampled requests, as its acceptance is. A greedy
  cell never stepped in is its start-up replay plus what its kind's steps (tree or chain) of that bucket
  cost beyond their replays (draft, build, walk, attention over real contexts); a sampled one is the same
  cell's greedy estimate plus a sampled walk's surcharge, a fixed part and one per verify token fitted to
  the cells measured both ways (one width measured: no more than its own, `_fixed_and_per_token`). A wider
  tree costs no less than a narrower one: each bucket's measured greedy tree cells are read through their
  isotonic regression in width (`_smooth_costs`), so the host's drift between the moments cells were stepped in
  does not order them.
- Budgets larger than the ones stepped in are only learnt by stepping in them, and a cell's cost by its
  own steps: one step in `explore_every` may explore a candidate other than the plan. Exploration is
  priced per batch bucket (`_explore_table`): a step of a candidate loses its time at this batch beyond
  what the plan takes for the tokens it brings, and earns only if the candidate may still beat the plan
  here: its optimistic tokens per second (acceptance `UCB_Z` spreads above its estimate, and no more than
  best-first trees allow a budget never explored; cost as many spreads below, a thinly measured cell never
  above its prior's bound) against the plan's. The candidates that may win share `EXPLORE_SHARE` of the
  plan's time, each by the part of its optimistic range above the plan, so exploration fades as evidence
  accumulates and ends where the bound falls below the plan; the others share `RECHECK_SHARE` (an estimate
  may be what is wrong), and decay widens a stale estimate's range until it is explored again. On a
  real-size target a wide tree at a large batch costs several plain steps and cannot win there: it is
  explored where it is cheap (small batches) and almost never where it is dear.
- A step's wall time has one-off spikes (a graph's first replay, a first kernel launch): a cell's
  first step is not timed, each refresh keeps the median of a cell's steps, a refresh's median above
  `COST_SPIKE` times the cell's estimate counts as that much, one below the estimate by as much replaces
  it (the estimate was a spike), anything between is averaged in (taking the lower at once instead made
  the rarely stepped cells the minimum of their noise, the plan's cell their median: on the H200 the chain
  looked 25 % cheaper than the width-16 tree at batch 4, and ran), a cell's first timing counts at most
  `COST_SPIKE` times its prior, and a cell never stepped in borrows the smallest overhead of its kind
  (optimistic, so the plan visits it and measures it, where a pessimistic guess would never be corrected; the
  chain's at most the trees': a chain step is a tree step without build, mask and walk),
  at most `COST_SPIKE` times what the nearest measured buckets' cells do (a batch size reached for the
  first time lends no first-step spikes to the cells around it); a cell whose steps have decayed below
  trust goes back to that prior, or keeps its own old estimate where it has no replay (a fit over other
  cells is a worse guess). A first timing is clipped to its prior only where every part of that prior is
  measured (an overhead: some cell's steps beyond its replay; for a sampled cell also a surcharge): before,
  the prior is the bare replay (or the greedy cost alone), a bound from below, not an estimate. On the
  launch-bound pair (H100, bench/ddtree_auto_h100_2026-12-06.json call B: a replay 0.15 - 0.19 ms of a 3.7 ms
  step) clipping to it started the first cells at a fifth of their cost, the overhead every other cell's
  prior borrows was then the least of those, and a cell climbed back at most an EWMA step of `COST_SPIKE` a
  refresh, as fast as it was stepped: the widths' estimates differed by how far each had climbed (0.14 - 0.4
  of their cost at batch 1 after auto_bench's warm-up, tests/ddtree_pair_sim.py), not by what they cost, and
  auto made 0.85 - 0.97 of the best fixed budget there (0.93 - 0.97 in the simulator; 0.99 - 1.0 unclipped).

Every decision is a function of the step index, the batch size and a plan recomputed every
`refresh_every` steps from accumulators that `refresh` first sums over the TP ranks (the caller passes
the reduction): ranks time their steps differently, and a plan computed from one rank's clock alone
would give ranks different budgets for the same step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

# Decay per refresh of the acceptance and cost accumulators: a refresh every 16 steps forgets half of
# what it knew in about 7 refreshes (~110 steps): traffic changes within minutes, not within steps.
DECAY = 0.9
# The acceptance curve's shape (each larger budget's gain relative to the smallest budget's acceptance on
# the same walks) forgets ten times slower: easy or hard traffic moves every budget's acceptance alike, which
# the smallest budget's mean (every tree step measures it) follows at DECAY; the shape is the drafter's and
# the tree's, and is measured by the rarer steps that verify the larger budgets, at any batch size.
SHAPE_DECAY = 0.99
# A gain is taken relative to the smallest budget's acceptance on its walks once those walks accepted this
# many tokens (decayed); before, as tokens per request.
MIN_SHAPE_BASE = 4.0
# Costs change with the contexts' lengths, slowly; their cells are visited rarely (exploration), so they
# forget ten times slower.
COST_DECAY = 0.99
EWMA_ALPHA = 0.2
# A cost cell is trusted as a measure of its kind's overhead (what the cells never stepped in borrow, and
# the fit) once it holds this much (decayed) observation weight.
MIN_COST_WEIGHT = 1.0
# Exploration's share of the plan's step time: what exploring steps lose against the plan, at most.
EXPLORE_SHARE = 0.03
# Of it, what the candidates that cannot beat the plan even at their optimistic bounds share: still
# measured now and then (an estimate may be what is wrong), rarely where a step of them is dear.
RECHECK_SHARE = EXPLORE_SHARE / 30
# The optimistic bounds a candidate is explored against (`_optimistic_accepted`, `_optimistic_seconds`):
# this many spreads above its estimate. A walk's accepted length spreads by about ACCEPT_SD tokens (a geometric length of mean ~1);
# a cost cell's refresh median by COST_CV (COST_FLOOR at least: contexts grow, clocks differ); a cell
# never stepped in (its replay plus a borrowed overhead) by PRIOR_CV.
UCB_Z = 2.0
ACCEPT_SD = 1.5
COST_CV = 0.1
COST_FLOOR = 0.02
PRIOR_CV = 0.07
# A cell's own steps bound its optimistic cost alone once it holds this many (decayed) timed steps.
TRUSTED_STEPS = 3.0
# Steps of a cell (candidate, batch bucket) not timed: the first replays of a graph, first launches.
UNTIMED_FIRST_STEPS = 1
# During warm-up (nothing accepted yet) the largest tree whose replay at the batch costs at most this
# many times the cheapest candidate's: acceptance for many budgets, without a 6x step at batch 64.
WARMUP_COST = 2.0
# A step's wall time has one-off spikes (a graph's first replay, a kernel's first launch, a prefill between
# steps) 3-10x its usual: a refresh's median is clipped to this factor of the cell's estimate before it is
# averaged in, and one this factor below the estimate replaces it (a real rise, longer contexts, still
# passes: doubling in two refreshes).
COST_SPIKE = 1.5
# Chain steps must have measured this many requests (decayed) before their exact acceptance replaces
# the tree walks' lower bound.
MIN_CHAIN_REQUESTS = 16.0
# Kinds of request whose acceptance is kept apart (index into StepObservation's per-kind fields).
GREEDY, SAMPLED = 0, 1
KINDS = (GREEDY, SAMPLED)


@dataclass(frozen=True)
class Candidate:
    """One way to verify a step: `budget` non-root nodes (0: the chain, linear DFLASH) in `width`
    verify tokens per request (the verify graph it replays; a smaller tree is padded to it)."""

    budget: int
    width: int

    @property
    def is_chain(self) -> bool:
        return self.budget == 0

    @property
    def name(self) -> str:
        return "chain" if self.is_chain else str(self.budget)


def auto_budgets(max_budget: int, block_size: int) -> list[int]:
    """The tree budgets auto chooses among, largest first: the maximum, then `2^k - 1` while the tree
    still has at least the block's verify width (a smaller tree would replay the block's graph padded,
    at the chain's cost, and accept less than the block's depth allows)."""
    budgets = [int(max_budget)]
    floor = min(int(block_size), int(max_budget) + 1)
    k = int(max_budget).bit_length()
    while k >= 1:
        b = (1 << k) - 1
        if b < budgets[-1] and b + 1 >= floor:
            budgets.append(b)
        k -= 1
    return budgets


def auto_candidates(max_budget: int, block_size: int) -> list[Candidate]:
    """The chain, then the tree budgets ascending (`auto_budgets`), each at its own verify width."""
    return [Candidate(0, int(block_size))] + [Candidate(b, b + 1) for b in sorted(auto_budgets(max_budget, block_size))]


def verify_widths(candidates: Sequence[Candidate]) -> list[int]:
    """The verify widths the candidates need graphs for, ascending."""
    return sorted({c.width for c in candidates})


def batch_buckets(capture_bs: Sequence[int], max_running: int) -> list[int]:
    """Batch sizes a step's cost is kept for: the verify graphs' captured sizes (a batch replays the
    smallest one that holds it), then powers of two up to the running-request limit (eager steps)."""
    buckets = sorted({int(b) for b in capture_bs if int(b) > 0}) or [1]
    top = buckets[-1]
    while top < int(max_running):
        top *= 2
        buckets.append(top)
    return buckets


@dataclass
class StepObservation:
    """What one decode step measured. `accepted` sums, over the batch's greedy requests, the accepted tokens
    each tree budget of `AutoBudget.budgets` would have had (entries for budgets above the step's are
    ignored); `chain` the chain's (exact on a chain step, a lower bound from a tree walk); `sampled_*` the
    same over its sampled requests."""

    budget: int  # the budget verified (0: a chain step)
    width: int
    batch_size: int
    seconds: float  # step start to step done, host wall clock
    accepted: Sequence[float]
    chain: float
    requests: int
    sampled_accepted: Sequence[float] = ()
    sampled_chain: float = 0.0
    sampled_requests: int = 0

    def by_kind(self) -> list[tuple[Sequence[float], float, int]]:
        """(accepted, chain, requests) per kind, GREEDY then SAMPLED."""
        sampled = self.sampled_accepted or [0.0] * len(self.accepted)
        return [(self.accepted, self.chain, self.requests), (sampled, self.sampled_chain, self.sampled_requests)]


def chain_observation(num_correct: Sequence[int], sampled: Collection[int], *, width: int, seconds: float,
                      budgets: int) -> StepObservation:
    """A linear (chain) step's observation from each request's accepted drafts (`num_correct`, host) and the
    indices of its sampled requests: the chain's exact acceptance per kind, nothing for the `budgets` trees."""
    zeros = [0.0] * budgets
    n_sampled = len(sampled)
    chain_sampled = float(sum(k for i, k in enumerate(num_correct) if i in sampled))
    return StepObservation(budget=0, width=width, batch_size=len(num_correct), seconds=seconds, accepted=zeros,
                           chain=float(sum(num_correct)) - chain_sampled, requests=len(num_correct) - n_sampled,
                           sampled_accepted=zeros, sampled_chain=chain_sampled, sampled_requests=n_sampled)


def tree_observation(acceptance: Sequence[Sequence[float]], *, budget: int, width: int, batch_size: int,
                     sampled: int, seconds: float) -> StepObservation:
    """A tree step's observation from its walk's acceptance by budget (`ddtree_utils.acceptance_by_kind`, read to
    the host: the greedy row, then the sampled row, each the budgets' entries then the chain's)."""
    greedy, by_sampled = acceptance
    return StepObservation(budget=budget, width=width, batch_size=batch_size, seconds=seconds,
                           accepted=greedy[:-1], chain=greedy[-1], requests=batch_size - sampled,
                           sampled_accepted=by_sampled[:-1], sampled_chain=by_sampled[-1], sampled_requests=sampled)


class AutoBudget:
    """Chooses each step's candidate; see the module docstring."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        capture_bs: Sequence[int],
        max_running: int,
        *,
        explore_every: int = 16,
        refresh_every: int = 16,
        warmup_steps: int = 16,
    ) -> None:
        self.candidates = sorted(candidates, key=lambda c: (c.budget, c.width))
        self._index = {c: i for i, c in enumerate(self.candidates)}  # list.index with dataclass __eq__ was most of a refresh
        self.chain = next(c for c in self.candidates if c.is_chain)
        self.trees = [c for c in self.candidates if not c.is_chain]
        self.budgets = [c.budget for c in self.trees]
        self.largest = self.trees[-1] if self.trees else self.chain
        self.widths = verify_widths(self.candidates)
        self.buckets = batch_buckets(capture_bs, max_running)
        self.explore_every = max(2, int(explore_every))
        self.refresh_every = max(1, int(refresh_every))
        self.warmup_steps = int(warmup_steps)
        nb, nc, nk = len(self.budgets), len(self.candidates), len(self.buckets)
        # Decayed state (identical on every rank after a refresh), acceptance per kind of request: index 0
        # the smallest budget's accepted tokens, index i > 0 budget i's gain over budget i - 1 (`observe`),
        # and `accept_base[.][i]` the smallest budget's accepted tokens on the walks that measured gain i.
        self.accept_sum = [[0.0] * nb for _ in KINDS]
        self.accept_n = [[0.0] * nb for _ in KINDS]
        self.accept_base = [[0.0] * nb for _ in KINDS]
        self.chain_tree_sum, self.chain_tree_n = [0.0] * len(KINDS), [0.0] * len(KINDS)
        self.chain_step_sum, self.chain_step_n = [0.0] * len(KINDS), [0.0] * len(KINDS)
        # The chain's shape: its steps' accepted tokens, and what the tree walks' bound for the chain was in
        # the same refreshes for as many requests (`_fold`), and those requests (SHAPE_DECAY).
        self.chain_shape_sum, self.chain_shape_ref = [0.0] * len(KINDS), [0.0] * len(KINDS)
        self.chain_shape_n = [0.0] * len(KINDS)
        # EWMA seconds per (kind of request, candidate, bucket), and the cells' decayed observation weights.
        self.cost = [[[0.0] * nk for _ in range(nc)] for _ in KINDS]
        self.cost_weight = [[[0.0] * nk for _ in range(nc)] for _ in KINDS]
        # What the estimates read of the trusted cells: `cost` made no cheaper as the verify widens (`_smooth_costs`).
        self.cost_estimate = [[[0.0] * nk for _ in range(nc)] for _ in KINDS]
        self.start_cost: dict[tuple[int, int], float] = {}
        # Pending sums since the last refresh (this rank's), flattened by `_pending_vector`.
        self._reset_pending()
        # Per bucket, read through `plan` / `explore` / `_bucket_plan` (a re-plan marks every bucket stale; a
        # bucket is planned when a step or a report first needs it): the plan, (candidate, seconds per kind,
        # accepted per kind) of the candidates a step can score (`_best`), who exploration may take and once in
        # how many of the bucket's exploration rounds.
        self._plan: list[Candidate] = [self.largest] * nk
        self._scores: list[list[tuple[Candidate, list[float], list[float]]]] = [[] for _ in range(nk)]
        self._explore: list[list[tuple[Candidate, int]]] = [
            [(c, 1) for c in self.candidates if c != self.largest] for _ in range(nk)]
        self._stale = [False] * nk
        self._replan_inputs: tuple[list, list, list, float] = ([], [], [], 0.0)
        # Exploration rounds per bucket, and the round each candidate was last explored in (same on
        # every rank: every rank calls `choose` with the same steps and batch sizes).
        self._rounds = [0] * nk
        self._last_explored = [[0] * nc for _ in range(nk)]
        self._untimed = [[[UNTIMED_FIRST_STEPS] * nk for _ in range(nc)] for _ in KINDS]
        # Per kind (chain, tree) and bucket, what `_overhead` and `_surcharge` read (a refresh's priors ask for them
        # thousands of times; built by `_measure_extra`, which every re-plan starts with): the overhead, and the
        # sampled surcharge's (seconds, seconds per verify token, verify tokens it stops growing at), None where
        # none is measured.
        self._overheads: dict[bool, list[float]] = {True: [0.0] * nk, False: [0.0] * nk}
        self._overhead_measured = False  # whether any cell's overhead is measured yet (else the priors are bare replays)
        self._surcharges: dict[bool, list[tuple[float, float, float] | None]] = {True: [None] * nk, False: [None] * nk}
        self._by_distance = [sorted(range(nk), key=lambda j, k=k: abs(j - k)) for k in range(nk)]
        self.chosen: dict[str, int] = {c.name: 0 for c in self.candidates}  # by choose()
        self.verified: dict[str, int] = {}  # budgets steps really verified (memory may shrink a choice)
        self.explore_steps = 0
        self.refreshes = 0

    # ------------------------------------------------------------------ inputs
    def bucket_index(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self.buckets, max(1, int(batch_size))), len(self.buckets) - 1)

    def seed_start_costs(self, table: dict[tuple[int, int], float]) -> None:
        """Seconds of one verify replay per (width, captured batch size), timed at start."""
        self.start_cost = {(int(w), int(bs)): float(s) for (w, bs), s in table.items() if s > 0}
        self._replan()

    def observe(self, obs: StepObservation) -> None:
        name = "chain" if obs.budget == 0 else str(obs.budget)
        self.verified[name] = self.verified.get(name, 0) + 1
        for kind, (accepted, chain, requests) in enumerate(obs.by_kind()):
            if not requests:
                continue
            if obs.budget == 0:
                self._p_chain_step_sum[kind] += chain
                self._p_chain_step_n[kind] += requests
                continue
            # Paired: the smallest budget's acceptance, then each larger budget's gain over the next
            # smaller one on the same walks (budgets ascend).
            below = 0.0
            for i, b in enumerate(self.budgets):
                if b > obs.budget:
                    break
                self._p_accept_sum[kind][i] += accepted[i] - below
                self._p_accept_n[kind][i] += requests
                self._p_accept_base[kind][i] += accepted[0]
                below = accepted[i]
            self._p_chain_tree_sum[kind] += chain
            self._p_chain_tree_n[kind] += requests
        c = self._candidate_of(obs)
        if c is not None and obs.seconds > 0:
            i, k = self._index[c], self.bucket_index(obs.batch_size)
            kind = SAMPLED if 2 * obs.sampled_requests > obs.requests + obs.sampled_requests else GREEDY
            if self._untimed[kind][i][k] > 0:
                self._untimed[kind][i][k] -= 1
            else:
                self._p_times[kind][i][k].append(obs.seconds)

    # ------------------------------------------------------------------ decisions
    @property
    def plan(self) -> list[Candidate]:
        """The planned candidate per bucket (every bucket planned)."""
        self._plan_every_bucket()
        return self._plan

    @property
    def explore(self) -> list[list[tuple[Candidate, int]]]:
        """Per bucket, (candidate, once in how many exploration rounds) of the candidates exploration may take."""
        self._plan_every_bucket()
        return self._explore

    def _plan_every_bucket(self) -> None:
        for k in range(len(self.buckets)):
            self._bucket_plan(k)

    def choose(self, batch_size: int, step: int, sampled: int = 0) -> Candidate:
        """The candidate for step `step` (a counter every rank shares) of `batch_size` requests, `sampled`
        of them sampled."""
        k = self.bucket_index(batch_size)
        self._bucket_plan(k)
        if step < self.warmup_steps:
            pick = self._warmup_pick(k)
        elif step % self.explore_every == 0 and (explored := self._exploration(k)) is not None:
            pick = explored
            self.explore_steps += 1
        else:
            pick = self._best(k, batch_size, sampled)
        self.chosen[pick.name] += 1
        return pick

    def _best(self, bucket: int, batch_size: int, sampled: int) -> Candidate:
        """The most expected tokens per second for this batch's mix of greedy and sampled requests (the
        plan, which pools the kinds as traffic came, when nothing can be scored)."""
        if not self._scores[bucket]:
            return self._plan[bucket]
        mix = (max(0, batch_size - sampled), min(sampled, batch_size))
        share = mix[1] / max(1, batch_size)
        scored = [(sum(n * (1.0 + a) for n, a in zip(mix, accepted, strict=True)) / _mixed(seconds, share), c)
                  for c, seconds, accepted in self._scores[bucket]]
        return _narrowest_best(scored)

    def _warmup_pick(self, bucket: int) -> Candidate:
        """The largest tree whose replay here costs at most `WARMUP_COST` times the cheapest candidate's
        (the largest without replays): its walks give the acceptance of every smaller budget."""
        replay = {c: self._start_replay(c.width, bucket) for c in self.candidates}
        known = [s for s in replay.values() if s is not None]
        if not known:
            return self.largest
        fits = [c for c in self.trees if replay[c] is not None and replay[c] <= WARMUP_COST * min(known)]
        return fits[-1] if fits else self.largest

    def _exploration(self, bucket: int) -> Candidate | None:
        """This exploration round's candidate in `bucket`: of those whose rounds have come (`explore`),
        the one explored longest ago (ties: the narrower); None when none is due."""
        self._rounds[bucket] += 1
        now, last = self._rounds[bucket], self._last_explored[bucket]
        due = [c for c, rounds in self._explore[bucket] if now - last[self._index[c]] >= rounds]
        if not due:
            return None
        pick = min(due, key=lambda c: (last[self._index[c]], c.width, c.budget))
        last[self._index[pick]] = now
        return pick

    def due(self, step: int) -> bool:
        """Whether `refresh` is due after step `step` (same answer on every rank)."""
        return (step + 1) % self.refresh_every == 0

    def refresh(self, reduce: Callable[[list[float]], list[float]] | None = None, world: int = 1) -> None:
        """Fold the pending sums (summed over the ranks by `reduce`) into the state and re-plan."""
        vector = self._pending_vector()
        if reduce is not None:
            vector = list(reduce(vector))
        self._fold(vector, max(1, int(world)))
        self._reset_pending()
        self._replan()
        self.refreshes += 1

    # ------------------------------------------------------------------ estimates
    def expected_accepted(self, candidate: Candidate, kind: int | None = None) -> float | None:
        """Mean accepted draft tokens per request of `kind` (None: both, as traffic came; a kind not seen
        yet: both), or None while nothing is known."""
        own = self._accepted(candidate, KINDS if kind is None else (kind,))
        return own if own is not None or kind is None else self._accepted(candidate, KINDS)

    def _accepted(self, candidate: Candidate, kinds: Sequence[int]) -> float | None:
        if candidate.is_chain:
            step_sum, step_n = (sum(x[k] for k in kinds) for x in (self.chain_step_sum, self.chain_step_n))
            tree_sum, tree_n = (sum(x[k] for k in kinds) for x in (self.chain_tree_sum, self.chain_tree_n))
            shape_sum, shape_ref = (sum(x[k] for k in kinds) for x in (self.chain_shape_sum, self.chain_shape_ref))
            if tree_n > 0 and shape_ref >= MIN_SHAPE_BASE:
                # The tree walks' bound at today's level, times what chain steps accepted over that bound.
                return tree_sum / tree_n * shape_sum / shape_ref
            if step_n >= MIN_CHAIN_REQUESTS:
                return step_sum / step_n
            if tree_n > 0:
                return tree_sum / tree_n
            return step_sum / step_n if step_n > 0 else None
        # The smallest budget's mean plus the gain of each budget up to this one: relative to the smallest
        # budget's acceptance on the gain's own walks, at today's level (the shape: `SHAPE_DECAY`), or per
        # request while those walks accepted too little to tell a ratio; a gain never measured counts 0 (a
        # larger tree holds the smaller one: a lower bound until explored).
        n0 = sum(self.accept_n[k][0] for k in kinds)
        if n0 <= 0:
            return None
        base = sum(self.accept_sum[k][0] for k in kinds) / n0
        total = base
        for j in range(1, self.budgets.index(candidate.budget) + 1):
            n = sum(self.accept_n[k][j] for k in kinds)
            if n <= 0:
                continue
            gain, walks = sum(self.accept_sum[k][j] for k in kinds), sum(self.accept_base[k][j] for k in kinds)
            total += base * gain / walks if walks >= MIN_SHAPE_BASE else gain / n
        return total

    def sampled_share(self) -> float:
        """The share of sampled requests in the traffic (decayed as the acceptance level is): what the plan
        and the exploration prices mix the kinds' costs by."""
        n = [self.accept_n[kind][0] + self.chain_step_n[kind] for kind in KINDS]
        return n[SAMPLED] / (n[GREEDY] + n[SAMPLED]) if n[GREEDY] + n[SAMPLED] > 0 else 0.0

    def step_seconds(self, candidate: Candidate, bucket: int, sampled_share: float | None = None) -> float | None:
        """Estimated wall seconds of a step of `candidate` in bucket index `bucket` whose requests are
        `sampled_share` sampled (None: the traffic's share): its kinds' estimates (`kind_seconds`) mixed."""
        share = self.sampled_share() if sampled_share is None else sampled_share
        per_kind = [self.kind_seconds(candidate, bucket, kind) for kind in KINDS]
        return None if None in per_kind else _mixed(per_kind, share)

    def kind_seconds(self, candidate: Candidate, bucket: int, kind: int) -> float | None:
        """Estimated wall seconds of a step of `candidate` in bucket index `bucket` whose requests are of `kind`:
        the cell's own steps while they are trusted (`MIN_COST_WEIGHT`); else its prior (`_prior`: optimistic,
        so the plan visits it and measures it again; a few spiky steps long ago do not bar it); else its own
        steps however old (a fit is a worse guess); else a fit over the measured cells of its kind; else the
        other kind of request's estimate."""
        i = self._index[candidate]
        for own in (kind, 1 - kind):
            weight = self.cost_weight[own][i][bucket]
            if weight >= MIN_COST_WEIGHT:
                return self.cost_estimate[own][i][bucket]
            prior = self._prior(candidate, bucket, own)
            if prior is not None:
                return prior
            guess = self.cost[own][i][bucket] if weight > 0 else self._fitted(candidate, self.buckets[bucket], own)
            if guess is not None:
                return guess
        return None

    # ------------------------------------------------------------------ reporting
    def as_dict(self) -> dict[str, Any]:
        """For /server_info (string keys: the HTTP layer serialises with orjson)."""
        def curve(kind: int | None) -> dict[str, float | None]:
            values = {c.name: self.expected_accepted(c, kind) for c in self.candidates}
            return {k: None if v is None else round(v, 4) for k, v in values.items()}

        def costs(kind: int | None) -> dict[str, dict[str, float]]:
            out = {}
            for c in self.candidates:
                row = {}
                for k, bs in enumerate(self.buckets):
                    seconds = self.step_seconds(c, k) if kind is None else self.kind_seconds(c, k, kind)
                    if seconds is not None:
                        row[str(bs)] = round(seconds * 1e3, 4)
                out[c.name] = row
            return out

        return {
            "candidates": [c.name for c in self.candidates],
            "chosen": dict(self.chosen),
            "verified": dict(self.verified),
            "explore_steps": self.explore_steps,
            "refreshes": self.refreshes,
            "plan": {str(bs): self.plan[k].name for k, bs in enumerate(self.buckets)},
            "accepted_by_budget": curve(None),  # both kinds, as traffic came
            "accepted_by_kind": {"greedy": curve(GREEDY), "sampled": curve(SAMPLED)},
            # per bucket: candidate -> explored once in this many of the bucket's exploration rounds
            "explore": {str(bs): {c.name: r for c, r in self.explore[k]} for k, bs in enumerate(self.buckets)},
            "step_ms": costs(None),  # estimated ms per step at the traffic's mix, by candidate then batch bucket
            "step_ms_by_kind": {"greedy": costs(GREEDY), "sampled": costs(SAMPLED)},
            "sampled_share": round(self.sampled_share(), 4),
            "replay_ms": {f"{w}x{bs}": round(s * 1e3, 4) for (w, bs), s in sorted(self.start_cost.items())},
        }

    # ------------------------------------------------------------------ internals
    def _reset_pending(self) -> None:
        nb, nc, nk = len(self.budgets), len(self.candidates), len(self.buckets)
        self._p_accept_sum = [[0.0] * nb for _ in KINDS]
        self._p_accept_n = [[0.0] * nb for _ in KINDS]
        self._p_accept_base = [[0.0] * nb for _ in KINDS]
        self._p_chain_tree_sum, self._p_chain_tree_n = [0.0] * len(KINDS), [0.0] * len(KINDS)
        self._p_chain_step_sum, self._p_chain_step_n = [0.0] * len(KINDS), [0.0] * len(KINDS)
        self._p_times: list[list[list[list[float]]]] = [[[[] for _ in range(nk)] for _ in range(nc)] for _ in KINDS]

    def _pending_vector(self) -> list[float]:
        v: list[float] = []
        for k in KINDS:
            v += [*self._p_accept_sum[k], *self._p_accept_n[k], *self._p_accept_base[k],
                  self._p_chain_tree_sum[k], self._p_chain_tree_n[k],
                  self._p_chain_step_sum[k], self._p_chain_step_n[k]]
        # Per cell: the median of this refresh's steps (a spike among them does not move it), then their
        # count; summed over the ranks, which time the same steps.
        for kind in KINDS:
            for row in self._p_times[kind]:
                v.extend(_median(times) if times else 0.0 for times in row)
            for row in self._p_times[kind]:
                v.extend(float(len(times)) for times in row)
        return v

    def _fold(self, v: list[float], world: int) -> None:
        nb, nc, nk = len(self.budgets), len(self.candidates), len(self.buckets)
        # Acceptance is the same on every rank (same trees, same walk): the sum is world times it.
        per_kind = 3 * nb + 4
        for k in KINDS:
            part = [x / world for x in v[k * per_kind:(k + 1) * per_kind]]
            for i in range(nb):
                decay = DECAY if i == 0 else SHAPE_DECAY  # the level, then the shape
                self.accept_sum[k][i] = decay * self.accept_sum[k][i] + part[i]
                self.accept_n[k][i] = decay * self.accept_n[k][i] + part[nb + i]
                self.accept_base[k][i] = decay * self.accept_base[k][i] + part[2 * nb + i]
            tree_sum, tree_n, step_sum, step_n = part[3 * nb:]
            # The chain steps' shape against the tree walks' bound of the same refresh (else the last known).
            if step_n > 0 and (tree_n > 0 or self.chain_tree_n[k] > 0):
                bound = tree_sum / tree_n if tree_n > 0 else self.chain_tree_sum[k] / self.chain_tree_n[k]
                for state, x in zip((self.chain_shape_sum, self.chain_shape_ref, self.chain_shape_n),
                                    (step_sum, step_n * bound, step_n), strict=True):
                    state[k] = SHAPE_DECAY * state[k] + x
            else:
                for state in (self.chain_shape_sum, self.chain_shape_ref, self.chain_shape_n):
                    state[k] *= SHAPE_DECAY
            for state, x in zip((self.chain_tree_sum, self.chain_tree_n, self.chain_step_sum, self.chain_step_n),
                                (tree_sum, tree_n, step_sum, step_n), strict=True):
                state[k] = DECAY * state[k] + x
        for kind in KINDS:
            self._fold_costs(kind, v[len(KINDS) * per_kind + kind * 2 * nc * nk:], world)

    def _fold_costs(self, kind: int, v: list[float], world: int) -> None:
        """Fold one kind of request's step times (per cell the ranks' summed medians, then their counts)."""
        nc, nk = len(self.candidates), len(self.buckets)
        cost, weight = self.cost[kind], self.cost_weight[kind]
        for w in range(nc):
            for k in range(nk):
                median_sum = v[w * nk + k]
                count = v[nc * nk + w * nk + k]
                weight[w][k] *= COST_DECAY
                if count <= 0:
                    continue
                mean = median_sum / world  # the ranks' mean of their medians
                old, est = weight[w][k], cost[w][k]
                if old <= 0:
                    # A cell's first timing, against its prior (a spike there would bar it for long).
                    prior = self._prior(self.candidates[w], k, kind) if self._prior_measured(w, k, kind) else None
                    est = mean if prior is None else min(mean, prior * COST_SPIKE)
                elif mean * COST_SPIKE < est:
                    est = mean
                else:
                    alpha = max(EWMA_ALPHA, count / (count + old))
                    est += alpha * (min(mean, est * COST_SPIKE) - est)
                cost[w][k] = est
                weight[w][k] = old + count / world

    def _prior(self, candidate: Candidate, bucket: int, kind: int) -> float | None:
        """What a cell is believed to cost before its first step. Greedy: its replay plus what steps of its
        candidate kind cost beyond their replays (`_overhead`). Sampled: the same cell's greedy estimate (its
        own steps while trusted, else that prior) plus the sampled walk's surcharge at its width
        (`_surcharge`)."""
        if kind == SAMPLED:
            greedy = self._greedy_estimate(candidate, bucket)
            return None if greedy is None else greedy + self._surcharge(candidate, bucket)
        replay = self._start_replay(candidate.width, bucket)
        return None if replay is None else replay + self._overhead(candidate, bucket)

    def _prior_measured(self, i: int, bucket: int, kind: int) -> bool:
        """Whether cell (candidate index `i`, `bucket`, `kind`)'s prior has every part measured: an overhead (some
        cell's steps beyond its replay) and, for a sampled cell, a surcharge (some cell measured both ways). A part
        not measured counts 0: the prior is then a bound from below only (on the launch-bound pair the bare replay
        is a twentieth of a step), not what a first timing may be clipped to."""
        if not self._overhead_measured:
            return False
        chain = self.candidates[i].is_chain
        return kind == GREEDY or self._surcharges[chain][bucket] is not None

    def _start_replay(self, width: int, bucket: int) -> float | None:
        return self.start_cost.get((int(width), self.buckets[bucket]))

    def _candidate_of(self, obs: StepObservation) -> Candidate | None:
        """The candidate whose cost a step measured: its own; a step that memory shrank counts for the
        tree candidate whose graph width it ran at, an unpadded shrunk tree for none."""
        for c in self.candidates:
            if c.budget == obs.budget and c.width == obs.width:
                return c
        return next((c for c in self.trees if c.width == obs.width and obs.budget), None)

    def _overhead(self, candidate: Candidate, bucket: int) -> float:
        """What greedy steps of the candidate's kind (chain, or tree) cost beyond their verify replay in this
        bucket (draft, build, walk, real-context attention), from its kind's measured greedy cells here and in
        the nearest measured buckets either side (`_measure_extra`); else the nearest measured bucket's; else
        its sampled cells' (traffic with no greedy requests: their walks are what it pays); else the other
        kind's (both draft); else 0. The smallest of them: a guess too low is corrected by the plan's next
        steps, one too high never is (nothing steps there). The chain's is at most the trees': a chain step is
        a tree step without the build, the mask and the tree walk, and the chain is stepped in rarely, so its
        few timed steps (first uses of the linear path at a batch size) would otherwise pass their spikes from
        bucket to bucket, each first timing clipped only against a prior the last one raised (on the H100 its
        estimate reached 2.5x the same-width tree's at every batch size)."""
        return self._overheads[candidate.is_chain][bucket]

    def _nearest(self, table: dict, bucket: int, keys: Sequence[Any]) -> Any:
        """The first entry not None of `table[key]` in the buckets nearest `bucket`, for each of `keys` in turn."""
        for key in keys:
            row = table[key]
            for k in self._by_distance[bucket]:
                if row[k] is not None:
                    return row[k]
        return None

    def _surcharge(self, candidate: Candidate, bucket: int) -> float:
        """What a sampled step of the candidate costs beyond a greedy one: a sampled walk builds the target's
        distribution at every verified node, so a fixed part plus one per verify token (width times the
        bucket's batch size), fitted to the cells of its kind (chain, or tree) measured both ways in the nearest
        bucket that has any (`_measure_extra`); else the other kind's; else 0 (optimistic: the plan visits the
        cell and measures it)."""
        fit = self._surcharges[candidate.is_chain][bucket]
        if fit is None:
            return 0.0
        fixed, per_token, widest = fit
        return fixed + per_token * min(candidate.width * self.buckets[bucket], widest)

    def _measure_extra(self) -> None:
        """Per candidate kind, kind of request and bucket, the least that its measured cells cost beyond their
        replays, at most `COST_SPIKE` times that of the nearest measured buckets either side (the overhead moves
        little from one bucket to the next, while a bucket whose only measured cell had slow first steps, at a
        batch size reached for the first time, would otherwise lend its spikes to every cell around it, and bar
        them); then per candidate kind and bucket, the sampled surcharge: what its measured sampled cells cost
        beyond their greedy estimates (their own greedy steps while trusted, else their greedy priors, which
        the overheads just measured give)."""
        trusted = self._trusted_cost
        kinds = ((True, [self.chain]), (False, self.trees))
        # Per (candidate kind, kind of request) and bucket: the least its measured cells cost beyond their
        # replays, None where none is measured.
        extras: dict[tuple[bool, int], list[float | None]] = {}
        for chain, kind in kinds:
            for request in KINDS:
                here: list[float | None] = []
                for k in range(len(self.buckets)):
                    extra = [cost - replay for c in kind if (cost := trusted(request, c, k)) is not None
                             and (replay := self._start_replay(c.width, k)) is not None]
                    here.append(max(0.0, min(extra)) if extra else None)
                measured = [k for k, x in enumerate(here) if x is not None]
                out = extras[chain, request] = [None] * len(self.buckets)
                for j, k in enumerate(measured):
                    around = [here[m] for m in (measured[j - 1] if j else None,
                                                measured[j + 1] if j + 1 < len(measured) else None) if m is not None]
                    out[k] = min([here[k], *(COST_SPIKE * x for x in around)])
        self._overhead_measured = any(x is not None for row in extras.values() for x in row)
        for chain in (True, False):
            for k in range(len(self.buckets)):
                own = self._nearest(extras, k, [(chain, kind) for kind in KINDS])
                other = self._nearest(extras, k, [(not chain, kind) for kind in KINDS])
                self._overheads[chain][k] = (other or 0.0) if own is None else (
                    min(own, other) if chain and other is not None else own)
        fits: dict[bool, list[tuple[float, float, float] | None]] = {}
        for chain, kind in kinds:
            fits[chain] = [_fixed_and_per_token(
                [(float(c.width * bs), max(0.0, sampled - greedy)) for c in kind
                 if (sampled := trusted(SAMPLED, c, k)) is not None
                 and (greedy := self._greedy_estimate(c, k)) is not None])
                for k, bs in enumerate(self.buckets)]
        # A bucket with one token count measured takes its per-token part from the nearest bucket whose cells
        # told the two parts apart (the sampled walk's cost per verify token is the walk's, not the batch's),
        # its fixed part from its own cell.
        lines = {chain: [None if f is None or math.isfinite(f[2]) else f[1] for f in fits[chain]]
                 for chain in (True, False)}
        for chain in (True, False):
            for k, fit in enumerate(fits[chain]):
                if fit is None or not math.isfinite(fit[2]):
                    continue
                slope = self._nearest(lines, k, [chain, not chain])
                if slope is not None:
                    per_token = min(slope, fit[1])
                    fits[chain][k] = (fit[2] * (fit[1] - per_token), per_token, math.inf)
        for chain in (True, False):
            for k in range(len(self.buckets)):
                self._surcharges[chain][k] = self._nearest(fits, k, [chain, not chain])

    def _greedy_estimate(self, candidate: Candidate, bucket: int) -> float | None:
        """A greedy step's cost: its own trusted steps, else its prior."""
        trusted = self._trusted_cost(GREEDY, candidate, bucket)
        return self._prior(candidate, bucket, GREEDY) if trusted is None else trusted

    def _trusted_cost(self, kind: int, candidate: Candidate, bucket: int) -> float | None:
        i = self._index[candidate]
        return self.cost_estimate[kind][i][bucket] if self.cost_weight[kind][i][bucket] >= MIN_COST_WEIGHT else None

    def _fitted(self, candidate: Candidate, batch_size: int, request_kind: int) -> float | None:
        """`a + b * batch + c * width * batch` (per step, per request, per verify token) least-squares fitted
        to the measured cells of the candidate's kind for `request_kind`; None while they cannot tell the three
        apart (fewer than two widths or two batch sizes measured)."""
        kind = [self.chain] if candidate.is_chain else self.trees
        cost, cost_weight = self.cost_estimate[request_kind], self.cost_weight[request_kind]
        rows = [(float(bs), float(c.width * bs), cost[i][k], cost_weight[i][k])
                for i, c in enumerate(self.candidates) if c in kind for k, bs in enumerate(self.buckets)
                if cost_weight[i][k] >= MIN_COST_WEIGHT]
        if len({r[0] for r in rows}) < 2:
            return None
        # The chain has one width: its per-token term cannot be told from the per-request one.
        widths_vary = not candidate.is_chain and len({r[1] / r[0] for r in rows}) >= 2
        if not candidate.is_chain and not widths_vary:
            return None
        features = [(1.0, bs, wbs) if widths_vary else (1.0, bs) for bs, wbs, _, _ in rows]
        n = len(features[0])
        # Normal equations, weighted by each cell's observation weight.
        m = [[sum(r[3] * f[i] * f[j] for f, r in zip(features, rows, strict=True)) for j in range(n)] for i in range(n)]
        v = [sum(r[3] * f[i] * r[2] for f, r in zip(features, rows, strict=True)) for i in range(n)]
        coef = _solve(m, v)
        if coef is None:
            return None
        x = (1.0, float(batch_size), float(candidate.width * batch_size))
        return max(sum(c * xi for c, xi in zip(coef, x, strict=False)), 1e-9)

    def _replan(self) -> None:
        """What every bucket's plan reads (the overheads, the acceptance curves, the traffic's mix); the buckets
        themselves are planned when first needed (`_bucket_plan`): a step plans its own, not all of them (a
        re-plan of every bucket was most of auto's host time per step on a launch-bound target). A bucket's
        plan reads only state a refresh folds, so it is the same whenever it is made, on every rank."""
        cands = self.candidates
        self._smooth_costs()
        self._measure_extra()
        accepted = [self.expected_accepted(c) for c in cands]
        by_kind = [[self.expected_accepted(c, kind) for kind in KINDS] for c in cands]
        self._replan_inputs = (accepted, by_kind, self._optimistic_accepted(accepted), self.sampled_share())
        self._stale = [True] * len(self.buckets)

    def _smooth_costs(self) -> None:
        """`cost_estimate`: per bucket, the greedy tree cells trusted by their own steps replaced by their isotonic
        regression in width (weighted by the cells' observation weights), every other cell as it is. A wider tree's
        step does all a narrower one's does and more (a wider replay, a larger build and walk), but cells stepped in
        at different moments read the host's drift: on an H100 (2026-12-07, batch 1, payload 0.8.28) the 127-tree's
        cell read 3.23 ms, 15's 3.77, 31's 4.09 and 63's 4.53, and the noise, not the cost, chose where exploring
        steps went (in one pass 66 % of the steps went to the narrower trees and the chain). Pooled, a rarely
        stepped cell takes the level of the often stepped one beside it. Not pooled: the chain (no narrower tree: no
        build, mask or walk; on v2 an eager step), priors (optimistic on purpose), and sampled cells, which hold
        steps whose batches were anywhere from half to all sampled, so their levels differ by the traffic each was
        stepped in as much as by width, and their width structure is the surcharge fit's (`_measure_extra`).
        On the pair's simulator (tests/ddtree_pair_sim.py, 200 seeds of auto_bench's greedy and T 0.8 schedule, auto
        against the best fixed candidate) pooling the greedy cells kept the mean (0.9887 -> 0.9886) and lifted the
        worst seed (0.937 -> 0.955); pooling the sampled cells too lost 0.2 % (0.9863; tenth percentile 0.972)."""
        for kind in KINDS:
            for i in range(len(self.candidates)):
                self.cost_estimate[kind][i][:] = self.cost[kind][i]
        cost, weight, out = self.cost[GREEDY], self.cost_weight[GREEDY], self.cost_estimate[GREEDY]
        for k in range(len(self.buckets)):
            cells = [i for i, c in enumerate(self.candidates) if not c.is_chain and weight[i][k] >= MIN_COST_WEIGHT]
            cells.sort(key=lambda i: self.candidates[i].width)
            for i, seconds in zip(cells, _isotonic([cost[i][k] for i in cells], [weight[i][k] for i in cells]),
                                  strict=True):
                out[i][k] = seconds

    def _bucket_plan(self, k: int) -> None:
        """Plan bucket `k` from the last re-plan's inputs, unless done since."""
        if not self._stale[k]:
            return
        self._stale[k] = False
        # Lists by candidate index: hashing the Candidate dataclass was most of a refresh.
        cands = self.candidates
        accepted, by_kind, optimistic, share = self._replan_inputs
        per_kind = [[self.kind_seconds(c, k, kind) for kind in KINDS] for c in cands]
        # The plan and its exploration prices are for the traffic's mix; a step scores its own (`_best`).
        seconds = [None if None in x else _mixed(x, share) for x in per_kind]
        self._scores[k] = [(c, per_kind[i], by_kind[i]) for i, c in enumerate(cands)
                           if accepted[i] is not None and seconds[i] is not None and min(per_kind[i]) > 0]
        if all(s is None for s in seconds):
            # No cost known for this bucket (no graphs timed, nothing stepped yet): as far as we know
            # the candidates cost alike, so the one that accepts most wins (ties: the narrower).
            known = [i for i in range(len(cands)) if accepted[i] is not None]
            self._plan[k] = cands[max(known, key=lambda i: (accepted[i], -cands[i].width))] if known else self.largest
            self._explore[k] = [(c, 1) for c in cands if c is not self._plan[k]]
            return
        scored = [(self.buckets[k] * (1.0 + accepted[i]) / seconds[i], c)
                  for c, _, _ in self._scores[k] for i in (self._index[c],)]
        if not scored:
            self._plan[k] = self.largest
            self._explore[k] = [(c, 1) for c in cands if c is not self.largest]
            return
        plan = self._plan[k] = _narrowest_best(scored)
        self._explore[k] = self._explore_table(k, self._index[plan], seconds, accepted, optimistic)

    def _explore_table(self, k: int, plan: int, seconds: list, accepted: list,
                       optimistic: list) -> list[tuple[Candidate, int]]:
        """Once in how many of bucket `k`'s exploration rounds each candidate other than the plan (index
        `plan`; the other arguments by candidate index) is explored.

        A step of `c` loses `loss` plan steps (`_explore_loss`: its time at this batch beyond what the plan
        takes for the tokens `c` brings). What it can earn is the chance that `c` beats the plan here: its
        optimistic tokens per second (`_optimistic_accepted`, `_optimistic_seconds`) against the plan's
        estimate; a cost that is only a fit over other cells (`_guessed`) may be anything. The candidates that
        may still win share `EXPLORE_SHARE - RECHECK_SHARE` of the plan's time, each in proportion to the part
        of its optimistic range above the plan (all of it while its estimate wins or ties, none once its upper
        bound falls below the plan: evidence ends its exploration); every candidate that loses has at least
        an equal part of `RECHECK_SHARE`. Equal parts for a fixed total keep the staleness of all of them
        lowest: a cheap candidate is explored often, a dear one rarely. A candidate whose acceptance or cost
        here is not known at all is explored every round: it must be measured."""
        bs, share = self.buckets[k], self.sampled_share()
        plan_rate = bs * (1.0 + accepted[plan]) / seconds[plan]
        rows: list[tuple[int, float, float | None]] = []  # (candidate index, loss, weight)
        for i in range(len(self.candidates)):
            if i == plan:
                continue
            loss = self._explore_loss(i, plan, seconds, accepted)
            if seconds[i] is None or accepted[i] is None or optimistic[i] is None:
                rows.append((i, loss, None))
                continue
            rate = bs * (1.0 + accepted[i]) / seconds[i]
            upper = bs * (1.0 + optimistic[i]) / self._optimistic_seconds(i, k, seconds[i], share)
            if rate >= plan_rate or self._guessed(i, k):
                weight = 1.0
            elif upper <= plan_rate:
                weight = 0.0
            else:
                weight = min(1.0, (upper - plan_rate) / (upper - rate))
            rows.append((i, loss, weight))
        lossy = sum(1 for _, loss, _ in rows if loss > 0.0)
        hopeful = sum(1 for _, loss, weight in rows if loss > 0.0 and weight)
        table = []
        for i, loss, weight in rows:
            if weight is None or loss <= 0.0:
                table.append((self.candidates[i], 1))
                continue
            share = max(RECHECK_SHARE / lossy, (EXPLORE_SHARE - RECHECK_SHARE) * weight / max(1, hopeful))
            table.append((self.candidates[i], max(1, math.ceil(loss / (share * self.explore_every)))))
        return table

    def _optimistic_accepted(self, accepted: list) -> list[float | None]:
        """The acceptance each candidate (by index) could still have (pooled kinds, as the plan): `UCB_Z`
        spreads of its measured requests above the estimate, and never more than best-first trees allow: a
        node added later is worth at most one added earlier, so a budget's gain over the next smaller one is at
        most its added nodes times the (optimistic) gain per node below it, the smallest budget's acceptance
        per node first. That bounds a budget never explored too, from what smaller ones showed at any batch
        size. The chain: the spread of its own steps' requests (at most the largest tree's bound), else the
        same-width tree's bound; never below its estimate."""
        out: list[float | None] = [None] * len(self.candidates)
        below = per_node = None
        for j, c in enumerate(self.trees):
            i = self._index[c]
            a = accepted[i]
            if a is None:
                return out  # nothing measured yet
            n = sum(self.accept_n[kind][j] for kind in KINDS)
            spread = UCB_Z * ACCEPT_SD / math.sqrt(n) if n > 0 else math.inf
            if below is None:
                out[i] = a + spread
                per_node = out[i] / max(1, c.budget)
            else:
                nodes = c.budget - self.trees[j - 1].budget
                gain = min(a - accepted[self._index[self.trees[j - 1]]] + spread, nodes * per_node)
                per_node = gain / max(1, nodes)
                out[i] = below + gain
            below = out[i]
        chain = self._index[self.chain]
        a = accepted[chain]
        n = sum(self.chain_shape_n) if sum(self.chain_shape_ref) >= MIN_SHAPE_BASE else sum(self.chain_step_n)
        if a is not None and n > 0:
            out[chain] = a + UCB_Z * ACCEPT_SD / math.sqrt(n)
            if below is not None:
                out[chain] = max(a, min(out[chain], below))
        elif self.trees:
            out[chain] = max(a or 0.0, out[self._index[self.trees[0]]])
        return out

    def _guessed(self, i: int, bucket: int) -> bool:
        """Whether cell (candidate index `i`, `bucket`)'s cost is only the fit over other cells (no steps of its
        own of either kind of request, no start-up replay)."""
        return (all(self.cost_weight[kind][i][bucket] <= 0 for kind in KINDS)
                and self._start_replay(self.candidates[i].width, bucket) is None)

    def _optimistic_seconds(self, i: int, bucket: int, seconds: float, share: float) -> float:
        """The least a step of candidate index `i` in `bucket` may cost at the traffic's mix (`share` sampled):
        `UCB_Z` spreads below its estimate (its own steps' spread, `COST_CV` over the root of their decayed
        count, the kinds' counts mixed; a prior's, `PRIOR_CV`); while the cell holds fewer than `TRUSTED_STEPS`
        steps, never above its prior's bound (one spiky step, a prefill between steps, cannot bar a candidate:
        it is explored on its prior until measured)."""
        weight = _mixed([self.cost_weight[kind][i][bucket] for kind in KINDS], share)
        trusted = weight >= MIN_COST_WEIGHT or (weight > 0 and self._start_replay(self.candidates[i].width, bucket) is None)
        spread = max(COST_FLOOR, COST_CV / math.sqrt(weight)) if trusted else PRIOR_CV
        low = seconds * max(0.5, 1.0 - UCB_Z * spread)
        priors = [self._prior(self.candidates[i], bucket, kind) for kind in KINDS]
        if weight < TRUSTED_STEPS and None not in priors:
            low = min(low, _mixed(priors, share) * (1.0 - UCB_Z * PRIOR_CV))
        return low

    @staticmethod
    def _explore_loss(i: int, plan: int, seconds: list, accepted: list) -> float:
        """What one step of candidate `i` loses against the plan, in plan steps: its time beyond what the plan
        takes for the tokens `i` brings (0 where a cost is unknown: such a cell must be measured anyway)."""
        s, s_plan, a_plan = seconds[i], seconds[plan], accepted[plan]
        if s is None or s_plan is None or a_plan is None:
            return 0.0
        a = a_plan if accepted[i] is None else accepted[i]
        return max(0.0, s / s_plan - (1.0 + a) / (1.0 + a_plan))


def _narrowest_best(scored: list[tuple[float, Candidate]]) -> Candidate:
    """The best score; ties within a part in a thousand go to the narrower verify (less memory traffic; the
    timings are not that exact)."""
    best = max(s for s, _ in scored)
    return min((c for s, c in scored if s >= best * (1 - 1e-3)), key=lambda c: (c.width, c.budget))


def _fixed_and_per_token(points: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """`(a, b, x)` with `surcharge = a + b * min(tokens, x)` through `(tokens, surcharge)` points, none negative.
    Where the points have two token counts, a least-squares line (`x` infinite). Where they have one, the
    per-token part cannot be told from the fixed one: all of it per token up to that count, none beyond (`x`
    the count), so a narrower cell is priced lower and a wider one no higher: optimistic both ways, so the plan
    visits the cell and its own steps correct the price, where a price too high would never be (`_measure_extra`
    takes the per-token part from a bucket that told the two apart, where one has). Extrapolated
    instead, one width-16 cell's surcharge at batch 2 (5.6 ms, most of it the sampled walk's fixed cost, read as
    0.18 ms per token) priced the 127-tree's sampled step at 46 ms on the launch-bound pair (H100, payload
    0.8.20: its steps took 7-10 ms); auto served T 0.8 batches of 4-16 with the 15-tree while full 128 ran
    1.3-1.45x its speed."""
    if not points:
        return None
    xs = {x for x, _ in points}
    if len(xs) < 2:
        x = next(iter(xs))
        return 0.0, sum(y for _, y in points) / len(points) / max(x, 1.0), x
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, slope)
    fixed = my - slope * mx
    if fixed < 0.0:  # through the origin instead
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points), math.inf
    return fixed, slope, math.inf


def _isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent violators)."""
    blocks: list[tuple[float, float, int]] = []  # (weighted sum, weight, cells)
    for v, w in zip(values, weights, strict=True):
        blocks.append((v * w, w, 1))
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            last, before = blocks.pop(), blocks.pop()
            blocks.append((before[0] + last[0], before[1] + last[1], before[2] + last[2]))
    return [s / w for s, w, n in blocks for _ in range(n)]


def _mixed(per_kind: Sequence[float], share: float) -> float:
    """A greedy and a sampled figure mixed by the share of sampled requests."""
    return per_kind[GREEDY] if share <= 0.0 else (1.0 - share) * per_kind[GREEDY] + share * per_kind[SAMPLED]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (n x n); None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(1.0, max(abs(x) for row in a for x in row[:n]))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]
