"""A simulated DDTree server with the 8.2 B shell's costs (H200, payload 0.8.0, bench/RESULTS.md call 3), to
price `--speculative-ddtree-budget auto`'s exploration against an oracle that plays the best fixed candidate
for each batch size.

- Verify cost: the shell's start-up replays, ms per step per (width, captured batch size), all 27 buckets of
  `--cuda-graph-max-bs 64` (call 3's `/server_info` `replay_ms`), plus 0.5 ms of real-context attention.
- The rest of a step: draft 1.2 -> 2.5 ms from batch 1 to 64; a tree step's build / mask / walk / commit
  2.2 ms + 0.05 ms a request + 0.4 ms per doubling of the width + 0.5 us a verify token (auto's measured
  cells at batch 4 grew ~1 ms per doubling); a chain step's commit 1 ms + 0.03 ms a request. Steps are noisy
  (+-8 %), a cell's first `slow_first` steps are slow (a graph's first replay, 3-8x), and 1 % of steps carry a
  spike (a prefill between steps, 2-4x).
- A sampled request's walk builds the target's distribution at every verified node: 1.8 ms a step plus 15 us
  per sampled request and verify token (the H100 diagnostic of payload 0.8.16: full 16's walk at T 0.8 took
  2.7 / 3.05 / 5.1 / 18.8 ms at batch 1 / 4 / 16 / 64, auto's 63-tree 4.2 ms at batch 1).
- Acceptance (extra tokens per request-step, call 3's curve): chain 0.45, 15: 1.02, 31: 1.16, 63: 1.34,
  127: 1.34; sampled requests (a guess: less, and less gain from width) 0.40, 0.85, 0.93, 1.0, 1.0. Each
  request's walk draws one uniform and every budget's accepted length is the geometric quantile of it (capped
  at the block's 15), so a larger tree accepts at least what a smaller one did, as the walks are nested;
  `ease` scales every budget's mean alike (moving traffic).

The oracle's best candidate per batch size is computed from the same true costs and acceptance; `run`
reports, per batch bucket, auto's expected tokens per second (true means, the picks auto made) against the
best fixed candidate's on the same steps, and what exploring steps cost.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 44, 48, 52, 56, 60, 64]
REPLAY_MS = {
    16: [5.4139, 5.5448, 5.6956, 5.802, 6.3165, 6.4679, 6.5719, 6.6044, 7.4166, 8.0942, 8.8337, 8.687, 10.1947,
         10.5801, 11.9177, 11.9315, 14.1145, 13.8524, 14.0455, 14.3958, 17.8768, 20.3227, 20.8153, 25.3246,
         25.1087, 26.0838, 27.1188],
    32: [5.5202, 5.7234, 6.0776, 6.2053, 6.9951, 7.6506, 8.0892, 7.8944, 9.775, 10.7441, 12.631, 12.7984,
         15.1671, 15.9168, 18.3553, 18.5653, 23.0827, 22.4071, 23.2795, 23.9446, 30.3994, 33.1283, 36.5058,
         42.3575, 41.8834, 45.4765, 46.8444],
    64: [5.559, 6.0104, 7.0951, 7.3601, 9.3006, 10.246, 11.765, 11.9652, 15.0948, 17.5664, 21.2876, 22.4748,
         26.3047, 28.9588, 31.4478, 34.4803, 40.3888, 39.6175, 43.3746, 44.6079, 57.3646, 62.2073, 67.3987,
         73.8174, 81.138, 85.0928, 89.8667],
    128: [6.487, 7.7826, 10.1883, 14.7781, 19.9249, 21.3456, 25.5294, 24.8422, 29.0497, 34.4471, 52.5152,
          47.3008, 59.0458, 60.3473, 62.1881, 67.0708, 84.2474, 80.8969, 84.8372, 89.1997, 114.1896, 124.7714,
          133.7521, 147.616, 155.6694, 168.7884, 177.5893],
}
ACCEPT = {0: 0.45, 15: 1.02, 31: 1.16, 63: 1.34, 127: 1.34}
ACCEPT_SAMPLED = {0: 0.40, 15: 0.85, 31: 0.93, 63: 1.0, 127: 1.0}
SAMPLED_WALK_MS, SAMPLED_TOKEN_MS = 1.8, 0.015
DEPTH = 15  # the block's most accepted draft tokens


def capped_mean(mean: float) -> float:
    """E[min(X, DEPTH)] for X geometric with mean `mean` (what `_accepted_lengths` draws)."""
    p = mean / (1.0 + mean)
    return sum(p**k for k in range(1, DEPTH + 1))


def _quantile(u: float, mean: float) -> int:
    if mean <= 0:
        return 0
    p = mean / (1.0 + mean)
    return min(DEPTH, int(math.log(1.0 - u) / math.log(p)))


class ShellServer:
    """True costs and acceptance of the shell; `observation` is what one step of a candidate reports."""

    def __init__(self, ab, rng: random.Random, *, accept: dict[int, float] | None = None, spikes: bool = True,
                 slow_first: int = 1):
        self.ab, self.rng, self.spikes, self.slow_first = ab, rng, spikes, slow_first
        self.accept = dict(ACCEPT if accept is None else accept)
        self.accept_sampled = dict(ACCEPT_SAMPLED)
        self._first: dict = {}

    @staticmethod
    def bucket(bs: int) -> int:
        return next(b for b in BUCKETS if b >= bs)

    def true_seconds(self, c, bs: int, sampled: int = 0) -> float:
        k = BUCKETS.index(self.bucket(bs))
        w = c.width
        draft = 1.2 + 1.3 * (bs - 1) / 63
        # A chain step commits; a tree step also builds, masks and walks, more so the wider it is.
        extra = 1.0 + 0.03 * bs if c.is_chain else 2.2 + 0.05 * bs + 0.4 * math.log2(w / 16) + 0.0005 * w * bs
        if sampled:
            extra += SAMPLED_WALK_MS + SAMPLED_TOKEN_MS * w * sampled
        return (draft + REPLAY_MS[w][k] + 0.5 + extra) * 1e-3

    REPLAYS = REPLAY_MS  # ms per (width, bucket) that `start_replays` reports

    def start_replays(self) -> dict[tuple[int, int], float]:
        """What the verify graphs' timed replays at start report (+-3 %)."""
        return {(w, bs): self.REPLAYS[w][k] * 1e-3 * self.rng.uniform(0.97, 1.03)
                for w in self.REPLAYS for k, bs in enumerate(BUCKETS)}

    def expected_tokens(self, c, bs: int, ease: float = 1.0, sampled: int = 0) -> float:
        return ((bs - sampled) * (1.0 + capped_mean(self.accept[c.budget] * ease))
                + sampled * (1.0 + capped_mean(self.accept_sampled[c.budget] * ease)))

    def throughput(self, c, bs: int, ease: float = 1.0, sampled: int = 0) -> float:
        return self.expected_tokens(c, bs, ease, sampled) / self.true_seconds(c, bs, sampled)

    NOISE = 0.08  # a step's wall time spreads this much either side of its true mean

    def noise(self, c, bs: int) -> float:
        """A step's wall time over its true mean: +-NOISE, a cell's first `slow_first` steps 3-8x, 1 % spikes 2-4x."""
        rng = self.rng
        noise = rng.uniform(1.0 - self.NOISE, 1.0 + self.NOISE)
        cell = (c, self.bucket(bs))
        if self.spikes and self._first.get(cell, 0) < self.slow_first:
            self._first[cell] = self._first.get(cell, 0) + 1
            noise *= rng.uniform(3.0, 8.0)
        elif self.spikes and rng.random() < 0.01:
            noise *= rng.uniform(2.0, 4.0)
        return noise

    def observation(self, c, bs: int, budgets: list[int], ease: float = 1.0, sampled: int = 0):
        rng = self.rng
        noise = self.noise(c, bs)
        sums = []
        for accept, n in ((self.accept, bs - sampled), (self.accept_sampled, sampled)):
            accepted = [0.0] * len(budgets)
            chain = 0.0
            for _ in range(n):
                u = rng.random()
                if c.is_chain:
                    chain += _quantile(u, accept[0] * ease)
                    continue
                for i, b in enumerate(budgets):
                    if b <= c.budget:
                        accepted[i] += _quantile(u, accept[b] * ease)
                # A tree walk's chain figure is a lower bound (the walk may leave the chain).
                chain += _quantile(u, accept[0] * ease * 0.9)
            sums.append((accepted, chain, n))
        (accepted, chain, n), (s_accepted, s_chain, s_n) = sums
        return self.ab.StepObservation(budget=c.budget, width=c.width, batch_size=bs,
                                       seconds=self.true_seconds(c, bs, sampled) * noise, accepted=accepted,
                                       chain=chain, requests=n, sampled_accepted=s_accepted, sampled_chain=s_chain,
                                       sampled_requests=s_n)


