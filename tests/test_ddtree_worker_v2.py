"""The DDTree tree step for the v2 DFLASH worker of SGLang 0.5.17 and 0.5.23 (each base's adapter
`bases/<base>/.../ddtree_worker_v2.py` over the shared `ddtree_v2_step.py`) against each real wheel, on the CPU,
every case on both bases (`base`): the module imports and subclasses the real `DFlashWorkerV2` with the signatures it
relies on; its pure pieces (the verify input: tokens, positions `prefix + depth`, the custom mask in the layout the
triton backend indexes, the reserved-row slots) match independent oracles on random trees, a chain giving DFLASH's
causal mask; `create_worker` returns it only under full mode with the proof switch; the out-of-scope settings are
refused naming their flag; and whole decode steps run on stand-ins for the models (greedy = plain greedy decoding
of a made-up target; the segment permuted in place; the draft-KV plan; a logit bias applied; a sampled row); over
many steps with random frequency / presence / repetition / min_new_tokens / logit-bias settings the greedy outputs,
and the logits at every committed node bit for bit, equal plain greedy decoding driven through SGLang's own
penalizers, and five deliberately broken variants are caught.
`/server_info`'s `ddtree`: a run of steps on one worker (made by its `__init__`) fills v1's counters as the steps'
own results say; the real `Scheduler.get_internal_state`, hooked by `load_plugins`, carries them (and nothing for
upstream's worker) through the scheduler's IPC encoding; promote's settings gate judges that answer as it judges v1's.
Upstream's linear decode steps (fallbacks, auto's chain) run eagerly where SGLang's verify graphs are at the block's
width (a budget of block - 1): those graphs read the custom-mask buffer, which holds the last tree's mask.
0.5.23 only: the verify's and the draft's KV plans (`KVLocPlan`, through a real pass-through translator), its own
refusals (DP attention, the draft checkpoint's selector / LiLiCorr / Domino heads, id-translating pools), its
min_new_tokens rule (the request's `eos_token_ids` banned too), and decode batches asking for logprobs or sampling
masks handed to upstream's linear step (0.5.17 refuses logprobs).
Nothing here runs a GPU kernel, a CUDA graph or a model (tests/sglang_scripts/v2_worker_cases.py says which
stand-ins it uses). Skipped when the wheel, or xgrammar / tvm_ffi, cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

import ast
import collections
import json
import shutil
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from ddtree_ops import gates, rollout
from tests.test_payload_v2 import run_in_site, site_report, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_worker_cases.py"
BASES = ("0.5.17", "0.5.23")  # every base with a tree step (ddtree_v2_args.TREE_STEP_BASES)
SWITCHES = {"SGLANG_DDTREE_TEST_V2_TREE": "1", "SGLANG_DDTREE_ALLOW_TEST_SWITCHES": "1"}

pytestmark = pytest.mark.slow


def payload_site(base: str, tmp_path_factory) -> Path:
    """SGLang `base`'s wheel unpacked, that base's payload modules of `sglang/srt/speculative/` beside upstream's."""
    site = wheel_site(base, tmp_path_factory)
    for rel, src in B.payload_sources(base=base).items():
        if rel.endswith(".py") and "/speculative/" in rel:
            shutil.copyfile(src, site / rel)
    return site


