#!/usr/bin/env python3
"""Tensor-parallel DDTree check (issue 6): the tree built from vocab-sharded draft logits on N ranks
equals the tree built on one device.

    python3 bench/gpu/tp_tree_check.py --nproc 2                 # GPUs 0..N-1, NCCL (H200 x2)
    python3 bench/gpu/tp_tree_check.py --nproc 2 --device cpu    # CPU, gloo (CI, dev venv)

Spawns N processes itself (torch.multiprocessing, spawn). Each rank sets up SGLang's real
distributed state (`init_distributed_environment`, `initialize_model_parallel(tensor_model_parallel_
size=N)`), builds SGLang's real `ParallelLMHead(vocab, hidden)` and loads its shard of one shared
full weight with the layer's own `weight_loader` (the weight is seeded: identical on every rank),
then calls the payload's `DDTreeController.draft_logits(hidden_states, lm_head)` -- the serving
code, which all-gathers the shards with `get_tp_group().all_gather` -- and `build_ddtree` on the
result. On a v2 base (0.5.17's payload: `ddtree_v2_step`, no v1 worker) the serving code checked is the
v2 tree step's `draft_tree_logits` (tests/test_ddtree_worker_v2.py runs it in the 0.5.17 tree). The
reference is `build_ddtree(hs @ W.T)` on the same device without any sharding.

Checks, per case (vocab layout x dtype x seed x batch size {1, 8} x budget {15, 64, 256}):
  * gathered logits: shape [rows, vocab], bitwise equal to the reference logits (values are dyadic
    rationals whose dot products are exact in float32, so no reduction-order noise in any kernel;
    bf16 outputs are then the one rounding of an exact value) and bitwise equal on every rank;
  * trees (token_ids, parents, depths, num_nodes, tree_mask, scores, token_ranks): equal to the
    reference tree and identical on every rank;
  * non-vacuity: every rank's shard holds the vocab slice SGLang's layout promises (padding rows
    beyond the vocab are dropped), and a tree built from one rank's local shard alone differs from
    the reference in some case (so the gather is what makes the trees equal).
Vocab layouts: 151936 (Qwen), 4099 (odd: not divisible by 64 or by the TP size, so the last
shard is padded), and 4099 + 13 added (LoRA-style) entries, which the tree leaves out.
A "gaussian" set (random normal weights, like a real model) is reported too; there only the
cross-rank identity is required, and the tree equality with the reference whenever the logits are
bitwise equal (a last-bit difference between two GEMM shapes is not a TP bug).

Prints one JSON line (`"ok": true|false`) and exits non-zero on any mismatch.
The payload module is the installed one (`sglang.srt.speculative.ddtree_worker`, e.g. the bundle
in /tmp/site); if sglang has no payload installed, the repo's `ddtree_ops/payload` copy is added to
the package path (not with `--require-installed`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAYLOAD_SPEC = REPO / "ddtree_ops" / "payload" / "sglang" / "srt" / "speculative"
BLOCK_SIZE = 16
DEPTH = BLOCK_SIZE - 1
TREE_FIELDS = ("token_ids", "parents", "depths", "num_nodes", "tree_mask", "scores", "token_ranks")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_payload(require_installed: bool) -> tuple[Any, Any, str]:
    """(the serving draft-logits function `(hidden_states [rows, hidden], lm_head, vocab) -> [rows, vocab]`,
    build_ddtree, where it came from). A v2 base (0.5.17's payload: `ddtree_v2_step`, no v1 worker) is checked
    through the v2 tree step's own `draft_tree_logits`, a v1 base through `DDTreeController.draft_logits`."""
    import importlib.util

    import sglang.srt.speculative as spec_pkg

    if importlib.util.find_spec("sglang.srt.speculative.ddtree_v2_step") is not None:
        import torch
        from sglang.srt.distributed import get_tp_group
        from sglang.srt.speculative import ddtree_v2_step as v2

        def draft_logits(hs: Any, head: Any, vocab: int) -> Any:
            # the v2 step drafts from positions 1.. of each request's block: a dummy position 0 in front
            rows = hs.view(-1, DEPTH, hs.shape[-1])
            block = torch.cat([torch.zeros_like(rows[:, :1]), rows], dim=1)
            return v2.draft_tree_logits(block, head, vocab, get_tp_group()).reshape(-1, vocab)

        origin = f"installed v2:{v2.__file__}"
    else:
        try:
            import sglang.srt.speculative.ddtree_worker as dw

            where = "installed"
        except ModuleNotFoundError as e:
            if require_installed or e.name != "sglang.srt.speculative.ddtree_worker":
                raise
            # New modules only (ddtree_worker imports pristine upstream modules and its siblings).
            spec_pkg.__path__.append(str(PAYLOAD_SPEC))
            import sglang.srt.speculative.ddtree_worker as dw

            where = "repo"

        def draft_logits(hs: Any, head: Any, vocab: int) -> Any:
            ctl = object.__new__(dw.DDTreeController)
            ctl.worker = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab)))
            return ctl.draft_logits(hs, head)

        origin = f"{where}:{dw.__file__}"
    from sglang.srt.speculative.ddtree_utils import build_ddtree

    return draft_logits, build_ddtree, origin


