"""The float32 oracle for greedy divergences that start in a MoE router's near-tie (issue 25, HYBRID.md §1.11).

    route_ties.py OUT_DIR --model MODEL_DIR --plain h_plain --cand h_dflash h_full64 ... [--upstream h_dflash]

production_mix.py classes a divergence by plain's top-k margin *at the divergent position*. On a MoE target that
misses one kind of rounding: a router whose k-th and (k+1)-th experts' logits lie within bf16 rounding of each
other picks either expert depending on the GEMM's accumulation order (a verify's 16-row block is not a decode's
one row), and a recurrent layer carries the other expert's output into every later position of that request. The
divergence shows up positions later, where plain's margin is no longer small (mix20 on the trained hybrid pair:
layer 0's router at the row of output token 1, its 2nd and 3rd logits 0.003 apart, moves position 5).

For each divergence production_mix.py does not call the same or a tie, on the tokens both servers share up to it
(the prompt and plain's output before the divergent position), HF transformers in float32:
  1. computes the reference's token there (if it is the candidate's, plain rounded away from float32: the
     divergence is counted with the route ties, its reason saying so);
  2. reads every MoE layer's router logits at every row, and flips, one at a time, each (row, layer) whose k-th and
     (k+1)-th logits differ by at most --rel of their dot products' magnitude (the two experts swap places;
     nothing else changes);
  3. classes the divergence 'route tie' iff some flip makes the reference pick the candidate's token, naming it.
What no flip explains stays a fault (exit 1). With --upstream, a divergence upstream DFLASH makes too is classed
'upstream' (production_mix.py's class), and upstream's own leftovers are reported, not judged. Needs
`transformers` with the target's architecture; CPU is enough for the tiny targets. The deliberately wrong state
commit (h_full64_deepest) is the check that this does not explain everything: its faults must stay faults."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import production_mix  # noqa: E402 - the classifier whose leftovers this judges


def near_ties(router_logits, magnitude, top_k: int, rel: float) -> list[tuple[int, float, float]]:
    """Rows whose k-th and (k+1)-th router logits differ by at most `rel` of their dot products' magnitude
    (sum |w_i h_i| of each): (row, gap, relative gap). Rounding the router's input or the GEMM's terms moves a
    logit by a fraction of that magnitude, so a pair this close can come out either way."""
    import torch

    logits = router_logits.float()
    order = logits.argsort(dim=-1, descending=True)
    rows = torch.arange(order.shape[0])
    a, b = order[:, top_k - 1], order[:, top_k]
    gap = logits[rows, a] - logits[rows, b]
    scale = magnitude[rows, a] + magnitude[rows, b]
    frac = gap / scale.clamp_min(1e-30)
    return [(r, float(gap[r]), float(frac[r])) for r in (frac <= rel).nonzero().flatten().tolist()]


class RouterOracle:
    """An HF MoE model in float32 whose routers can be read and, for one (layer, row), flipped."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.top_k = int(self.model.config.num_experts_per_tok)
        self.routers = {i: layer.mlp.gate for i, layer in enumerate(self.model.model.layers)
                        if hasattr(getattr(layer, "mlp", None), "gate")}
        self.seen: dict[int, tuple] = {}  # layer -> (router logits, |w| . |h| per row and expert)
        self.flip: tuple[int, int] | None = None
        for i, gate in self.routers.items():
            gate.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        torch = self.torch

        def hook(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            if self.flip is None:  # only the unflipped run's routers are read (explain); flipped runs skip the cost
                h = inp[0].detach().reshape(-1, mod.weight.shape[-1]).float()
                self.seen[layer] = (logits.detach(), h.abs() @ mod.weight.detach().float().abs().T)
                return None
            if self.flip[0] != layer:
                return None
            row = self.flip[1]
            order = logits[row].float().argsort(descending=True)
            a, b = int(order[self.top_k - 1]), int(order[self.top_k])
            logits = logits.clone()
            logits[row, a], logits[row, b] = logits[row, b].clone(), logits[row, a].clone()
            if not isinstance(out, tuple):  # a plain linear gate: the block routes from these logits
                return logits
            # a top-k router (transformers 5): (logits, normalised top-k weights, indices), recomputed the way it does
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights, idx = torch.topk(probs, self.top_k, dim=-1)
            if getattr(mod, "norm_topk_prob", True):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return (logits, weights.to(out[1].dtype), idx) + tuple(out[3:])

        return hook

    def next_token(self, tokens: list[int], flip: tuple[int, int] | None = None) -> int:
        self.flip = flip
        try:
            with self.torch.no_grad():
                logits = self.model(self.torch.tensor([tokens])).logits[0, -1]
        finally:
            self.flip = None
        return int(logits.argmax())

    def explain(self, tokens: list[int], cand_tok: int, rel: float) -> dict:
        """Why the reference after `tokens` could pick `cand_tok`: itself, or one router near-tie flipped."""
        ref = self.next_token(tokens)
        seen = dict(self.seen)  # the unflipped run's; flipped runs leave it as it is
        found = {"reference": ref, "flips_tried": 0, "explained_by": None}
        if ref == cand_tok:
            found["explained_by"] = "the float32 reference picks the candidate's token"
            return found
        for layer, (logits, magnitude) in sorted(seen.items()):
            for row, gap, frac in near_ties(logits, magnitude, self.top_k, rel):
                found["flips_tried"] += 1
                if self.next_token(tokens, (layer, row)) == cand_tok:
                    found["explained_by"] = {"layer": layer, "row": row, "gap": round(gap, 5), "rel": float(f"{frac:.3g}")}
                    return found
        return found


def load(out_dir: str, tag: str, suffix: str = "") -> dict | None:
    path = os.path.join(out_dir, f"{tag}{suffix}.json")
    return production_mix._read(path) if os.path.exists(path) else None


def judge(out_dir: str, oracle: RouterOracle, plain_tag: str, cands: list[str], upstream_tag: str | None,
          rel: float, *, suffix: str = "", workload: str | None = None) -> dict:
    with open(workload or os.path.join(out_dir, "workload_h.json")) as f:
        w = json.load(f)
    prompts = {r["id"]: r["prompt"] for rnd in ("round1", "round2") for r in w.get(rnd) or []}
    plain = load(out_dir, plain_tag, suffix)
    upstream = load(out_dir, upstream_tag, suffix) if upstream_tag else None
    if plain is None:
        raise SystemExit(f"{out_dir}: no {plain_tag}{suffix}.json (the plain server's results)")
    report: dict = {}
    for tag in cands:
        cand = load(out_dir, tag, suffix)
        if cand is None:
            report[tag] = {"missing": True}
            continue
        rows = []
        for rid, p, kind, detail in production_mix.judged(plain, cand, upstream if tag != upstream_tag else None):
            if kind in ("same", "tie"):
                continue
            if kind == "upstream":  # upstream DFLASH leaves plain here too: production_mix's class, not the tree's
                rows.append({"id": rid, "class": "upstream", **detail})
                continue
            if "cand_tok" not in detail:  # an error, a finish that differs: nothing for the oracle to weigh
                rows.append({"id": rid, "class": "fault", **detail})
                continue
            pos = detail["pos"]
            why = oracle.explain(prompts[rid] + p["output_ids"][:pos], detail["cand_tok"], rel)
            rows.append({"id": rid, "was": kind, "pos": pos, "prompt_len": len(prompts[rid]),
                         "plain_tok": detail["plain_tok"], "cand_tok": detail["cand_tok"], "gap": detail["gap"],
                         **why, "class": "route tie" if why["explained_by"] else "fault"})
        report[tag] = {"divergences": rows, "faults": sum(r["class"] == "fault" for r in rows),
                       "route_ties": sum(r["class"] == "route tie" for r in rows),
                       "upstream": sum(r["class"] == "upstream" for r in rows),
                       "reference": tag == upstream_tag}
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", required=True, help="the target's HF directory (config.json + weights)")
    ap.add_argument("--plain", required=True)
    ap.add_argument("--cand", nargs="+", required=True)
    ap.add_argument("--upstream", help="upstream DFLASH's tag: what a candidate shares with it is classed 'upstream' "
                    "(not a fault); its own divergences are reported as the reference's, not judged")
    ap.add_argument("--suffix", default="", help="result files are TAG{suffix}.json (production_mix.py's --suffix)")
    ap.add_argument("--workload", help="the workload's JSON (default OUT_DIR/workload_h.json)")
    ap.add_argument("--expect-fault", nargs="*", default=[], help="tags whose faults must survive the oracle")
    ap.add_argument("--rel", type=float, default=2.0**-10,
                    help="a router pair whose logits differ by at most this fraction of their terms' magnitude "
                         "counts as tied (default 2^-10: the plain / verify hidden states differ by ~5e-4 median)")
    a = ap.parse_args()
    report = judge(a.out_dir, RouterOracle(a.model), a.plain, a.cand, a.upstream, a.rel,
                   suffix=a.suffix, workload=a.workload)
    with open(os.path.join(a.out_dir, f"route_ties_{a.plain}{a.suffix}.json"), "w") as f:
        json.dump({"rel": a.rel, "report": report}, f, indent=1)
    bad = False
    for tag, r in report.items():
        if r.get("missing"):
            print(f"{tag:>18}: NO RESULTS")
            bad = True
            continue
        want_fault = tag in a.expect_fault
        ok = r["faults"] > 0 if want_fault else r["faults"] == 0
        if r["reference"]:  # upstream's own divergences are reported, not the payload's to pass (as production_mix)
            verdict = "reference" + ("" if ok else " (diverges beyond a route tie)")
        else:
            bad |= not ok
            verdict = "pass" if ok else "FAIL"
        print(f"{tag:>18}: {verdict} route ties {r['route_ties']}, upstream {r['upstream']}, faults left {r['faults']}"
              + (" (expected some)" if want_fault else ""))
        for row in r["divergences"][:8]:
            print(f"{'':>20}{row['class']}: {row['id']} pos {row.get('pos')} plain {row.get('plain_tok')} "
                  f"cand {row.get('cand_tok')} (plain's gap {row.get('gap')}; {row.get('flips_tried')} flips tried; "
                  f"{row.get('explained_by')})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