# ----------------------------------------------------------------------------- traces


def steady(bs: int, steps: int, rng: random.Random, ease_walk: float = 0.0) -> list[tuple[int, float]]:
    """A constant batch size; `ease_walk` > 0 moves the traffic's ease (AR(1) in about 0.6 .. 1.4)."""
    out, ease = [], 1.0
    for _ in range(steps):
        if ease_walk:
            ease = min(1.5, max(0.5, 1.0 + 0.97 * (ease - 1.0) + rng.gauss(0.0, ease_walk)))
        out.append((bs, ease))
    return out


def moving(steps: int, rng: random.Random, *, period: int = 4000, life: float = 60.0) -> list[tuple[int, float]]:
    """Live traffic: requests arrive (Poisson, a rate that swings slowly between ~1 and ~60 running requests
    over `period` steps, with bursts) and leave after ~`life` steps each; the batch is the running requests
    (at most 64, at least 1), the traffic's ease moves too."""
    out, running, ease = [], 1, 1.0
    for t in range(steps):
        level = 0.5 - 0.5 * math.cos(2 * math.pi * t / period)  # 0 .. 1
        rate = (0.5 + 60.0 * level**2) / life
        if rng.random() < 0.002:
            running += rng.randrange(4, 24)  # a burst
        running += _poisson(rng, rate)
        running -= sum(1 for _ in range(running) if rng.random() < 1.0 / life)
        running = max(1, min(64, running))
        ease = min(1.5, max(0.5, 1.0 + 0.97 * (ease - 1.0) + rng.gauss(0.0, 0.03)))
        out.append((running, ease))
    return out


