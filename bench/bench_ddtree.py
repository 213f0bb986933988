"""DDTree builder on a GPU: correctness of the Triton path against the torch path, then timings.

    python bench/bench_ddtree.py --out DIR            # the full table (H200: about 3 minutes)
    python bench/bench_ddtree.py --out DIR --quick    # small sizes, for a smoke run
    TRITON_INTERPRET=1 python bench/bench_ddtree.py --out DIR --interpret  # CPU dry run of the checks

Table: batch {1, 8, 32, 64} x budget {16, 64, 256}, depth 15, vocab 151936, bf16 random logits.
Columns (microseconds, ``triton.testing.do_bench`` medians, L2 flushed before each run):
  argmax       ``logits.argmax(-1)``: what linear DFlash pays for its draft
  build        ``build_ddtree`` eager (Triton path: stats pass, row top-K, selection)
  build_graph  the same call replayed from a CUDA graph (how SGLang's graph runner would run it)
  stats/topk/select  the pieces: the one pass over the logits, the whole top-K (stats + row top-K),
               the selection kernel alone
  topk_glue    the first version's top-K (stats kernel + torch ops), for comparison
  torch        the plain torch path on the GPU (DDTREE_DISABLE_TRITON semantics)
  heap         the reference route: log_softmax + torch.topk on the GPU, copy to the CPU, then the
               lazy best-first heap per request in Python (wall clock, median of a few runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ddtree_oracle import heap_oracle_lazy, load_ddtree_utils, tree_tensor_fields  # noqa: E402

du = load_ddtree_utils()
DEPTH = 15
VOCAB = 151936
DEVICE = "cuda"
FIELDS = tree_tensor_fields()


def bench_us(fn) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_logits(
    batch: int, depth: int, vocab: int, kind: str = "gauss", dtype=torch.bfloat16
) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(batch * 1000 + depth + vocab)
    if kind == "ties":
        x = torch.randint(0, 4, (batch, depth, vocab), generator=g, device=DEVICE).float()
    else:
        x = torch.randn(batch, depth, vocab, generator=g, device=DEVICE) * 3.0
    if kind == "inf":
        x = x.masked_fill(torch.rand(x.shape, generator=g, device=DEVICE) < 0.95, float("-inf"))
        x[..., 7] = 0.0
    return x.to(dtype)


def trees_equal(a, b) -> list[str]:
    return [f for f in FIELDS if not torch.equal(getattr(a, f), getattr(b, f))]


def correctness(dk, quick: bool, interpret: bool = False, light: bool = False) -> dict:
    out: dict = {"topk": [], "select": [], "oracle": [], "graph": None}
    vocab_big = 700 if interpret else 20000 if quick else VOCAB
    build = (
        (lambda x, b, c=None: dk.build_ddtree_triton(du, x, b, du._effective_cap(b, x.shape[-1], c)))
        if interpret
        else du.build_ddtree
    )
    shapes = [(8, DEPTH, vocab_big, "gauss", torch.bfloat16), (2, DEPTH, vocab_big, "ties", torch.bfloat16),
              (3, DEPTH, 1000, "inf", torch.float32)]  # fmt: skip
    if interpret:
        shapes = [(s[0], 4, min(s[2], 700), *s[3:]) for s in shapes]
    # (top-K, budget) pairs: few distinct kernel specialisations, since each costs a compile
    pairs = [(1, 16), (4, 16), (16, 16), (4, 64), (64, 64), (2, 63), (256, 256)]
    if interpret:  # the interpreter is slow: keep the dry run to small kernels
        pairs = [(1, 16), (4, 16), (2, 63)]
    if light:
        pairs = [(1, 16), (16, 16), (64, 64), (2, 63), (256, 256)]
        shapes.append((2, DEPTH, vocab_big, "gauss", torch.float16))
    for batch, depth, vocab, kind, dtype in shapes:
        x = make_logits(batch, depth, vocab, kind, dtype)
        for k, budget in pairs:
            k = min(k, vocab)
            ref_v, ref_i = du.topk_logprobs(x, k)
            got_v, got_i = dk.topk_logprobs_triton(du, x, k)
            glue_v, glue_i = dk.topk_logprobs_triton_glue(du, x, k)
            finite = torch.isfinite(ref_v)
            rec = {
                "shape": [batch, depth, vocab], "kind": kind, "dtype": str(dtype), "k": k,
                "index_mismatches": int((ref_i != got_i).sum()),
                "glue_index_mismatches": int((glue_i != got_i).sum()),
                "max_abs_logprob_diff": float((ref_v[finite] - got_v[finite]).abs().max()) if finite.any() else 0.0,
                "inf_pattern_equal": bool(torch.equal(finite, torch.isfinite(got_v))),
            }  # fmt: skip
            rec["ok"] = (
                rec["index_mismatches"] == 0
                and rec["inf_pattern_equal"]
                and rec["max_abs_logprob_diff"] < 1e-4
            )
            out["topk"].append(rec)
            ref = du.select_tree_from_topk(ref_v, ref_i, budget)
            got = dk.select_tree_triton(du, ref_v, ref_i, budget)
            bad = trees_equal(ref, got)
            out["select"].append({"shape": [batch, depth, vocab], "kind": kind, "k": k, "budget": budget,
                                  "mismatched_fields": bad, "ok": not bad})  # fmt: skip
    # end to end against the heap on the CPU (ranks from the torch path's top-K on the CPU)
    # end to end against the reference heap on the CPU, fed the Triton top-K (so that both select
    # from identical log-probs; the top-K itself is checked against the torch path above)
    for budget, cap in ((16, 4), (63, 2)) if interpret else ((64, None), (256, None), (16, 4), (63, 2)):
        x = make_logits(4, 4 if interpret else DEPTH, vocab_big, "gauss")
        tree = build(x, budget, cap)
        k = min(budget if cap is None else cap, budget)
        topv, topi = dk.topk_logprobs_triton(du, x, k)
        topv, topi = topv.cpu(), topi.cpu()
        same = 0
        for b in range(x.shape[0]):
            ref = heap_oracle_lazy(topv[b].tolist(), topi[b].tolist(), budget)
            m = len(ref.parents)
            same += int(
                int(tree.num_nodes[b]) == m
                and tree.token_ids[b, : m - 1].tolist() == ref.tokens
                and tree.parents[b, :m].tolist() == ref.parents
                and tree.scores[b, :m].tolist() == ref.scores
            )
        out["oracle"].append({"budget": budget, "cap": cap, "requests": x.shape[0], "identical_trees": same,
                              "ok": same == x.shape[0]})  # fmt: skip
    if interpret:
        out["ok"] = all(r["ok"] for key in ("topk", "select", "oracle") for r in out[key])
        return out
    # CUDA graph replay equals eager
    x = make_logits(8 if quick else 64, DEPTH, vocab_big, "gauss")
    eager = du.build_ddtree(x, 64)
    graph, static = capture(lambda: du.build_ddtree(x, 64))
    graph.replay()
    torch.cuda.synchronize()
    bad = trees_equal(eager, static)
    out["graph"] = {"mismatched_fields": bad, "ok": not bad}
    out["ok"] = all(r["ok"] for key in ("topk", "select", "oracle") for r in out[key]) and out["graph"]["ok"]
    return out


def capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def sweep_warps(dk) -> dict:
    """Time the two latency-bound kernels at several num_warps (batch 64), check each variant against
    the torch path, and install the fastest correct one in the kernels' tables for the main table."""
    result: dict = {"select": {}, "topk": {}}
    x = make_logits(64, DEPTH, VOCAB, "gauss")
    for budget in (16, 64, 256):
        ref_v, ref_i = du.topk_logprobs(x, budget)
        ref = du.select_tree_from_topk(ref_v, ref_i, budget)
        block_k = triton_next_pow2(budget)
        tile = block_k * dk.SUB
        best = None
        for warps in (2, 4, 8) if tile <= 1024 else (4, 8, 16):
            dk.TOPK_WARPS[tile] = warps
            try:
                got_v, got_i = dk.topk_logprobs_triton(du, x, budget)
                ok = bool(torch.equal(got_i, ref_i))
                us = bench_us(lambda budget=budget: dk.topk_logprobs_triton(du, x, budget))
            except Exception as exc:  # a variant that does not build is skipped, not fatal
                print("variant failed", warps, repr(exc)[:300])
                ok, us = False, float("nan")
            result["topk"][f"{budget}/{warps}"] = {"us": us, "ok": ok}
            print(
                json.dumps({"sweep": "topk", "budget": budget, "warps": warps, "us": round(us, 1), "ok": ok})
            )
            if ok and (best is None or us < best[0]):
                best = (us, warps)
        if best is None:
            dk.TOPK_WARPS.pop(tile, None)
        else:
            dk.TOPK_WARPS[tile] = best[1]
        pairs = dk._pairs_i32(du, budget, budget, x.device)[0].numel()
        size = max(triton_next_pow2(pairs), triton_next_pow2(DEPTH * budget))
        best = None
        for warps in (1, 2, 4) if size <= 1024 else (2, 4, 8):
            dk.SELECT_WARPS[size] = warps
            try:
                got = dk.select_tree_triton(du, ref_v, ref_i, budget)
                ok = not trees_equal(ref, got)
                us = bench_us(lambda v=ref_v, i=ref_i, b=budget: dk.select_tree_triton(du, v, i, b))
            except Exception as exc:
                print("variant failed", warps, repr(exc)[:300])
                ok, us = False, float("nan")
            result["select"][f"{budget}/{warps}"] = {"us": us, "ok": ok}
            print(
                json.dumps(
                    {"sweep": "select", "budget": budget, "warps": warps, "us": round(us, 1), "ok": ok}
                )
            )
            if ok and (best is None or us < best[0]):
                best = (us, warps)
        if best is None:
            dk.SELECT_WARPS.pop(size, None)
        else:
            dk.SELECT_WARPS[size] = best[1]
    result["chosen"] = {"TOPK_WARPS": dict(dk.TOPK_WARPS), "SELECT_WARPS": dict(dk.SELECT_WARPS)}
    print(json.dumps(result["chosen"]), flush=True)
    return result


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heap_reference(logits: torch.Tensor, budget: int) -> None:
    k = min(budget, logits.shape[-1])
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = torch.topk(lp, k, dim=-1)
    v, i = v.cpu().tolist(), i.cpu().tolist()  # the device-to-host copy is part of the reference's cost
    for b in range(len(v)):
        heap_oracle_lazy(v[b], i[b], budget)


