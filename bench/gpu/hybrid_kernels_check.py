#!/usr/bin/env python3
"""Issue 25, experiment G1 of bench/gpu/HYBRID.md: SGLang's own Gated DeltaNet verify kernels on DDTree's trees.

A hybrid target verifies a tree through two Triton kernels per GDN layer: the short convolution
(`causal_conv1d_update`, which derives every node's parent from EAGLE-style first-child / next-sibling
arrays) and the gated delta-rule recurrence (`fused_sigmoid_gating_delta_rule_update`, which starts each
node from its parent's cached state). DDTree hands them its own `retrive_next_token` / `retrive_next_sibling`.
This checks, on random DDTrees (plain, keep-chain, shrunk and padded), that every valid node's output and
cached per-node state (conv window, SSM state) equal what the same kernels give when fed that node's
root-to-node path alone, as a one-branch tree: the node saw exactly its ancestors, in order, from the
request's pool state. Bit for bit: the arithmetic per node is the same in both runs.

Its power: the same tokens verified as DFLASH does (no tree arrays: a chain, each node after the one
before it in index order), and the tree with its sibling links dropped (a later sibling then hangs off
the root), must both differ from the per-path reference on branching trees, else the check could not see
a wrong parent.

Runs on the GPU (`--device cuda`: the compiled kernels, bf16 conv inputs as served) and on the CPU under
Triton's interpreter (`TRITON_INTERPRET=1`, float32; tests/test_hybrid_tree_kernels.py), where the same
kernel source runs in numpy. Prints one JSON document; exit 0 only if every check holds.

    PYTHONPATH=/tmp/site python3 bench/gpu/hybrid_kernels_check.py --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

PAYLOAD_UTILS = Path(__file__).resolve().parents[2] / "ddtree_ops/payload/sglang/srt/speculative/ddtree_utils.py"
DEPTH = 15  # DFLASH's block of 16: positions 1..15 after the bonus token
VOCAB = 24


def ddtree_utils() -> Any:
    """The payload's tree builder: installed (a patched site on the GPU machine) or from this checkout."""
    try:
        from sglang.srt.speculative import ddtree_utils as installed
        return installed
    except ImportError:
        spec = importlib.util.spec_from_file_location("ddtree_utils_for_g1", PAYLOAD_UTILS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def random_trees(seed: int, bs: int, budget: int, *, keep_chain: bool = False, shrink: int | None = None) -> Any:
    du = ddtree_utils()
    g = torch.Generator().manual_seed(seed)
    # Peaked rows branch near the root and run deep along the favourite: both shapes in one batch.
    logits = torch.randn(bs, DEPTH, VOCAB, generator=g) * torch.linspace(1.0, 4.0, bs)[:, None, None]
    tree = du.build_ddtree(logits, budget, keep_chain=keep_chain)
    return du.shrink_tree(tree, shrink, pad=True) if shrink is not None else tree


def paths(tree: Any) -> list[list[list[int]]]:
    """Per request, per valid node, the node indices from the root to it."""
    parents = tree.parents.tolist()
    out = []
    for b, n in enumerate(tree.num_nodes.tolist()):
        rows = []
        for v in range(int(n)):
            path = [v]
            while path[-1] != 0:
                path.append(parents[b][path[-1]])
            rows.append(path[::-1])
        out.append(rows)
    return out


def chain_links(rows: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-branch tree per row: node i's first child is i + 1, no siblings."""
    nxt = torch.arange(1, length + 1, device=device, dtype=torch.int64).repeat(rows, 1)
    nxt[:, -1] = -1
    return nxt, torch.full((rows, length), -1, device=device, dtype=torch.int64)


class Case:
    """One batch of trees with random layer inputs and pool states; runs the kernels in tree mode, in
    DFLASH's chain mode, and per path."""

    def __init__(self, tree: Any, *, seed: int, device: torch.device, conv_dtype: torch.dtype,
                 dim: int = 32, width: int = 4, heads: int = 2, v_heads: int = 4, head_k: int = 16, head_v: int = 16):
        self.tree, self.device, self.conv_dtype = tree, device, conv_dtype
        self.bs, self.n = tree.parents.shape
        self.dim, self.kw, self.h, self.hv, self.dk, self.dv = dim, width, heads, v_heads, head_k, head_v
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.slots = torch.arange(1, self.bs + 1, dtype=torch.int32, device=device)  # pool row 0 unused
        # Conv pool [slots, dim, K - 1], contiguous along dim as SGLang's MambaPool lays it out.
        self.conv_pool = rnd(self.bs + 1, width - 1, dim).transpose(1, 2).to(conv_dtype)
        self.x = rnd(self.bs, dim, self.n).to(conv_dtype)
        self.weight = rnd(dim, width, scale=0.5).to(conv_dtype)
        self.bias = rnd(dim, scale=0.1).to(conv_dtype)
        # Recurrence: per token q, k [H, K], v [HV, V], gates a, b [HV]; pool state [slots, HV, K, V] fp32.
        t = self.bs * self.n
        self.q, self.k = rnd(1, t, heads, head_k).to(conv_dtype), rnd(1, t, heads, head_k).to(conv_dtype)
        self.v = rnd(1, t, v_heads, head_v).to(conv_dtype)
        self.a, self.b = rnd(t, v_heads).to(conv_dtype), rnd(t, v_heads).to(conv_dtype)
        self.a_log, self.dt_bias = rnd(v_heads, scale=0.3), rnd(v_heads, scale=0.3)
        self.ssm_pool = rnd(self.bs + 1, v_heads, head_k, head_v, scale=0.1)
        self.paths = paths(tree)

    # ---------------------------------------------------------------- kernels
    def conv(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, nxt: torch.Tensor | None,
             sib: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        from sglang.srt.layers.attention.mamba.causal_conv1d_triton import causal_conv1d_update

        pool = pool.clone()  # the verify writes the pool's window back; every run starts from the same one
        rows, _, length = x.shape
        window = torch.zeros(int(slots.max()) + 1, length, self.dim, self.kw - 1, dtype=x.dtype, device=self.device)
        parent = torch.empty_like(nxt) if nxt is not None else None
        out = causal_conv1d_update(x, pool, self.weight, self.bias, "silu", conv_state_indices=slots,
                                   intermediate_conv_window=window, intermediate_state_indices=slots,
                                   retrieve_next_token=nxt, retrieve_next_sibling=sib, retrieve_parent_token=parent)
        return out, window, parent

    def recurrence(self, sel: torch.Tensor, rows: int, length: int, pool: torch.Tensor, slots: torch.Tensor,
                   parent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The GDN verify over tokens `sel` (flat indices into this case's tokens), `rows` sequences of
        `length`, each starting from `pool[slots[r]]`."""
        from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import (
            fused_sigmoid_gating_delta_rule_update,
        )

        cache = torch.zeros(int(slots.max()) + 1, length, self.hv, self.dk, self.dv, device=self.device)
        cu = torch.arange(0, rows + 1, device=self.device, dtype=torch.int32) * length
        o = fused_sigmoid_gating_delta_rule_update(
            A_log=self.a_log, a=self.a[sel], dt_bias=self.dt_bias, softplus_beta=1.0, softplus_threshold=20.0,
            q=self.q[:, sel], k=self.k[:, sel], v=self.v[:, sel], b=self.b[sel],
            initial_state_source=pool.clone(), initial_state_indices=slots, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True,
            intermediate_states_buffer=cache, intermediate_state_indices=slots, cache_steps=length,
            retrieve_parent_token=parent)
        return o.reshape(rows, length, self.hv, self.dv), cache

    # ---------------------------------------------------------------- runs
    def tree_mode(self, *, links: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        nxt, sib = links if links is not None else (self.tree.retrive_next_token.to(self.device),
                                                     self.tree.retrive_next_sibling.to(self.device))
        out, window, parent = self.conv(self.x, self.conv_pool, self.slots, nxt, sib)
        sel = torch.arange(self.bs * self.n, device=self.device)
        o, cache = self.recurrence(sel, self.bs, self.n, self.ssm_pool, self.slots, parent)
        return {"conv": out, "window": window[self.slots.long()], "parent": parent, "o": o,
                "state": cache[self.slots.long()]}

    def chain_mode(self) -> dict[str, torch.Tensor]:
        """DFLASH's verify of the same tokens: no tree arrays, node i after node i - 1."""
        out, window, _ = self.conv(self.x, self.conv_pool, self.slots, None, None)
        sel = torch.arange(self.bs * self.n, device=self.device)
        o, cache = self.recurrence(sel, self.bs, self.n, self.ssm_pool, self.slots, None)
        return {"conv": out, "window": window[self.slots.long()], "o": o, "state": cache[self.slots.long()]}

    def per_path(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """Every valid node's root-to-node path as its own one-branch tree (padded to the longest path),
        from a private copy of its request's pool rows; the reference for that node."""
        flat = [(b, v, p) for b, rows in enumerate(self.paths) for v, p in enumerate(rows)]
        length = max(len(p) for _, _, p in flat)
        rows = len(flat)
        idx = torch.zeros(rows, length, dtype=torch.long)
        for r, (b, _, p) in enumerate(flat):
            full = p + [p[-1]] * (length - len(p))  # the tail repeats the node; it is past the branch's end
            idx[r] = torch.tensor([b * self.n + i for i in full])
        idx = idx.to(self.device)
        owner = torch.tensor([b for b, _, _ in flat], device=self.device)
        slots = torch.arange(1, rows + 1, dtype=torch.int32, device=self.device)
        conv_pool = torch.cat([self.conv_pool[:1], self.conv_pool[self.slots.long()[owner]]]).transpose(1, 2)
        conv_pool = conv_pool.contiguous().transpose(1, 2)
        ssm_pool = torch.cat([self.ssm_pool[:1], self.ssm_pool[self.slots.long()[owner]]])
        x = self.x.permute(0, 2, 1).reshape(self.bs * self.n, self.dim)[idx].permute(0, 2, 1).contiguous()
        nxt, sib = chain_links(rows, length, self.device)
        for r, (_, _, p) in enumerate(flat):  # end each branch at its node: the repeated tail hangs off the root
            nxt[r, len(p) - 1] = -1
        out, window, parent = self.conv(x, conv_pool, slots, nxt, sib)
        o, cache = self.recurrence(idx.reshape(-1), rows, length, ssm_pool, slots, parent)
        refs = {}
        for r, (b, v, p) in enumerate(flat):
            last = len(p) - 1
            refs[(b, v)] = {"conv": out[r, :, last], "window": window[r + 1, last], "o": o[r, last],
                            "state": cache[r + 1, last], "parent": p[-2] if len(p) > 1 else 0}
        return refs


def compare(case: Case, got: dict[str, torch.Tensor], refs: dict, *, exact: bool) -> dict[str, Any]:
    """Nodes whose outputs or cached states differ from their path's (bitwise when `exact`)."""
    bad: dict[str, list] = {"conv": [], "window": [], "o": [], "state": [], "parent": []}
    same = (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: torch.allclose(a.float(), b.float(),
                                                                                      rtol=1e-2, atol=1e-2))
    for (b, v), ref in refs.items():
        cells = {"conv": got["conv"][b, :, v], "window": got["window"][b, v], "o": got["o"][b, v],
                 "state": got["state"][b, v]}
        for key, value in cells.items():
            if not same(value, ref[key]):
                bad[key].append([b, v])
        if "parent" in got and int(got["parent"][b, v]) != ref["parent"]:
            bad["parent"].append([b, v, int(got["parent"][b, v]), ref["parent"]])
    return {"nodes": len(refs), **{k: len(v) for k, v in bad.items()}, "first": {k: v[:3] for k, v in bad.items() if v}}


def branching(case: Case) -> bool:
    return any(len({tuple(p[:-1]) for p in rows if len(p) > 1}) > 1 for rows in case.paths)


CASES = (  # name, budget, keep_chain, shrink
    ("budget 15", 15, False, None),
    ("budget 64", 64, False, None),
    ("keep-chain 31", 31, True, None),
    ("64 shrunk to 20, padded", 64, False, 20),
)


def run(device: str, *, batch: int = 3, budgets: tuple[str, ...] = ()) -> dict[str, Any]:
    dev = torch.device(device)
    conv_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict[str, Any] = {"device": device, "conv_dtype": str(conv_dtype), "cases": [], "ok": True}
    for i, (name, budget, keep_chain, shrink) in enumerate(CASES):
        if budgets and name not in budgets:
            continue
        tree = random_trees(100 + i, batch, budget, keep_chain=keep_chain, shrink=shrink)
        case = Case(tree, seed=200 + i, device=dev, conv_dtype=conv_dtype)
        refs = case.per_path()
        tree_vs_path = compare(case, case.tree_mode(), refs, exact=True)
        chain = compare(case, case.chain_mode(), refs, exact=False)
        no_siblings = (tree.retrive_next_token.to(dev), torch.full_like(tree.retrive_next_sibling, -1).to(dev))
        broken = compare(case, case.tree_mode(links=no_siblings), refs, exact=True)
        row = {"case": name, "batch": batch, "width": case.n, "tree_vs_path": tree_vs_path,
               "dflash_chain_vs_path": chain, "siblings_dropped_vs_path": broken, "branching": branching(case)}
        row["ok"] = (all(tree_vs_path[k] == 0 for k in ("conv", "window", "o", "state", "parent"))
                     and (not row["branching"] or (chain["o"] > 0 and broken["o"] > 0 and broken["parent"] > 0)))
        report["ok"] &= row["ok"]
        report["cases"].append(row)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--case", action="append", default=[], help="only these cases (by name)")
    a = p.parse_args()
    report = run(a.device, batch=a.batch, budgets=tuple(a.case))
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