def dyadic(gen: Any, shape: tuple[int, ...], denom: int) -> Any:
    """Integers in [-128, 127] / denom: exact in bf16 and float32, exact products and sums."""
    import torch

    return torch.randint(-128, 128, shape, generator=gen).to(torch.float32) / denom


def make_case(kind: str, seed: int, vocab: int, hidden: int, rows: int) -> tuple[Any, Any]:
    """(full weight [vocab, hidden], hidden states [rows, hidden]) in float32 on CPU, same bytes on
    every rank. Dyadic: |hs| <= 8 in steps of 1/16, |W| <= 2 in steps of 1/64, hidden <= 256 ->
    every partial dot product is a multiple of 2^-10 below 2^12: exact in float32 (24-bit)."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * seed + vocab)
    if kind == "dyadic":
        return dyadic(gen, (vocab, hidden), 64), dyadic(gen, (rows, hidden), 16)
    w = torch.randn((vocab, hidden), generator=gen) * 0.5
    return w, torch.randn((rows, hidden), generator=gen)


def tree_tensors(tree: Any) -> dict[str, Any]:
    return {f: getattr(tree, f) for f in TREE_FIELDS}


def trees_equal(a: Any, b: Any) -> list[str]:
    import torch

    ta, tb = tree_tensors(a), tree_tensors(b)
    return [f for f in TREE_FIELDS if not torch.equal(ta[f], tb[f])]


def tensor_digest(t: Any) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def tree_digest(tree: Any) -> str:
    return hashlib.sha256(
        "".join(f"{f}:{tensor_digest(t)};" for f, t in tree_tensors(tree).items()).encode()
    ).hexdigest()[:16]


def rank_main(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    try:
        queue.put(run_rank(rank, args, port))
    except BaseException:  # report, never hang the parent
        queue.put({"rank": rank, "error": traceback.format_exc()[-4000:]})


def run_rank(rank: int, args: argparse.Namespace, port: int) -> dict[str, Any]:
    import torch

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # A CUDA build of torch ships libnccl, so SGLang's PyNcclCommunicator would try a GPU; point
        # it at no library, as on a CPU-only torch (its "missing NCCL library" branch disables it).
        os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl-cpu-check.so"
    torch.manual_seed(0)
    from sglang.srt.distributed import get_tp_group, init_distributed_environment, initialize_model_parallel
    from sglang.srt.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        set_custom_all_reduce,
    )

    # The gather uses NCCL (pynccl) / gloo, never the custom all-reduce; leave its IPC set-up out.
    set_custom_all_reduce(False)
    t0 = time.perf_counter()
    init_distributed_environment(
        world_size=args.nproc,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
        backend=backend,
        timeout=args.dist_timeout,
    )
    initialize_model_parallel(tensor_model_parallel_size=args.nproc)
    assert get_tp_group().world_size == args.nproc and get_tp_group().rank_in_group == rank
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    draft_logits, build_ddtree, payload_origin = import_payload(args.require_installed)
    init_s = time.perf_counter() - t0

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    cases: list[dict[str, Any]] = []
    failures: list[str] = []
    layouts: list[dict[str, Any]] = []
    local_only_differs = 0
    n_trees = 0
    for vocab, added in args.layouts:
        for kind in ("dyadic", "gaussian"):
            for dt_name in args.dtypes:
                dtype = dtypes[dt_name]
                for seed in range(args.seeds):
                    w_full, hs_all = make_case(kind, seed, vocab, args.hidden, max(args.batch_sizes) * DEPTH)
                    with torch.device(device):
                        head = ParallelLMHead(vocab + added, args.hidden, params_dtype=dtype, org_num_embeddings=vocab)
                    # SGLang's own loader: narrows the full [vocab, hidden] weight to this rank's rows.
                    head.weight_loader(head.weight, w_full.to(dtype))
                    si = head.shard_indices
                    if seed == 0 and kind == "dyadic" and dt_name == args.dtypes[0]:
                        layouts.append({
                            "vocab": vocab, "added": added, "weight_rows": int(head.weight.shape[0]),
                            "org_start": int(si.org_vocab_start_index), "org_end": int(si.org_vocab_end_index),
                            "num_org": int(si.num_org_elements), "num_org_padded": int(si.num_org_elements_padded),
                            "added_range": [int(si.added_vocab_start_index), int(si.added_vocab_end_index)],
                        })
                    # The shard really is rows [org_start, org_end) of the full weight.
                    if not torch.equal(head.weight[: si.num_org_elements].cpu(),
                                       w_full[si.org_vocab_start_index : si.org_vocab_end_index].to(dtype)):
                        failures.append(f"rank {rank} vocab {vocab}: shard rows are not the promised slice")
                    w_dev = w_full.to(device=device, dtype=dtype)
                    for bs in args.batch_sizes:
                        label = f"{kind}/{dt_name}/v{vocab}+{added}/seed{seed}/bs{bs}"
                        hs = hs_all[: bs * DEPTH].to(device=device, dtype=dtype)
                        got = draft_logits(hs, head, vocab)
                        ref = torch.matmul(hs, w_dev.T)
                        local = torch.matmul(hs, head.weight[: si.num_org_elements].T)
                        if got.shape != ref.shape:
                            failures.append(f"{label}: gathered shape {tuple(got.shape)} != {tuple(ref.shape)}")
                            continue
                        logits_equal = bool(torch.equal(got, ref))
                        max_diff = float((got.float() - ref.float()).abs().max())
                        if kind == "dyadic" and not logits_equal:
                            failures.append(f"{label}: gathered logits != reference (max |diff| {max_diff:g})")
                        # The rank's own columns of the gathered row are its local matmul, bit for bit.
                        if not torch.equal(got[:, si.org_vocab_start_index : si.org_vocab_end_index], local):
                            failures.append(f"{label}: own columns of the gathered logits != local shard")
                        case: dict[str, Any] = {
                            "label": label, "logits_equal": logits_equal, "max_abs_diff": max_diff,
                            "logits_digest": tensor_digest(got), "trees": {},
                        }
                        for budget in args.budgets:
                            tree = build_ddtree(got.view(bs, DEPTH, -1), budget)
                            rtree = build_ddtree(ref.view(bs, DEPTH, -1), budget)
                            n_trees += 1
                            bad = trees_equal(tree, rtree)
                            if bad and (kind == "dyadic" or logits_equal):
                                failures.append(f"{label}/budget{budget}: tree != reference in {bad}")
                            if args.nproc > 1:  # negative control: this rank's shard alone
                                ltree = build_ddtree(local.view(bs, DEPTH, -1), budget)
                                if not torch.equal(ltree.token_ids + si.org_vocab_start_index, rtree.token_ids):
                                    local_only_differs += 1
                            case["trees"][str(budget)] = {
                                "digest": tree_digest(tree),
                                "equal_to_reference": not bad,
                                "num_nodes": tree.num_nodes.tolist(),
                            }
                        cases.append(case)
                    del head, w_dev
    try:
        tp_world = int(get_tp_group().world_size)
        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as e:  # teardown must not hide the verdict
        failures.append(f"rank {rank}: teardown {type(e).__name__}: {e}")
        tp_world = args.nproc
    return {
        "rank": rank, "device": str(device), "backend": backend, "tp_world": tp_world, "init_s": round(init_s, 2),
        "payload": payload_origin, "failures": failures, "cases": cases, "layouts": layouts,
        "local_only_tree_differs": local_only_differs, "trees": n_trees,
    }


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        v, _, a = item.strip().partition("+")
        out.append((int(v), int(a or 0)))
    return out


def _sglang_version() -> str | None:
    try:
        from sglang.version import __version__

        return str(__version__)
    except ImportError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="TP size = processes spawned (default 2)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL, GPU r; cpu: gloo")
    ap.add_argument("--layouts", type=parse_layouts, default=parse_layouts("151936,4099,4099+13"),
                    help="vocab[+added] list (default 151936,4099,4099+13)")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[15, 64, 256])
    ap.add_argument("--hidden", type=int, default=256, help="<= 256 keeps dyadic dot products exact")
    ap.add_argument("--dist-timeout", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=240, help="seconds to wait for the ranks")
    ap.add_argument("--require-installed", action="store_true",
                    help="use only the payload installed in sglang (no repo fallback)")
    args = ap.parse_args()
    if args.hidden > 256:
        ap.error("--hidden must be <= 256 (exactness bound of the dyadic cases)")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            print(json.dumps({"ok": False, "error": f"needs {args.nproc} GPUs, found {torch.cuda.device_count()}"}))
            return 2

    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + args.timeout
    import queue as queue_mod

    while len(results) < args.nproc and time.monotonic() < deadline:
        try:
            r = queue.get(timeout=1.0)
            results[int(r["rank"])] = r
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()) if len(results) == args.nproc else 1.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)

    failures: list[str] = []
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    for r, e in errors.items():
        failures.append(f"rank {r} raised: {e.strip().splitlines()[-1]}")
    missing = [r for r in range(args.nproc) if r not in results]
    if missing:
        failures.append(f"ranks {missing} gave no result (exit codes {[p.exitcode for p in procs]})")
    good = [results[r] for r in range(args.nproc) if r in results and "error" not in results[r]]
    for res in good:
        failures += [f"rank {res['rank']}: {f}" for f in res["failures"]]
    n_cases = n_trees = 0
    gaussian_logits_equal = gaussian_trees_equal = gaussian_cases = 0
    if len(good) == args.nproc:
        base = good[0]["cases"]
        n_cases = len(base)
        n_trees = good[0]["trees"]
        for res in good[1:]:
            if len(res["cases"]) != n_cases:
                failures.append(f"rank {res['rank']}: {len(res['cases'])} cases, rank 0 had {n_cases}")
                continue
            for a, b in zip(base, res["cases"], strict=True):
                if a["logits_digest"] != b["logits_digest"]:
                    failures.append(f"{a['label']}: gathered logits differ between rank 0 and rank {res['rank']}")
                for budget, ta in a["trees"].items():
                    if ta["digest"] != b["trees"][budget]["digest"]:
                        failures.append(f"{a['label']}/budget{budget}: tree differs between rank 0 and rank {res['rank']}")
        for c in base:
            if c["label"].startswith("gaussian"):
                gaussian_cases += 1
                gaussian_logits_equal += int(c["logits_equal"])
                gaussian_trees_equal += int(all(t["equal_to_reference"] for t in c["trees"].values()))
        if args.nproc > 1 and sum(res["local_only_tree_differs"] for res in good) == 0:
            failures.append("negative control: a tree from one rank's shard alone never differed from the reference")
    summary = {
        "ok": not failures,
        "check": "tp_tree",
        "version": _sglang_version(),
        "nproc": args.nproc,
        "device": args.device,
        "backend": good[0]["backend"] if good else None,
        "payload": good[0]["payload"] if good else None,
        "layouts": {str(res["rank"]): res["layouts"] for res in good},
        "dtypes": args.dtypes,
        "seeds": args.seeds,
        "batch_sizes": args.batch_sizes,
        "budgets": args.budgets,
        "cases": n_cases,
        "trees_per_rank": n_trees,
        "gaussian": {"cases": gaussian_cases, "logits_bitwise_equal": gaussian_logits_equal,
                     "trees_equal": gaussian_trees_equal},
        "local_only_tree_differs": [res["local_only_tree_differs"] for res in good],
        "init_s": [res["init_s"] for res in good],
        "wall_s": round(time.perf_counter() - t0, 2),
        "failures": failures[:20],
        "n_failures": len(failures),
    }
    if errors:
        summary["errors"] = {str(r): e[-1500:] for r, e in errors.items()}
    print(json.dumps(summary))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
