"""bench/gpu/route_ties.py, the float32 oracle for divergences that start in a MoE router's near-tie (issue 25).

A real transformers Qwen3-Next (tiny, CPU, float32) with one router near-tie planted at a prompt row: a candidate
whose expert choice there went the other way (flipped by this test's own router, not the oracle's) agrees with
the reference for three generated tokens and then leaves it, beyond plain's margin (what the margin rule calls a
fault). The oracle must class that divergence a route tie and name the planted router; a tighter threshold than
the planted gap must leave it a fault; and a token no single flip produces (the reference's least likely one)
must stay a fault.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"
SEED, LAYER, ROW, NEW = 2, 0, 14, 6  # a model / router / prompt row whose flip moves a later token (found by search)


def _mods():
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    import make_tiny_hybrid
    import route_ties

    return make_tiny_hybrid, route_ties


def _test_router(gate, row):
    """The router with its k-th and (k+1)-th experts swapped at `row`: written here, apart from the oracle's."""
    import torch
    import torch.nn.functional as F

    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight).clone()
        order = logits[row].argsort(descending=True)
        a, b = int(order[gate.top_k - 1]), int(order[gate.top_k])
        logits[row, [a, b]] = logits[row, [b, a]]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, idx = torch.topk(probs, gate.top_k, dim=-1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), idx

    return forward


def _greedy(model, prompt, n, flip=False):
    import torch

    gate = model.model.layers[LAYER].mlp.gate
    tokens, topk = list(prompt), []
    for _ in range(n):
        if flip:
            gate.forward = _test_router(gate, ROW)
        try:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
        finally:
            gate.__dict__.pop("forward", None)
        v, i = logp.topk(5)
        topk.append([[float(a), int(b)] for a, b in zip(v, i, strict=True)])
        tokens.append(int(logp.argmax()))
    return tokens[len(prompt):], topk, int(logp.argmin())


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    import torch
    from transformers import Qwen3NextForCausalLM

    mth, _ = _mods()
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(mth.next_config(0)).eval()
    with torch.no_grad():  # mixers and experts strong enough that one row's expert choice reaches later rows
        model.lm_head.weight.normal_(0, 0.5)
        model.model.embed_tokens.weight.normal_(0, 0.1)
        for layer in model.model.layers:
            mixer = getattr(layer, "linear_attn", None) or layer.self_attn
            for name, p in mixer.named_parameters():
                if p.dim() == 2 and "conv" not in name:
                    p.normal_(0, 0.1)
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
            layer.mlp.experts.down_proj.normal_(0, 0.1)
    prompt = torch.randint(1, 4096, (24,), generator=torch.Generator().manual_seed(SEED)).tolist()
    seen = {}
    gate = model.model.layers[LAYER].mlp.gate
    hook = gate.register_forward_hook(lambda m, inp, out: seen.update(h=inp[0].reshape(-1, m.hidden_dim)[ROW]))
    with torch.no_grad():
        model(torch.tensor([prompt]))
        hook.remove()
        h = seen["h"]
        logits = gate.weight @ h
        a, b = logits.argsort(descending=True)[gate.top_k - 1: gate.top_k + 1].tolist()
        # plant the tie: expert b's logit at ROW moved to 1e-5 of its terms' magnitude below expert a's
        scale = float((gate.weight[a].abs() * h.abs()).sum() + (gate.weight[b].abs() * h.abs()).sum())
        gate.weight[b] += (logits[a] - logits[b] - 1e-5 * scale) * h / (h @ h)
    out = tmp_path_factory.mktemp("route_ties")
    model.save_pretrained(out / "model")
    ref, ref_topk, least = _greedy(model, prompt, NEW)
    cand, _, _ = _greedy(model, prompt, NEW, flip=True)
    assert cand != ref, "precondition: the planted router's other expert moves a generated token"
    (out / "workload_h.json").write_text(json.dumps({"round1": [{"id": "p0", "prompt": prompt}], "round2": []}))

    def results(tag, ids):
        (out / f"{tag}.json").write_text(json.dumps({"round1": {"p0": {"output_ids": ids, "topk": ref_topk}},
                                                     "round2": {}}))

    results("h_plain", ref)
    results("h_cand", cand)
    d = next(i for i, (x, y) in enumerate(zip(ref, cand, strict=True)) if x != y)
    results("h_bad", ref[:d] + [least] + ref[d + 1:])
    return out


