"""The lab engine's decoding on CPU, in-process: the payload's real ddtree_utils, the lab's real models.

Plain target decoding is the independent oracle: DFLASH, shadow-linear and full must give its greedy
tokens exactly, on random prompts, lengths, stop tokens and batch compositions (seeded); sampled
requests are reproducible from their seed. Accept lengths order as the issue promises, and the
engine's full-mode tokens really come from the ddtree module it is handed.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module
from lab_engine_helpers import first_difference

from ddtree_ops.lab.engine.decoding import Corruption, Decoder, Request
from ddtree_ops.lab.engine.draft import DraftModel
from ddtree_ops.lab.engine.model import TinyLM
from ddtree_ops.lab.engine.model_files import EOS_ID, VOCAB_SIZE, write_models
from ddtree_ops.lab.engine.sampling import Choice

du = load_ddtree_utils()
CONTEXT = 400
MODES = [("plain", False, "off"), ("dflash", True, "off"), ("shadow-linear", True, "shadow-linear"),
         ("full", True, "full")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    write_models(root)
    return SimpleNamespace(root=root, target=TinyLM.load(root / "target"), draft=DraftModel.load(root / "draft"))


def decoder(models, speculative: bool, mode: str, *, budget=None, topk_cap=None, keep_chain=False, draft=None,
            ddtree=du, corruption=None, auto=None, shadow_builds_trees=True) -> Decoder:
    return Decoder(models.target, capacity=CONTEXT + 64, draft=(draft or models.draft) if speculative else None,
                   mode=mode, budget=budget, topk_cap=topk_cap, keep_chain=keep_chain,
                   ddtree=ddtree if mode != "off" else None, corruption=corruption, auto=auto,
                   shadow_builds_trees=shadow_builds_trees)


def make_requests(specs) -> list[Request]:
    return [Request(rid=str(i), input_ids=list(s["prompt"]), choice=s["choice"], max_new_tokens=s["max_new"],
                    stop_token_ids=frozenset(s["stops"]), ignore_eos=s["ignore_eos"], eos_token_id=EOS_ID)
            for i, s in enumerate(specs)]


def serve(dec: Decoder, reqs: list[Request], arrivals: list[int]) -> None:
    """Requests join the running batch at the given step numbers (continuous arrival)."""
    running: list[Request] = []
    pending = sorted(zip(arrivals, range(len(reqs)), strict=True))
    step = 0
    while pending or any(not r.finished for r in running):
        while pending and pending[0][0] <= step:
            r = reqs[pending.pop(0)[1]]
            dec.prefill(r)
            running.append(r)
        dec.step(running)
        step += 1


def random_specs(rng: random.Random, n: int, greedy: bool = True) -> list[dict]:
    specs = []
    for _ in range(n):
        prompt_len = rng.choice([1, 2, rng.randrange(3, 40), rng.randrange(40, 300)])
        max_new = rng.choice([1, 2, rng.randrange(3, 30), rng.randrange(30, 90)])
        max_new = min(max_new, CONTEXT - prompt_len)
        choice = Choice(greedy=True) if greedy else Choice(greedy=False, temperature=rng.choice([0.5, 1.0]),
                                                           top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([1 << 30, 20]),
                                                           seed=rng.randrange(1 << 30))
        specs.append({
            "prompt": [rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)],
            "max_new": max_new,
            "stops": rng.sample(range(3, VOCAB_SIZE), rng.choice([0, 0, 3])),
            "ignore_eos": rng.random() < 0.5,
            "choice": choice,
        })
    return specs


def outputs(models, mode_spec, specs, arrivals, **kw) -> tuple[list[list[int]], list[dict], Decoder]:
    _, speculative, mode = mode_spec
    dec = decoder(models, speculative, mode, **kw)
    reqs = make_requests(specs)
    serve(dec, reqs, arrivals)
    return [r.output_ids for r in reqs], [r.finish_reason for r in reqs], dec


@pytest.mark.parametrize("seed", range(8))
def test_greedy_outputs_identical_across_modes_and_batches(models, seed):
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randrange(3, 9))
    arrivals = [rng.choice([0, 0, rng.randrange(0, 12)]) for _ in specs]
    budget, cap = rng.choice([(None, None), (4, None), (31, 4), (15, 2)])
    want, want_finish, _ = outputs(models, MODES[0], specs, [0] * len(specs))  # plain, all at once
    assert any(f["type"] == "length" for f in want_finish)
    for mode_spec in MODES[1:]:
        got, finish, dec = outputs(models, mode_spec, specs, arrivals, budget=budget, topk_cap=cap)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{mode_spec[0]} request {i}: first difference at output index {first_difference(g, w)}"
        assert finish == want_finish
        if mode_spec[2] == "full":
            assert dec.tree_stats.tree_steps > 0 and dec.tree_stats.fallback_steps == 0


@pytest.mark.parametrize("seed", range(4))
def test_auto_budget_outputs_are_plains(models, seed):
    """--speculative-ddtree-budget auto through the payload's AutoBudget: chain steps and tree steps of every
    candidate budget (exploration every 2nd step), greedy and sampled requests, all plain's tokens."""
    ab = load_payload_module("ddtree_auto_budget")
    rng = random.Random(100 + seed)
    specs = random_specs(rng, rng.randrange(3, 7), greedy=seed % 2 == 0)
    arrivals = [rng.choice([0, 0, rng.randrange(0, 12)]) for _ in specs]
    want, want_finish, _ = outputs(models, MODES[0], specs, [0] * len(specs))
    auto = ab.AutoBudget(ab.auto_candidates(31, 16), capture_bs=[1], max_running=8, explore_every=2, warmup_steps=2,
                         refresh_every=3)
    got, finish, dec = outputs(models, MODES[3], specs, arrivals, budget=31, auto=auto)
    assert got == want and finish == want_finish
    st = dec.tree_stats.internal_state()
    assert st["budget"] == "auto" and st["budget_max"] == 31 and st["chain_steps"] > 0
    assert sum(st["auto"]["verified"].values()) == st["steps"] and set(st["auto"]["verified"]) >= {"chain", "31"}
    assert st["auto"]["accepted_by_budget"]["31"] is not None