def benchmark(rng: random.Random, *, batches=(1, 4, 16, 64), warmup: int = 3, passes: int = 2,
              steps: int = 20, kinds: tuple[bool, ...] = (False,)) -> tuple[list[tuple[int, float, int]], int]:
    """`bench/gpu/auto_bench.py` on a fresh server: for each kind (False greedy, True sampled: T 0.8),
    `warmup` batches of each size, then `passes` measured ones, each of every kind in turn; a batch is `steps`
    steps at its size, then its requests finish one after another (the batch drains: 3/4, 1/2, 1/4 of it,
    then 1). Returns the trace ((batch size, ease, sampled requests)) and the index of its first measured
    step."""
    def one(bs: int, sampled: bool) -> list[tuple[int, float, int]]:
        tail = [max(1, bs * 3 // 4), max(1, bs // 2), max(1, bs // 4), 1] if bs > 1 else []
        return [(b, 1.0, b if sampled else 0) for b in [bs] * steps + tail]

    out: list[tuple[int, float, int]] = []
    for sampled in kinds:
        for bs in batches:
            for _ in range(warmup):
                out += one(bs, sampled)
    measured = len(out)
    for _ in range(passes):
        for sampled in kinds:
            for bs in batches:
                out += one(bs, sampled)
    return out, measured


def _poisson(rng: random.Random, lam: float) -> int:
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p < limit:
            return n
        n += 1


# ----------------------------------------------------------------------------- the run


@dataclass
class Cell:
    steps: int = 0
    explore_steps: int = 0
    tokens: float = 0.0  # auto's expected tokens (true means, auto's picks)
    seconds: float = 0.0  # auto's true mean step times
    explore_lost: float = 0.0  # seconds the exploring steps took beyond the bucket's best for their tokens
    per_candidate: dict = field(default_factory=dict)  # candidate -> (tokens, seconds) if it had played every step

    def best_fixed(self) -> tuple[object, float]:
        c, (tok, sec) = max(self.per_candidate.items(), key=lambda kv: kv[1][0] / kv[1][1])
        return c, tok / sec

    def ratio(self) -> float:
        return self.tokens / self.seconds / self.best_fixed()[1]


def run(ab, auto, server: ShellServer, trace, *, skip: int = 0) -> dict[int, Cell]:
    """Step `auto` through `trace` ([(batch size, ease)] or [(batch size, ease, sampled requests)]); per batch
    bucket (and kind: a sampled step counts under the bucket's negative) what it made against the best fixed
    candidate (`skip` first steps observed but not counted)."""
    cells: dict[int, Cell] = {}
    budgets = list(auto.budgets)
    for step, (bs, ease, *rest) in enumerate(trace):
        sampled = rest[0] if rest else 0
        before = auto.explore_steps
        c = auto.choose(bs, step, sampled=sampled)
        explored = auto.explore_steps > before
        auto.observe(server.observation(c, bs, budgets, ease, sampled))
        if auto.due(step):
            auto.refresh()
        if step < skip:
            continue
        cell = cells.setdefault(-server.bucket(bs) if sampled else server.bucket(bs), Cell())
        tok, sec = server.expected_tokens(c, bs, ease, sampled), server.true_seconds(c, bs, sampled)
        cell.steps += 1
        cell.tokens += tok
        cell.seconds += sec
        best = max(auto.candidates, key=lambda x: server.throughput(x, bs, ease, sampled))
        if explored:
            cell.explore_steps += 1
            cell.explore_lost += max(0.0, sec - tok / server.throughput(best, bs, ease, sampled))
        for x in auto.candidates:
            t, s = cell.per_candidate.get(x, (0.0, 0.0))
            cell.per_candidate[x] = (t + server.expected_tokens(x, bs, ease, sampled),
                                     s + server.true_seconds(x, bs, sampled))
    return cells


def overall(cells: dict[int, Cell]) -> float:
    """Auto's tokens per second over every counted step against the best fixed candidate of each bucket's."""
    tok = sum(c.tokens for c in cells.values())
    sec = sum(c.seconds for c in cells.values())
    best_tok = sum(c.per_candidate[c.best_fixed()[0]][0] for c in cells.values())
    best_sec = sum(c.per_candidate[c.best_fixed()[0]][1] for c in cells.values())
    return (tok / sec) / (best_tok / best_sec)


def explore_share(cells: dict[int, Cell], lo: int = 1, hi: int = 64) -> tuple[float, float]:
    """(share of steps that explored, share of time lost to exploring) over the buckets in [lo, hi] (both kinds)."""
    sel = [c for b, c in cells.items() if lo <= abs(b) <= hi]
    steps = sum(c.steps for c in sel)
    return (sum(c.explore_steps for c in sel) / max(1, steps),
            sum(c.explore_lost for c in sel) / max(1e-12, sum(c.seconds for c in sel)))


def new_auto(ab, server: ShellServer, **kw):
    auto = ab.AutoBudget(ab.auto_candidates(127, 16), BUCKETS, 64, **kw)
    auto.seed_start_costs(server.start_replays())
    return auto
