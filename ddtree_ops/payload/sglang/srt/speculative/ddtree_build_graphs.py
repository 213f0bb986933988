"""DDTree tree builds replayed from CUDA graphs (installed as
`sglang/srt/speculative/ddtree_build_graphs.py` by the ddtree-ops payload).

A tree build (draft logits from the LM head, top-k, best-first selection, keep-chain, mask
and SGLang's retrive_* arrays) is a few hundred small kernels with no host-device sync. Launched
eagerly at batch 1, their CPU launch cost, not their GPU time, is most of what DDTree adds to a
DFLASH step. So the builds are captured once per batch-size bucket, the buckets being the target
verify graphs' own. A step copies the draft's hidden states into the bucket's static input and
replays one graph.

Padding rows of a bucket hold whatever an earlier step left there (finite hidden states, zeros at
first). Their trees are built and ignored: every tree row depends on its own input row only.

Outputs live in the graphs' memory pool and are overwritten by the next replay of any bucket. The
worker uses a step's tree within that step, before the next build.

A step that affords fewer nodes keeps the first ones of this build (`ddtree_utils.shrink_tree`). With
`--speculative-ddtree-budget auto` v1 captures one set per candidate budget, so a step builds the tree of
the budget it picked; the v2 tree step builds the largest and keeps the pick's first nodes.

Not captured, eager as before:
- batches above the largest bucket;
- tensor parallelism: the vocab gather is an NCCL collective;
- CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

# SGLANG_DDTREE_BUILD_GRAPHS=0 builds every tree eagerly (captured by default wherever the target verify runs
# on CUDA graphs, one device).
BUILD_GRAPHS = os.environ.get("SGLANG_DDTREE_BUILD_GRAPHS", "1") != "0"


class BuildGraph(Protocol):
    """One captured build: `capture(fn, static_in)` runs `fn` once under capture and returns its
    outputs; `replay()` recomputes them in place from `static_in`'s current contents."""

    def capture(self, fn: Callable[[torch.Tensor], Any], static_in: torch.Tensor) -> Any: ...

    def replay(self) -> None: ...


class CudaBuildGraph:
    """A `torch.cuda.CUDAGraph`, all buckets sharing one memory pool, as SGLang's runners do."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[torch.Tensor], Any], static_in: torch.Tensor) -> Any:
        side = torch.cuda.Stream(device=static_in.device)
        side.wait_stream(torch.cuda.current_stream(static_in.device))
        with torch.cuda.stream(side):  # warm-up outside capture: lazy inits, Triton compiles
            fn(static_in)
            fn(static_in)
        torch.cuda.current_stream(static_in.device).wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn(static_in)
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclasses.dataclass
class _Bucket:
    size: int
    static_in: torch.Tensor
    graph: BuildGraph
    tree: Any  # DDTree of `size` rows, the graph's outputs


def slice_tree(tree: Any, rows: int) -> Any:
    """The first `rows` requests of a DDTree (views; `retrive_index` = b * n + i holds for them)."""
    if tree.batch_size == rows:
        return tree
    fields = {}
    for f in dataclasses.fields(tree):
        v = getattr(tree, f.name)
        fields[f.name] = v[:rows] if isinstance(v, torch.Tensor) else v
    return type(tree)(**fields)


class DDTreeBuildGraphs:
    """Captured builds of one budget, one per bucket; `run` returns None where a step must build eagerly."""

    def __init__(
        self,
        build: Callable[[torch.Tensor], Any],
        buckets: list[int],
        *,
        depth: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device | str,
        new_graph: Callable[[], BuildGraph],
    ) -> None:
        """`build(hidden [bs, depth, hidden]) -> DDTree` is the eager build; `new_graph`
        makes one capture (`CudaBuildGraph` with a shared pool on CUDA)."""
        self.sizes = sorted({int(b) for b in buckets if int(b) > 0})
        if not self.sizes:
            raise ValueError("DDTree build graphs need at least one batch-size bucket")
        self.depth, self.hidden = depth, hidden
        self._buckets: list[_Bucket] = []
        # Largest first: its pool allocations are the ones the smaller captures reuse.
        for size in reversed(self.sizes):
            static_in = torch.zeros((size, depth, hidden), dtype=dtype, device=device)
            graph = new_graph()
            tree = graph.capture(build, static_in)
            self._buckets.append(_Bucket(size, static_in, graph, tree))
        self._buckets.sort(key=lambda b: b.size)

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def run(self, draft_tail: torch.Tensor) -> Any:
        """`draft_tail` [bs, depth, hidden] (the draft hidden states after the bonus position): the
        tree of these rows, or None when bs is above the largest bucket."""
        bs = int(draft_tail.shape[0])
        if tuple(draft_tail.shape[1:]) != (self.depth, self.hidden):
            raise ValueError(
                f"DDTree build graphs were captured for [bs, {self.depth}, {self.hidden}], "
                f"got {tuple(draft_tail.shape)}"
            )
        i = bisect_left(self.sizes, bs)
        if i == len(self.sizes):
            return None
        bucket = self._buckets[i]
        bucket.static_in[:bs].copy_(draft_tail)
        bucket.graph.replay()
        return slice_tree(bucket.tree, bs)


def capture_build_graphs(
    build: Callable[[torch.Tensor], Any],
    buckets: list[int],
    *,
    depth: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    pool: Any = None,
) -> DDTreeBuildGraphs:
    """The CUDA capture: every bucket in one graph memory pool (`pool`, shared with other budgets' builds,
    or a new one)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    return DDTreeBuildGraphs(
        build, buckets, depth=depth, hidden=hidden, dtype=dtype, device=device,
        new_graph=lambda: CudaBuildGraph(pool),
    )


def capture_build_sets(
    builds: dict[int, Callable[[torch.Tensor], Any]],
    buckets: Sequence[int],
    lm_head: Any,
    *,
    depth: int,
    dtype: torch.dtype,
    device: Any,
    tp_size: int,
) -> dict[int, DDTreeBuildGraphs] | None:
    """Both workers' builds captured at the target verify graphs' batch sizes (`buckets`), one set per budget of
    `builds` (budget -> the eager build of draft hidden states after the bonus [bs, depth, hidden], hidden the
    LM head's input), largest first in one memory pool; None (every build eager) without verify graphs, off CUDA,
    with TP > 1 (the vocab gather is a collective), or when a capture fails: a slower build, never a server that
    does not start."""
    if not BUILD_GRAPHS or not buckets or lm_head is None or int(tp_size) != 1 or not str(device).startswith("cuda"):
        return None
    t0 = time.perf_counter()
    try:
        pool = torch.cuda.graph_pool_handle()
        graphs = {
            budget: capture_build_graphs(builds[budget], list(buckets), depth=depth, hidden=int(lm_head.weight.shape[1]),
                                         dtype=dtype, device=device, pool=pool)
            for budget in sorted(builds, reverse=True)  # largest first: the others reuse its pool
        }
    except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager build
        logger.warning("DDTree: tree-build CUDA graphs not captured (%s: %s); builds run eagerly", type(e).__name__, e)
        return None
    logger.info("DDTree build graphs captured for budgets %s at bs %s in %.2f s", sorted(graphs),
                next(iter(graphs.values())).sizes, time.perf_counter() - t0)
    return graphs