def test_stop_token_and_eos_end_a_request_mid_block(models):
    # The greedy path of a fixed prompt, then the same prompt with one of its later tokens as a stop
    # token: every mode stops exactly there, even when the stop token falls inside an accepted block.
    spec = {"prompt": [5, 6, 7], "max_new": 60, "stops": [], "ignore_eos": True, "choice": Choice(greedy=True)}
    (path,), _, _ = outputs(models, MODES[0], [spec], [0])
    stop = path[25]
    first = min(path.index(t) for t in (stop, EOS_ID) if t in path)  # ignore_eos off: EOS stops too
    stopped = {**spec, "stops": [stop], "ignore_eos": False}
    for mode_spec in MODES:
        (got,), (finish,), _ = outputs(models, mode_spec, [stopped], [0])
        assert got == path[: first + 1] and finish == {"type": "stop", "matched": path[first]}, mode_spec[0]
    # ignore_eos also ignores stop_token_ids (SGLang's Req._check_token_based_finish)
    (got,), _, _ = outputs(models, MODES[3], [{**stopped, "ignore_eos": True}], [0])
    assert got == path


def test_sampling_is_reproducible_from_the_seed(models):
    rng = random.Random(11)
    specs = random_specs(rng, 4, greedy=False)
    for s in specs:
        s["max_new"], s["ignore_eos"] = 40, True
    first, _, _ = outputs(models, MODES[1], specs, [0, 0, 0, 0])
    again, _, _ = outputs(models, MODES[1], specs, [0, 2, 1, 0])
    assert first == again
    # the sample is a function of (logits, seed, position): the same in every mode
    for mode_spec in (MODES[0], MODES[3]):
        assert outputs(models, mode_spec, specs, [0, 0, 0, 0])[0] == first
    reseeded = [{**s, "choice": Choice(**{**s["choice"].__dict__, "seed": s["choice"].seed + 1})} for s in specs]
    assert outputs(models, MODES[1], reseeded, [0, 0, 0, 0])[0] != first
    # full mode verifies sampled requests on the tree, like the payload's worker
    _, _, dec = outputs(models, MODES[3], specs, [0, 0, 0, 0])
    st = dec.tree_stats
    assert st.tree_steps == st.steps > 0 and st.fallback_steps == 0 and not st.fallback_reasons
    assert st.sampled_requests == sum(st.accepted_depth_hist.values()) and st.greedy_requests == 0


def accept_lengths(models, max_new: int = 80, **kw) -> dict[str, float]:
    rng = random.Random(5)
    specs = random_specs(rng, 6)
    for s in specs:
        s["max_new"], s["ignore_eos"] = max_new, True
    return {name: outputs(models, (name, spec, mode), specs, [0] * 6, **kw)[2].spec.accept_length
            for name, spec, mode in MODES[1:]}


def test_accept_length_full_beats_linear_which_beats_one(models):
    al = accept_lengths(models)
    assert al["shadow-linear"] == al["dflash"]  # same drafts, same linear verify
    assert al["full"] > al["dflash"] * 1.1 and al["dflash"] > 1.5, al