@pytest.fixture(scope="module", params=BASES)
def base(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def base_site(base: str, tmp_path_factory) -> Path:
    return payload_site(base, tmp_path_factory)


def _run(site: Path, switches: dict[str, str], base: str) -> dict:
    return site_report(site, SCRIPT, switches, version=base, timeout=300)


@pytest.fixture(scope="module")
def observed(base_site: Path, base: str) -> dict:
    return _run(base_site, SWITCHES, base)


def test_imports_and_subclasses_the_real_worker(observed: dict) -> None:
    assert observed["contracts"] == dict.fromkeys(observed["contracts"], True), observed["contracts"]
    assert observed["triton_layout"] == {"indptr": True, "row": True}


def test_verify_input_matches_the_oracles_and_a_chain_is_causal(observed: dict) -> None:
    got = observed["verify_inputs"]
    assert got["bad"] == []
    assert got["chains_causal"] == 10  # every chain trial (1 in 4 of 40) gave exactly DFLASH's causal mask


def test_small_pieces(observed: dict) -> None:
    small = observed["small"]
    assert small["draft_logits"]
    assert small["sharded_draft_logits"]  # the TP gather v1 serves with (ddtree_ranks.vocab_logits), on v2's shapes
    assert small["sampled_rows"] == [1, 2]  # top_k 40 and "all"; top_k 1 is greedy
    assert small["bounds"] == [[7, 9], 8, [20, 30], 42]  # exact from the host's lengths; else the reservation
    assert small["no_bounds"]


def test_create_worker_picks_the_tree_worker_only_in_full_mode(base_site: Path, base: str, observed: dict) -> None:
    """Shadow-linear gets the counting shadow worker on every v2 server (ddtree_v2_shadow); full the tree worker
    where it is served (0.5.17) or under the proof switch (0.5.23); EAGLE its own."""
    assert observed["selection"] == {"registered": True, "state_hook": True, "full": "DDTreeWorkerV2",
                                     "shadow": "DDTreeShadowWorkerV2", "eagle_full": "EAGLEWorkerV2"}
    plain = _run(base_site, {}, base)  # no proof switch: 0.5.23's DFLASH keeps its own worker (refused at parsing)
    full = "DDTreeWorkerV2" if base == "0.5.17" else "DFlashWorkerV2"
    assert plain["selection"] == {"registered": True, "state_hook": True, "full": full,
                                  "shadow": "DDTreeShadowWorkerV2", "eagle_full": "EAGLEWorkerV2"}


def test_out_of_scope_settings_are_refused_naming_the_flag(observed: dict, base: str) -> None:
    r = observed["refusals"]
    assert r["good"] is None
    assert r["auto"] is None  # served without a switch since its GPU proof on 0.5.17 (test_auto_*: how)
    for name, words in {"overlap": "--disable-overlap-schedule",
                        "flashinfer": "--attention-backend triton", "backend unset": "--attention-backend triton",
                        "decode fa3": "--decode-attention-backend fa3", "page": "--page-size 1",
                        "tp": "--tp-size 1", "pp": "--pp-size 1", "window": "--speculative-draft-window-size",
                        # 0.5.17 serves the proven Gated DeltaNet hybrids (ddtree_v2_hybrid); 0.5.23 none
                        "hybrid": "Gated DeltaNet layers only" if base == "0.5.17" else "non-hybrid",
                        "simulated": "SGLANG_SIMULATE_ACC_LEN",
                        "init": "--disable-overlap-schedule"}.items():
        assert r[name] and words in r[name], (name, r[name])
    assert r["tp under switch"] is None and "--pp-size 1" in r["pp under switch"]  # the TP proof's own servers
    assert not r["seams_after_refusal"]  # refused before the seams turn on
    # the built target backend: triton's extend kernel only; never a chain-only verify kernel (ROCm gfx95)
    assert r["backend triton"] is None
    assert "needs the triton target backend, got SimpleNamespace" in r["backend other"]
    for case, switch in {"backend split-kv": "use_verify_splitkv", "backend hybrid split-kv": "use_verify_splitkv",
                         "backend shared-kv": "use_verify_shared_kv"}.items():
        assert switch in r[case] and "SGLANG_ENABLE_SPLITKV_VERIFY=0" in r[case], (case, r[case])
    assert r["chain-only switches upstream sets"] == (["use_verify_splitkv", "use_verify_shared_kv"]
                                                       if base == "0.5.23" else ["use_verify_splitkv"])
    assert f"SGLang {base}'s v2 worker" in r["overlap"]  # a refusal names the base it was made on
    assert r["head bf16"] is None and r["head fp32"] is None
    for case, words in {"head fp8": "stored as torch.float8_e4m3fn", "head int8": "stored as torch.int8",
                        "head vector": "no weight matrix", "head qweight only": "no weight matrix",
                        "no head": "(NoneType) has no weight matrix",
                        "start with fp8 head": "stored as torch.float8_e4m3fn"}.items():
        assert r[case] and words in r[case] and "--speculative-ddtree-mode off" in r[case], (case, r[case])
    if base == "0.5.23":  # its own: DP attention; the draft checkpoint's heads and id-translating pools
        assert "--attn-dp-size 1" in r["dp attention"]
        assert "candidate selector / Domino head" in r["draft heads"] and r["no draft heads"] is None
        assert "target KV pool that translates slot ids" in r["pool"] and r["no pool"] is None


def _common(step: dict, base: str, width: int = 8) -> None:
    """What every tree step's result and verify input must be; `width`: its verify tokens per request (1 + budget,
    or under auto the captured width its tree pads to)."""
    lens = step["lens"]
    assert all(1 <= n <= 4 for n in lens)
    assert step["new_seq_lens"] == step["published"] == step["prefix_plus"]
    assert step["stride"] == 4 and step["verify_width"] == width  # the block, and the verify's width
    assert step["next_class"] == "DDTreeDraftInputV2" and step["bonus_is_last"]
    assert step["slots_permuted_in_place"] and step["kv_plan"]
    assert step["host_seq_lens"] == [5 + width, 9 + width, 2 + width]  # prefix + width: the verify's host bound
    assert step["mask_cells"] == width * (16 + 3 * width)  # n * (sum of prefixes + bs * n)
    # 0.5.23: the verify planned over its own window (the tree's slots, read extent n), the draft the block's
    assert step["kv_plans"] is (True if base == "0.5.23" else None)
    assert step["runner_restored"]  # after the verify the target's runner is SGLang's own set again


def test_greedy_decode_steps_emit_plain_greedy_tokens(observed: dict, base: str) -> None:
    for step in observed["steps"]:
        _common(step, base)
        assert step["greedy"] and step["lens"] == step["walked"], step
    assert {n for step in observed["steps"] for n in step["lens"]} == {1, 2, 3, 4}  # short and full paths


def test_sampled_steps_apply_the_logit_bias_and_walk_sampled_rows(observed: dict, base: str) -> None:
    for step in observed["sampled_steps"]:
        _common(step, base)
        assert step["biased"], step  # request 0's bias forces token 0 at every node
        assert step["lens"][2] == step["walked"][2]  # the greedy request is unaffected by its neighbours


# --- /server_info ddtree: the stats of a run of steps, through the scheduler, judged by the settings gate ----------


def _expected_stats(run: dict) -> dict:
    """What the steps' own results say the worker must report (v1's counting rules), computed here."""
    lens, sampled, graph, linear = run["lens"], run["sampled"], run["graph"], run["linear_lens"]
    depths = collections.Counter(n - 1 for step in lens for n in step) + collections.Counter(n - 1 for n in linear)
    requests = sum(len(step) for step in lens)
    n_sampled = sum(sampled)  # the sampled steps' batch: request 1 samples, requests 0 and 2 are greedy
    return {
        "steps": len(lens) + 1, "tree_steps": len(lens), "fallback_steps": 1, "fallback_reasons": {"grammar": 1},
        "requests_sum_nodes": 1.0 + 7,  # every tree holds its full budget (3 depths x 11 tokens > 7), root included
        "greedy_requests": requests - n_sampled, "sampled_requests": n_sampled,
        "logit_adjusted_steps": n_sampled,  # the sampled steps carry request 0's logit bias; greedy ones no sampling info
        "graph_steps": sum(graph) + 1,  # the grammar step's upstream result says it ran on a graph
        "accepted_depth_hist": {str(k): v for k, v in sorted(depths.items())},
        "avg_accepted_depth": round(sum(k * v for k, v in depths.items()) / sum(depths.values()), 4),
    }


def test_tree_steps_fill_the_stats_v1_reports(observed: dict) -> None:
    run = observed["stats"]
    state = run["state"]["ddtree"]
    want = _expected_stats(run)
    assert {n for step in run["lens"] for n in step} >= {1, 4}  # short and full paths both counted
    for key in ("steps", "tree_steps", "fallback_steps", "fallback_reasons", "greedy_requests", "sampled_requests",
                "logit_adjusted_steps", "graph_steps", "accepted_depth_hist", "avg_accepted_depth"):
        assert state[key] == want[key], (key, state[key], want[key])
    assert state["avg_tree_nodes"] == want["requests_sum_nodes"]
    assert (state["shrunk_steps"], state["padded_steps"], state["chain_steps"]) == (0, 0, 0)
    # the worker's settings, read from its server args by __init__, under v1's names
    assert {k: state[k] for k in ("mode", "budget", "budget_max", "topk_cap", "keep_chain", "auto", "build_budgets",
                                  "verify_graph_width", "verify_graph_max_bs")} == {
        "mode": "full", "budget": 7, "budget_max": None, "topk_cap": 4, "keep_chain": True, "auto": None,
        "build_budgets": [7], "verify_graph_width": 8, "verify_graph_max_bs": 16}
    assert run["no_keep_chain"] is False
    # counted on the device while stepping (tree sizes, accepted depths), nothing on the host
    assert run["on_device"] == {"nodes": True, "depths": True, "host_hist": {}}


def test_the_v2_report_has_the_v1_keys(observed: dict) -> None:
    """Same keys as v1's DDTreeController.internal_state(), which the lab engine's report matches (checked against
    the real v1 class in test_lab_engine_http.py)."""
    from ddtree_ops.lab.engine.decoding import TreeStats

    assert sorted(observed["stats"]["state"]["ddtree"]) == sorted(TreeStats("full", 7, None).internal_state())


def test_scheduler_reports_ddtree_only_for_the_tree_worker(observed: dict) -> None:
    run = observed["stats"]
    assert "ddtree" in run["state"] and run["state"]["avg_spec_accept_length"] == 2.5  # upstream's keys kept
    assert "ddtree" not in run["dflash"] and "avg_spec_accept_length" in run["dflash"]  # upstream's DFLASH worker
    assert "ddtree" not in run["none"] and "last_gen_throughput" in run["none"]  # no speculative worker


def test_settings_gate_judges_the_v2_report_as_v1s(observed: dict, tmp_path: Path) -> None:
    """promote's settings gate on a /server_info carrying the scheduler's answer: pass for matching settings, fail
    when the tree worker does not run keep-chain as the unit asked, inconclusive without a `ddtree` (v1's verdicts)."""
    from tests.test_rollout import _info_server, _inv

    run = observed["stats"]
    host = _inv(tmp_path, 1, draft_block_size=4, ddtree_budget=7, ddtree_topk_cap=4,
                ddtree_keep_chain=True).hosts["h1"]
    expect = rollout.expected_settings(host, "full")
    server = {"speculative_algorithm": "DFLASH", "speculative_ddtree_mode": "full", "speculative_ddtree_budget": 7,
              "speculative_ddtree_topk_cap": 4, "speculative_ddtree_keep_chain": True}

    def verdict(state: dict) -> gates.GateVerdict:
        with _info_server({**server, "internal_states": [state]}) as client:
            return gates.settings_gate(client, expect)

    assert verdict(run["state"]).verdict == "pass"
    wrong = {**run["state"], "ddtree": {**run["state"]["ddtree"], "keep_chain": run["no_keep_chain"]}}
    failed = verdict(wrong)
    assert failed.verdict == "fail" and "keep_chain=False" in failed.reason
    assert verdict(run["dflash"]).verdict == "inconclusive"


def _bench_phases() -> tuple[str, ...]:
    """`bench/gpu/auto_bench.py`'s `PHASES` (the script imports its siblings by path: read, not imported)."""
    tree = ast.parse((Path(__file__).parents[1] / "bench" / "gpu" / "auto_bench.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["PHASES"])


def test_profiled_steps_report_v1s_phases(observed: dict) -> None:
    """SGLANG_DDTREE_PROFILE=1: `/server_info`'s `ddtree.profile` has v1's phase names (what auto_bench's compare
    prints), one sample per tree step, the scheduler's gap between consecutive decode steps, upstream's linear step as
    one `step_start->step_done` (prefill and idle batches unmarked, as on v1); it is reset by its read; off without the
    switch."""
    phases = _bench_phases()
    run = observed["profile"]
    assert run["greedy"]  # the marks change no token
    profile = run["profile"]
    assert sorted(profile) == sorted([*phases, "step_start->step_done"])
    assert {k: v["n"] for k, v in profile.items()} == {**{k: 3 for k in phases}, "step_start->step_done": 1}
    assert not run["cuda"] and all(v["gpu_ms"] is None and v["cpu_ms"] >= 0 for v in profile.values())
    assert run["again"] == {}
    assert run["off"] and run["off_report"] is None


def test_penalties_at_every_node_are_plain_decodings(observed: dict) -> None:
    """Issue 26: 6 x 24 tree steps of 4 requests (request 0 unpenalised, the others random), against plain greedy
    decoding of the made-up target through SGLang's real `BatchedPenalizerOrchestrator`, `SamplingBatchInfo` and
    `ScheduleBatch.cumulate_penalty_output_tokens`; the step sees a real `copy_for_forward` of a sampling info
    whose orchestrator never counted a token (as under spec decoding)."""
    pen = observed["penalties"]
    assert pen["order"] == pen["oracle_order"] and pen["display_as_upstream"]  # plain's order in this process
    runs = pen["runs"]
    for run in [*runs, pen["neutral"]]:
        assert run["match"] and run["bad_count"] == 0, run["bad"]
        assert run["exact_nodes"] == run["tokens"] > 300  # every committed token's logits compared bit for bit
    total = {k: sum(r[k] for r in runs) for k in ("changed", "banned", "bias_changed", "deep_penalised",
                                                   "penalised_tokens")}
    assert total["changed"] >= 0.2 * total["penalised_tokens"], total  # the penalties decide the token often
    assert total["banned"] >= 30 and total["bias_changed"] >= 30, total  # min_new_tokens bans, the bias decides
    assert total["deep_penalised"] >= 500, total  # penalised tokens committed below the root: paths count
    # nothing penalised: the per-node code never runs (no host read), the bias still applies
    assert pen["neutral_calls"] == 0 and pen["neutral"]["bias_changed"] > 0
    controls = pen["controls"]
    for name in ("upstream_only", "paths_ignored", "min_new_skipped"):
        assert controls[name]["runs_differing"] >= 5, (name, controls[name])
    for name in ("bias_twice", "order_reversed", "req_eos_flipped"):
        assert controls[name]["runs_differing"] >= 2 and controls[name]["logits_differing"] > 100, controls[name]


def test_a_logprob_batch_is_refused_on_0517_and_upstreams_on_0523(observed: dict, base: str) -> None:
    """0.5.17's upstream refuses logprobs, and so does the tree step; 0.5.23's upstream serves them (chain rows),
    so the tree step hands such a batch to upstream's linear step and counts a fallback; the same for a batch
    asking for sampling masks (0.5.23 only)."""
    got = observed["logprob"]
    if base == "0.5.23":
        assert got == {"handed": 2, "error": None, "reasons": {"logprob": 1, "sampling_mask": 1},
                       "fallback_steps": 2, "tree_steps": 0}
    else:
        assert got["handed"] == 0 and "return_logprob" in got["error"] and got["fallback_steps"] == 0


# --- --speculative-ddtree-budget auto ---------------------------------------------------------------------------


def test_auto_tree_picks_emit_plain_greedy_tokens(observed: dict, base: str) -> None:
    """Auto's tree picks run the tree step on the verify-graph ladder the worker captured at start (widths 4 and 8:
    the smaller candidate's and SGLang's own), each tree at the smallest captured width that holds it, on that width's
    runner for the verify and only for it, and emit plain greedy decoding's tokens; its chain picks emit the stubbed
    linear step's, on SGLang's own set (never the block-width tree graph, whose mask buffer holds the last tree). Every
    tree is the largest one's build replayed from its build graph (a CUDA graph's contract on CPU, `RerunGraph`)."""
    run = observed["auto"]
    assert run["started"]  # AutoBudget made by the worker's own init_cuda_graphs
    assert run["ladder"] == {"widths": [4, 8], "sglang_set_kept": True, "captured": {"4": 4, "8": 8}}
    trees = [step for step in run["steps"] if not step.get("chain")]
    assert trees and all(step["greedy"] for step in run["steps"])
    assert {step["verify_width"] for step in trees} == {4, 8}  # both candidates picked, each at its own width
    assert run["smaller"] == 3
    for step in trees + run["held"] + run["padded"]:
        _common(step, base, step["verify_width"])
        assert step["lens"] == step["walked"], step
        assert step["planned_on"] == step["replayed_on"] == step["verify_width"]  # that width's graphs
        assert max(step["nodes"]) <= step["verify_width"]
    assert {max(step["nodes"]) for step in trees if step["verify_width"] == 8} >= {8}  # the largest tree, 1 + 7 nodes
    assert all(step["verify_width"] == 4 for step in run["held"])  # budget 3: its own captured width, no padding
    # budget 2 (3 verify tokens) pads to the smallest captured width that holds it: 4, not the seams' 8
    assert all(step["verify_width"] == 4 and max(step["nodes"]) <= 3 for step in run["padded"])
    assert all(step["untouched"] and step["runner_restored"] for step in run["steps"] if step.get("chain"))
    assert run["chain_runner_widths"] and set(run["chain_runner_widths"]) == {8}
    assert any("verify graphs at widths [4, 8] captured" in line for line in run["log"]), run["log"]
    # every tree above was built by replaying the largest tree's build graph of its batch (3 requests: bucket 4)
    assert run["build_graphs"] == {"bs": [1, 2, 4, 8, 16], "steps": len(trees) + len(run["held"]) + len(run["padded"])}
    assert any("build graphs captured for budgets [7] at bs [1, 2, 4, 8, 16]" in line for line in run["log"])
    assert any("each tree verifies on the graphs of the smallest of widths [4, 8]" in line for line in run["log"])
    # the kernels' start-up check covers auto's smaller tree, own width and padded to each candidate width (as v1's),
    # and the v2 commit's and bounded mask's kernels against the torch commit
    assert run["self_tests"] == [{"device": "cuda", "budget": 7, "smaller": [3], "pad_widths": [4, 8],
                                  "acceptance": True, "commit": "commit_tree"}]


def test_auto_chain_picks_go_through_upstreams_linear_step(observed: dict) -> None:
    """The chain candidate is upstream's linear DFLASH step: each chain pick called it once and is counted a chain
    step, not a fallback; the grammar batch's fallback is observed as a chain step too (v1 observes its fallbacks)."""
    run = observed["auto"]
    state = run["state"]["ddtree"]
    chosen, verified = state["auto"]["chosen"], state["auto"]["verified"]
    chains = sum(bool(step.get("chain")) for step in run["steps"])
    assert chains >= 1 and chosen["chain"] == chains == len(run["linear_calls"]) == state["chain_steps"]
    assert state["fallback_steps"] == 1 and state["fallback_reasons"] == {"grammar": 1}
    assert verified["chain"] == chains + 1
    assert state["tree_steps"] == len(run["steps"]) - chains + len(run["held"]) + len(run["padded"])
    assert state["steps"] == len(run["steps"]) + len(run["held"]) + len(run["padded"]) + 1
    assert verified.get("3", 0) >= len(run["held"])
    # a step is observed when the next one starts (or `/server_info` is read), so none waits for its own device work:
    # after the last step through the dispatch its observation was still pending; the next batches settled it, and
    # the state read the grammar fallback's (the padded steps call the tree step itself: auto neither chose nor
    # observes them)
    dispatched = len(run["steps"]) + len(run["held"])
    assert run["before_state"] == {"pending": True, "observed": dispatched - 1}
    assert sum(verified.values()) == dispatched + 1


def test_auto_reports_its_plan_in_the_ddtree_state(observed: dict) -> None:
    """`/server_info`'s ddtree under auto, through the scheduler: v1's settings (budget auto, its maximum) and auto's
    own report (candidates, chosen, plan per batch bucket, refreshes), with more than one candidate chosen; the
    ladder's widths in its start-up replay timings (`replay_ms`, width x batch size, as v1 reports them)."""
    state = observed["auto"]["state"]["ddtree"]
    assert (state["budget"], state["budget_max"]) == ("auto", 7)
    auto = state["auto"]
    assert auto["candidates"] == ["chain", "3", "7"]
    assert sum(1 for n in auto["chosen"].values() if n) >= 2 and auto["chosen"]["7"] >= 16  # warm-up: the largest
    assert sorted(auto["plan"], key=int) == ["1", "2", "4", "8", "16"]  # the graph runner's capture_bs
    assert set(auto["plan"].values()) <= set(auto["candidates"])
    assert auto["refreshes"] >= 4 and auto["explore_steps"] >= 1
    assert set(auto["accepted_by_budget"]) == {"chain", "3", "7"}
    # seeded from the ladder's replays (the stand-in's seconds: width x bs x 1 us)
    assert auto["replay_ms"] == {f"{w}x{bs}": round(w * bs * 1e-3, 4) for w in (4, 8) for bs in (1, 2, 4, 8, 16)}
    assert state["verify_graph_width"] == 8  # SGLang's own set, installed between tree verifies


def test_auto_without_its_ladder_pads_to_the_one_set(observed: dict, base: str) -> None:
    """A ladder capture that fails (here the width-4 set) is a warning, not a server that does not start: auto goes
    on with SGLang's one set, every tree padded to its width (8) as before the ladder, no start-up replay timings,
    and the greedy outputs are still plain decoding's."""
    run = observed["auto_failed"]
    assert run["started"] and run["ladder"] is None
    assert any(line.startswith("WARNING: DDTree v2 auto: verify graphs at widths [4, 8] not captured")
               and "failed (stand-in)" in line for line in run["log"]), run["log"]
    trees = [step for step in run["steps"] if not step.get("chain")]
    assert trees and all(step["greedy"] for step in run["steps"])
    for step in trees + run["held"] + run["padded"]:
        _common(step, base)  # width 8
        assert step["lens"] == step["walked"], step
        assert step["planned_on"] == step["replayed_on"] == 8
    assert all(max(step["nodes"]) <= 4 for step in run["held"]) and all(max(step["nodes"]) <= 3 for step in run["padded"])
    assert run["state"]["ddtree"]["auto"]["replay_ms"] == {}


def test_upstreams_linear_steps_run_eagerly_on_block_wide_verify_graphs(observed: dict, base: str) -> None:
    """SGLang's verify graphs are captured by the seams at `1 + budget` reading the custom-mask buffer; upstream's
    linear verify carries no mask, so graphs at the block's width (a budget of block - 1: the default, or auto's
    largest) would replay it over the last tree's mask. There upstream's linear decode steps (a grammar fallback, on
    0.5.23 a logprob one, auto's chain) see no graph runner, and SGLang's is back after each, also when the step
    raises; prefill and idle batches keep it; a budget of 7 (graphs at width 8, which refuse the block-wide linear
    verify on their own) changes nothing."""
    run = observed["eager_linear"]
    linear = ["grammar", "grammar raising"] + (["logprob"] if base == "0.5.23" else [])
    for name, budget in (("default", 3), ("budget 7", 7), ("auto", 3)):  # block 4
        case = run[name]
        assert (case["budget"], case["width"]) == (budget, budget + 1), (name, case)
        steps = case["steps"]
        assert all(step["restored"] for step in steps.values()), (name, steps)
        assert steps["prefill"]["saw"] == steps["idle"]["saw"] == "sglang", (name, steps)
        assert "failed (stand-in)" in steps["grammar raising"]["raised"], (name, steps)
        assert sorted(steps) == sorted(["prefill", "idle", *linear, *(["chain"] if name == "auto" else [])])
        hidden = "sglang" if name == "budget 7" else "none"
        assert all(steps[n]["saw"] == hidden for n in linear + (["chain"] if name == "auto" else [])), (name, steps)
    auto = run["auto"]
    assert auto["ladder"] == [4] and auto["state"]["chain_steps"] == 1
    assert auto["state"]["fallback_reasons"] == {"grammar": 1, **({"logprob": 1} if base == "0.5.23" else {})}
    assert any("upstream's linear steps (fallbacks, auto's chain) run eagerly" in line for line in auto["log"])


def test_tp2_sharded_draft_logits_build_the_single_device_tree_on_v2(base: str, base_site: Path) -> None:
    """bench/gpu/tp_tree_check.py in the base's tree, two gloo ranks in SGLang's real distributed state and real
    `ParallelLMHead` shards: the v2 tree step's own `draft_tree_logits` gathers the vocab shards, and both ranks build
    the tree one device builds from the unsharded logits (what --tp-size 2 under SGLANG_DDTREE_TEST_V2_TP rests on)."""
    if base != "0.5.17":  # the TP proof's GPU base; 0.5.23 builds its groups from a runtime topology context
        pytest.skip(f"{base}: initialize_model_parallel reads runtime_context.get_parallel(), which the check does "
                    "not set up; the GPU TP proof runs on 0.5.17, the newest base the GPU carry runs")
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "tp_tree_check.py"
    proc = run_in_site(base_site, [str(script), "--nproc", "2", "--device", "cpu", "--seeds", "1",
                                   "--layouts", "4099,4099+13", "--timeout", "200", "--require-installed"],
                       {"OMP_NUM_THREADS": "1"}, timeout=260)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON summary (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert summary["ok"] and proc.returncode == 0, json.dumps(summary, indent=1)[:4000]
    assert summary["version"] == base and summary["payload"].startswith("installed v2:")
    assert summary["backend"] == "gloo" and summary["nproc"] == 2
    assert summary["cases"] == 16 and summary["trees_per_rank"] == 48  # 2 layouts x 2 kinds x 2 dtypes x 2 bs, 3 budgets
    assert all(n > 0 for n in summary["local_only_tree_differs"])  # the gather is what makes the trees equal