def test_a_divergence_from_a_planted_router_tie_is_named_and_nothing_else_is(planted):
    _, rt = _mods()
    oracle = rt.RouterOracle(str(planted / "model"))
    report = rt.judge(str(planted), oracle, "h_plain", ["h_cand", "h_bad"], None, 2.0**-10)
    (tie,) = report["h_cand"]["divergences"]
    assert tie["class"] == "route tie", tie
    assert (tie["explained_by"]["layer"], tie["explained_by"]["row"]) == (LAYER, ROW)
    assert tie["explained_by"]["rel"] < 2e-5
    assert report["h_cand"]["faults"] == 0
    # the flip routes that row to the first and third experts, everything else as before
    experts = oracle.model.model.layers[LAYER].mlp.experts
    picked = []
    hook = experts.register_forward_pre_hook(lambda m, args: picked.append(args[1].clone()))
    prompt = json.loads((planted / "workload_h.json").read_text())["round1"][0]["prompt"]
    oracle.next_token(prompt)
    logits = oracle.seen[LAYER][0][ROW]
    oracle.next_token(prompt, (LAYER, ROW))
    hook.remove()
    order = logits.argsort(descending=True).tolist()
    assert sorted(picked[1][ROW].tolist()) == sorted([order[0], order[2]])
    assert sorted(picked[0][ROW].tolist()) == sorted(order[:2])
    keep = [r for r in range(len(prompt)) if r != ROW]
    assert (picked[0][keep].sort(-1).values == picked[1][keep].sort(-1).values).all()
    (bad,) = report["h_bad"]["divergences"]  # the least likely token: no single flip makes it the argmax
    assert bad["class"] == "fault" and bad["flips_tried"] >= 1, bad
    # a threshold tighter than the planted gap does not count it as tied
    strict = rt.judge(str(planted), oracle, "h_plain", ["h_cand"], None, 1e-6)
    assert strict["h_cand"]["faults"] == 1 and strict["h_cand"]["divergences"][0]["flips_tried"] == 0


def test_what_upstream_dflash_diverges_on_too_is_upstreams_not_a_fault(planted, monkeypatch, capsys):
    _, rt = _mods()
    # a candidate with upstream's own divergence (no flip explains it), and one with a divergence of its own
    (planted / "h_twin.json").write_text((planted / "h_bad.json").read_text())
    oracle = rt.RouterOracle(str(planted / "model"))
    report = rt.judge(str(planted), oracle, "h_plain", ["h_twin", "h_bad", "h_cand"], "h_bad", 2.0**-10)
    assert [r["class"] for r in report["h_twin"]["divergences"]] == ["upstream"]
    assert report["h_twin"]["faults"] == 0 and report["h_twin"]["upstream"] == 1
    assert report["h_bad"]["reference"] and report["h_bad"]["faults"] == 1
    assert report["h_cand"]["route_ties"] == 1  # upstream does not make the router-tie divergence: still weighed
    argv = ["route_ties.py", str(planted), "--model", str(planted / "model"), "--plain", "h_plain", "--upstream", "h_bad"]
    monkeypatch.setattr("sys.argv", [*argv, "--cand", "h_twin", "h_bad"])
    assert rt.main() == 0  # upstream's own leftover is reported as the reference's, not judged
    assert "reference (diverges beyond a route tie)" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", [*argv[:-2], "--cand", "h_twin", "h_bad"])
    assert rt.main() == 1  # without --upstream the same divergence is a fault


def test_near_ties_measures_the_gap_against_the_terms_magnitude():
    import torch

    _, rt = _mods()
    logits = torch.tensor([[3.0, 1.0, 0.999, -2.0], [3.0, 1.0, 0.5, -2.0]])
    magnitude = torch.full((2, 4), 10.0)
    assert [r for r, _, _ in rt.near_ties(logits, magnitude, 2, 1e-4)] == [0]  # 0.001 / 20 = 5e-5
    assert rt.near_ties(logits, magnitude, 2, 1e-5) == []
    assert [r for r, _, _ in rt.near_ties(logits, magnitude, 2, 0.05)] == [0, 1]