def test_keep_chain_outputs_identical_and_accepts_at_least_linear(models):
    # A small budget with a narrow cap is where the standard tree can lose the top-1 chain.
    al = accept_lengths(models, budget=15, topk_cap=4, keep_chain=True)
    assert al["shadow-linear"] == al["dflash"] and al["full"] >= al["dflash"], al
    rng = random.Random(21)
    specs = random_specs(rng, 5)
    want, want_finish, _ = outputs(models, MODES[0], specs, [0] * 5)
    got, finish, dec = outputs(models, MODES[3], specs, [0, 1, 0, 3, 2], budget=15, topk_cap=2, keep_chain=True)
    assert got == want and finish == want_finish
    st = dec.tree_stats.internal_state()
    assert st["keep_chain"] is True and st["tree_steps"] > 0


def test_low_acceptance_draft_accepts_nothing(models):
    low = DraftModel(**{**models.draft.__dict__, "low_acceptance": True})
    al = accept_lengths(models, max_new=20, draft=low)
    assert all(v == 1.0 for v in al.values()), al


def test_wrong_tokens_after_n_in_full_mode(models):
    spec = {"prompt": [9, 8, 7, 6], "max_new": 50, "stops": [], "ignore_eos": True, "choice": Choice(greedy=True)}
    (want,), _, _ = outputs(models, MODES[0], [spec], [0])
    (got,), _, _ = outputs(models, MODES[3], [spec], [0], corruption=Corruption(after_tokens=20))
    assert 20 <= first_difference(got, want) < 20 + 16


def test_full_mode_runs_the_walk_it_is_given(models):
    # A payload whose follow_verified_tree takes the bonus token from the root, not the last
    # accepted node: the engine's full-mode outputs change (and no other mode's).
    def altered_walk(tree, target_tokens):
        nodes, lengths, _bonus = du.follow_verified_tree(tree, target_tokens)
        return nodes, lengths, target_tokens.to(torch.int64)[:, 0]

    altered = SimpleNamespace(build_ddtree=du.build_ddtree, follow_verified_tree=altered_walk)
    spec = {"prompt": [3, 4, 5], "max_new": 40, "stops": [], "ignore_eos": True, "choice": Choice(greedy=True)}
    (want,), _, _ = outputs(models, MODES[0], [spec], [0])
    assert outputs(models, MODES[3], [spec], [0])[0] == [want]
    assert outputs(models, MODES[3], [spec], [0], ddtree=altered)[0] != [want]
    assert outputs(models, MODES[2], [spec], [0], ddtree=altered)[0] == [want]


def test_tree_stats_have_the_worker_keys(models):
    # Same keys as the payload worker's DDTreeController.internal_state() (checked against the
    # real class in test_lab_engine_http.py); here: the figures add up.
    spec = {"prompt": [1, 2, 3], "max_new": 30, "stops": [], "ignore_eos": True, "choice": Choice(greedy=True)}
    _, _, dec = outputs(models, MODES[3], [spec], [0])
    st = dec.tree_stats.internal_state()
    assert st["mode"] == "full" and st["budget"] == 15 and st["steps"] == st["tree_steps"] == dec.spec.forward_ct
    assert sum(st["accepted_depth_hist"].values()) == st["steps"] and st["build_samples"] == st["steps"]
    assert st["avg_tree_nodes"] == 16.0 and st["keep_chain"] is False


@pytest.mark.parametrize("builds_trees", [True, False])
def test_shadow_stats_are_the_host_payload_s(models, builds_trees):
    # v1's shadow-linear builds (and measures) the tree it never verifies; a v2 base's worker builds none, so a lab
    # host on 0.5.17 / 0.5.23 reports what a real v2 server reports: steps and depths, no build figures.
    spec = {"prompt": [1, 2, 3], "max_new": 30, "stops": [], "ignore_eos": True, "choice": Choice(greedy=True)}
    (want,), _, _ = outputs(models, MODES[1], [spec], [0])
    (got,), _, dec = outputs(models, MODES[2], [spec], [0], shadow_builds_trees=builds_trees)
    st = dec.tree_stats.internal_state()
    assert got == want and st["mode"] == "shadow-linear" and st["steps"] == dec.spec.forward_ct > 0
    assert sum(st["accepted_depth_hist"].values()) == st["steps"]
    if builds_trees:
        assert st["build_samples"] == st["steps"] and st["avg_tree_nodes"] == 16.0 and st["build_budgets"] == [15]
    else:
        assert st["build_samples"] == 0 and st["avg_tree_nodes"] == 0.0 and st["build_budgets"] == []