def wall_median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def timings(dk, quick: bool, deadline: float) -> list[dict]:
    rows = []
    batches = [8, 1] if quick else [64, 32, 8, 1]  # the goal configurations first
    budgets = [16, 64] if quick else [16, 64, 256]
    vocab = 20000 if quick else VOCAB
    for batch in batches:
        x = make_logits(batch, DEPTH, vocab, "gauss")
        argmax = bench_us(lambda x=x: x.argmax(-1))
        for budget in budgets:
            k = min(budget, vocab)
            r = {"batch": batch, "budget": budget, "argmax_us": argmax}
            r["build_us"] = bench_us(lambda x=x, budget=budget: du.build_ddtree(x, budget))
            graph, _ = capture(lambda x=x, budget=budget: du.build_ddtree(x, budget))
            r["build_graph_us"] = bench_us(graph.replay)
            del graph
            r["stats_us"] = bench_us(lambda x=x: dk._row_stats(x))
            r["topk_us"] = bench_us(lambda x=x, k=k: dk.topk_logprobs_triton(du, x, k))
            topv, topi = dk.topk_logprobs_triton(du, x, k)
            r["select_us"] = bench_us(
                lambda v=topv, i=topi, budget=budget: dk.select_tree_triton(du, v, i, budget)
            )
            spare = time.time() < deadline  # the comparison columns go first when time runs short
            nan = float("nan")
            r["topk_glue_us"] = (
                bench_us(lambda x=x, k=k: dk.topk_logprobs_triton_glue(du, x, k)) if spare else nan
            )
            r["torch_us"] = (
                bench_us(
                    lambda x=x, budget=budget, k=k: du.select_tree_from_topk(*du.topk_logprobs(x, k), budget)
                )
                if spare
                else nan
            )
            heap_reference(x, budget)  # warm-up
            r["heap_us"] = wall_median_us(lambda x=x, budget=budget: heap_reference(x, budget), 3)
            r["graph_over_argmax"] = r["build_graph_us"] / argmax
            r["eager_over_argmax"] = r["build_us"] / argmax
            r["heap_over_graph"] = r["heap_us"] / r["build_graph_us"]
            r["heap_over_eager"] = r["heap_us"] / r["build_us"]
            rows.append(r)
            print(
                json.dumps({k2: round(v, 2) if isinstance(v, float) else v for k2, v in r.items()}),
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| batch | budget | argmax | build (eager) | build (graph) | graph/argmax | stats | topk | select "
        "| topk glue | torch path | heap ref | heap/graph | heap/eager |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['batch']} | {r['budget']} | {r['argmax_us']:.0f} | {r['build_us']:.0f} | {r['build_graph_us']:.0f} "
        f"| {r['graph_over_argmax']:.2f}x | {r['stats_us']:.0f} | {r['topk_us']:.0f} | {r['select_us']:.0f} "
        f"| {r['topk_glue_us']:.0f} | {r['torch_us']:.0f} | {r['heap_us']:.0f} | {r['heap_over_graph']:.0f}x "
        f"| {r['heap_over_eager']:.0f}x |"
        for r in sorted(rows, key=lambda r: (r["batch"], r["budget"]))
    ]
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sweep", action="store_true", help="skip the num_warps sweep")
    parser.add_argument(
        "--light-checks", action="store_true", help="fewer correctness cases (fewer compiles)"
    )
    parser.add_argument(
        "--spare-s", type=float, default=200.0, help="after this, skip the comparison columns"
    )
    parser.add_argument(
        "--interpret", action="store_true", help="CPU dry run of the checks (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    global DEVICE
    if args.interpret:
        DEVICE = "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    dk = du._kernels()
    assert dk is not None, "Triton kernels did not load"
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": "cpu (interpreter)" if args.interpret else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(env), flush=True)
    t0 = time.time()
    check = correctness(dk, args.quick, args.interpret, args.light_checks)
    check["seconds"] = round(time.time() - t0, 1)
    (out / "ddtree_check.json").write_text(json.dumps(check, indent=1))
    failed = [r for key in ("topk", "select", "oracle") for r in check[key] if not r["ok"]]
    print(json.dumps({"correct": check["ok"], "graph": check["graph"], "failed": failed[:10],
                      "checks": sum(len(check[k]) for k in ("topk", "select", "oracle")),
                      "seconds": check["seconds"]}), flush=True)  # fmt: skip
    if args.interpret:
        return
    sweep = None if args.quick or args.no_sweep else sweep_warps(dk)
    rows = timings(dk, args.quick, t0 + args.spare_s)
    (out / "ddtree_bench.json").write_text(json.dumps({"env": env, "sweep": sweep, "rows": rows}, indent=1))
    md = table(rows)
    (out / "ddtree_bench.md").write_text(json.dumps(env) + "\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
