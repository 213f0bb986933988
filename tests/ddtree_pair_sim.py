"""A simulated DDTree server with the launch-bound "trained pair"'s costs and acceptance (H100, payload 0.8.2x,
bench/ddtree_auto_h100_2026-12-06.json call B), the server `--speculative-ddtree-budget auto` reached only
0.85 - 0.97 of the best fixed budget's tokens per second on. Same interface as `ddtree_shell_sim.ShellServer`
(its `run`, `benchmark`, `steady` and `moving` drive it).

- Verify replays: auto's `/server_info` `replay_ms` of that run (0.15 - 0.66 ms: the whole step is 3.5 - 7.5 ms,
  mostly launches).
- A tree step (greedy): the fixed 64-tree server's ms per step (the profile's phases summed, draft to the next
  step's start: 3.65 / 4.28 / 4.45 / 5.32 / 7.13 ms at batch 1 / 4 / 8 / 16 / 64, interpolated) less its replay,
  plus the step's own replay and 0.03 ms per doubling of the width (the build): all widths cost within 2 - 8 %
  of each other (full 128 measured 3.74 against full 64's 3.65 at batch 1).
- A chain step (auto's linear path, not the DFLASH server's): the width-16 tree step plus 0.2 ms plus 25 us a
  request up to 16 (auto's profile: `draft_done->step_done` of its chain steps 2.21 / 2.43 / 2.6 / 3.04 ms at
  batch 1 / 4 / 8 / 16, against 1.99 / 2.23 / 2.26 / 2.43 ms for the fixed 64-tree's phases).
- A sampled request's walk: 1.0 ms a tree step whatever the width (the profile's `target_done->walked`, T 0.8
  against greedy), 0.3 ms a chain step (DFLASH T 0.8 against greedy).
- Noise: +-6 % a step, a cell's first steps slow and 1 % spikes (as the shell's), and slow spells: now and then
  every step is 1.1 - 1.45x slow for 20 - 60 steps (whole passes of the fixed servers ran so: full 128 at batch
  8 / 16 / 64 1.40 / 1.32 / 1.10x its other pass). A rarely stepped cell measured in a spell keeps it.
- Acceptance (extra tokens a request-step; greedy from the fixed servers' accept at batch 1 - 16: DFLASH 0.76,
  full 64 1.72, full 128 1.86, and 15 / 31 by auto's own curve's shape scaled to them; sampled likewise from
  T 0.8): chain 0.76, 15: 1.27, 31: 1.47, 63: 1.72, 127: 1.86; sampled 0.50, 0.87, 1.03, 1.20, 1.32.
"""

from __future__ import annotations

import bisect
import math

import ddtree_shell_sim as shell

BUCKETS = shell.BUCKETS
REPLAY_MS = {
    16: [0.1534, 0.1513, 0.1536, 0.1541, 0.1563, 0.1559, 0.1578, 0.1588, 0.1626, 0.1631, 0.1656, 0.1671, 0.1731,
         0.1748, 0.177, 0.1783, 0.1843, 0.1856, 0.188, 0.1897, 0.2032, 0.2087, 0.2124, 0.2195, 0.224, 0.2277, 0.2322],
    32: [0.1503, 0.1523, 0.1555, 0.1578, 0.162, 0.162, 0.1653, 0.166, 0.173, 0.1744, 0.1805, 0.185, 0.1901, 0.1928,
         0.1996, 0.2035, 0.2112, 0.216, 0.2184, 0.2227, 0.2442, 0.2517, 0.2571, 0.2681, 0.2742, 0.2801, 0.2864],
    64: [0.1542, 0.1587, 0.1637, 0.1676, 0.1743, 0.1762, 0.1816, 0.1856, 0.1965, 0.2057, 0.2167, 0.2236, 0.2331,
         0.2401, 0.2472, 0.2534, 0.2637, 0.2682, 0.2747, 0.2808, 0.3157, 0.3375, 0.3438, 0.3641, 0.3804, 0.3965, 0.4118],
    128: [0.1863, 0.1933, 0.2038, 0.214, 0.2192, 0.2298, 0.2445, 0.2525, 0.2677, 0.2812, 0.2962, 0.3082, 0.325,
          0.3384, 0.3607, 0.3691, 0.3864, 0.4014, 0.4149, 0.4341, 0.4967, 0.5255, 0.5518, 0.5868, 0.6091, 0.6393,
          0.6598],
}
# The fixed 64-tree server's greedy ms per step at these batch sizes (passes without a slow spell).
TREE64_MS = {1: 3.65, 4: 4.28, 8: 4.45, 16: 5.32, 64: 7.13}
BUILD_MS_PER_DOUBLING = 0.03
CHAIN_EXTRA_MS, CHAIN_EXTRA_PER_REQUEST_MS = 0.2, 0.025
SAMPLED_TREE_MS, SAMPLED_CHAIN_MS = 1.0, 0.3
ACCEPT = {0: 0.76, 15: 1.27, 31: 1.47, 63: 1.72, 127: 1.86}
ACCEPT_SAMPLED = {0: 0.50, 15: 0.87, 31: 1.03, 63: 1.20, 127: 1.32}


def _tree64(bs: int) -> float:
    xs = sorted(TREE64_MS)
    if bs >= xs[-1]:
        return TREE64_MS[xs[-1]]
    j = bisect.bisect_right(xs, bs)
    lo, hi = xs[j - 1], xs[j]
    return TREE64_MS[lo] + (TREE64_MS[hi] - TREE64_MS[lo]) * (bs - lo) / (hi - lo)


class PairServer(shell.ShellServer):
    """True costs and acceptance of the pair; `observation` is what one step of a candidate reports."""

    NOISE = 0.06
    REPLAYS = REPLAY_MS

    def __init__(self, ab, rng, *, accept=None, spikes: bool = True, slow_first: int = 1, spells: bool = True):
        super().__init__(ab, rng, accept=ACCEPT if accept is None else accept, spikes=spikes, slow_first=slow_first)
        self.accept_sampled = dict(ACCEPT_SAMPLED)
        self.spells = spells
        self._spell_left, self._spell = 0, 1.0

    def true_seconds(self, c, bs: int, sampled: int = 0) -> float:
        k = BUCKETS.index(self.bucket(bs))
        tree16 = _tree64(bs) - REPLAY_MS[64][k] + REPLAY_MS[16][k] - 2 * BUILD_MS_PER_DOUBLING
        if c.is_chain:
            ms = tree16 + CHAIN_EXTRA_MS + CHAIN_EXTRA_PER_REQUEST_MS * min(bs, 16)
            ms += SAMPLED_CHAIN_MS if sampled else 0.0
        else:
            ms = (_tree64(bs) - REPLAY_MS[64][k] + REPLAY_MS[c.width][k]
                  + BUILD_MS_PER_DOUBLING * math.log2(c.width / 64))
            ms += SAMPLED_TREE_MS if sampled else 0.0
        return ms * 1e-3

    def noise(self, c, bs: int) -> float:
        """The shell's noise (+-6 % here), then the slow spells."""
        noise = super().noise(c, bs)
        if self.spells:
            if self._spell_left <= 0 and self.rng.random() < 1.0 / 300:
                self._spell_left, self._spell = self.rng.randrange(20, 61), self.rng.uniform(1.1, 1.45)
            if self._spell_left > 0:
                self._spell_left -= 1
                noise *= self._spell
        return noise
