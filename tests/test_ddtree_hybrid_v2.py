"""The v2 tree step on hybrid (Gated DeltaNet) targets, SGLang 0.5.17 (`bases/0.5.17/.../ddtree_v2_hybrid.py`, its calls
in `ddtree_worker_v2.py`, the two kernel patches): the 0.5.17 bundle built against the real wheel and installed over
it, then, on the CPU, in that tree (tests/sglang_scripts/v2_hybrid_cases.py says what runs for real and which
stand-ins it uses):
- the refusals (no switch: the step is served): only Gated DeltaNet on an architecture proven on this worker (Qwen3.5
  dense and MoE; Qwen3-Next, proven on v1, only under the unproven-hybrid test switch), the radix cache off (on only
  under that switch: its tracking is CPU-proven only), the settings the step was read against;
- the hooks answer upstream's answers until the worker activates them, and then: tree mode on the target's GDN
  backend only, dense per-node conv windows, the memory plan at `1 + budget` (against its closed form), a chain for
  upstream's linear step (eager and graph replay); SGLang's own `MambaPool` then keeps `1 + budget` dense states,
  which the worker's start check accepts (and refuses without the hooks);
- the committed index is each request's last accepted node (an independent walk; its state equals the recurrence
  over the committed tokens), where DFLASH's chain rule and the test faults miss; the tracked index is the node at
  the crossed multiple of the track interval on that path (v1's scalar rule; its state, by hand);
- whole tree steps of the worker on a stateful stand-in hybrid target emit plain decoding's tokens, and do not with
  a wrong commit (chain, deepest, skip) or without the tree arrays; with the radix cache's tracking every crossed
  multiple `T` leaves the state after `T` tokens in the track slot, which 0.5.17's own rule and unmapped offsets miss;
- SGLang 0.5.17's own GDN verify kernels, patched, under Triton's interpreter (bench/gpu/hybrid_kernels_check.py):
  every node equals its path bit for bit, the committed node continues the path, and the deduplicated window layout
  (what the dense-window hook prevents) corrupts the tree's windows.
Skipped when the wheel, or xgrammar / tvm_ffi, cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from tests.test_payload_v2 import extra_path, run_in_site, site_report

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "sglang_scripts" / "v2_hybrid_cases.py"
KERNELS = HERE.parent / "bench" / "gpu" / "hybrid_kernels_check.py"
BASE = "0.5.17"
KERNEL_FILES = ["sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py",
                "sglang/kernels/ops/mamba/causal_conv1d_triton.py"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> B.BuildResult:
    extra_path("xgrammar", "tvm_ffi")  # skips early when they cannot be had
    try:
        wheel = B.download_wheel("sglang", BASE)
    except B.BundleError as e:
        pytest.skip(f"no sglang {BASE} wheel available: {e}")
    return B.build_bundle(None, tmp_path_factory.mktemp("dist"), wheel=wheel, base=BASE,
                          build_time="2026-01-01T00:00:00Z")


@pytest.fixture(scope="module")
def site(built: B.BuildResult, tmp_path_factory) -> Path:
    """The wheel unpacked with the 0.5.17 bundle installed over it (the patches applied by the bundle's applier)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(B.download_wheel("sglang", BASE)) as z:
        z.extractall(site, members=[n for n in z.namelist() if n.startswith("sglang")])
    B.install_bundle(built.bundle_path, site)
    return site


def _cases(site: Path, env_add: dict[str, str]) -> dict:
    return site_report(site, SCRIPT, env_add, version=BASE)


@pytest.fixture(scope="module")
def observed(site: Path) -> dict:
    return _cases(site, {})  # served without any switch (0.5.17: ddtree_v2_args.PROVEN_TREE_BASES)


def test_the_bundle_patches_the_tree_kernels_and_ships_the_hybrid_glue(built: B.BuildResult, site: Path) -> None:
    m = built.manifest
    assert sorted(f.path for f in m.patched_files) == sorted(["sglang/srt/server_args.py", *KERNEL_FILES])
    names = {Path(f.path).name for f in m.new_files}
    assert {"ddtree_v2_hybrid.py", "ddtree_hybrid.py", "ddtree_hybrid_state.py", "ddtree_worker_v2.py"} <= names
    for rel in KERNEL_FILES:
        assert "DDTree (ddtree-ops payload)" in (site / rel).read_text(), rel


def test_hybrid_targets_are_served_where_proven_and_refused_by_name_elsewhere(observed: dict) -> None:
    r = observed["refusals"]
    # every GDN architecture v1 proves, Qwen3-Next included (its deepest-commit check ran on this worker), and the
    # radix cache with `extra_buffer` tracking (its GPU run passed): served without a switch
    assert r["good"] is None and r["good moe"] is None and r["unproven allowed"] is None, r
    assert r["qwen3-next"] is None and r["radix tracked"] is None, r
    assert r["v2_refusal"] is None and r["v2_refusal dense"] is None  # the worker's check, no switch
    for name, words in {"mamba2": "Gated DeltaNet layers only", "unproven": "qwen3.6",
                        "radix": "--mamba-radix-cache-strategy extra_buffer (got None)",
                        "verify backend": "--linear-attn-verify-backend",
                        "decode backend": "--linear-attn-decode-backend", "replayssm": "--enable-linear-replayssm",
                        "replayssm spec": "--enable-linear-replayssm-spec", "unified": "--enable-unified-memory",
                        "page major": "--enable-page-major-kv-layout"}.items():
        assert r[name] and words in r[name], (name, r[name])
    assert "qwen3-next" in r["unproven"].split("proofs cover")[1], r["unproven"]  # offered as proven


def test_the_target_kind_comes_from_sglangs_own_configs(observed: dict) -> None:
    assert observed["kinds"] == {"qwen3-next": ["gated-deltanet", "qwen3-next"], "nemotron-h": [None, None]}


def test_the_hooks_answer_upstreams_answers_until_activated(observed: dict) -> None:
    h = observed["hooks"]
    for phase in ("installed_inactive", "deactivated"):
        assert h[phase] == h["pristine"], phase
    p = h["pristine"]
    assert p["dedup"] is True  # upstream would deduplicate DFLASH's windows
    assert set(p["topk"].values()) == {1}
    assert p["metadata"]["eager_linear"].startswith("AttributeError")  # tree mode alone breaks the linear step
    assert p["metadata"]["replay_linear"] == "previous tree"  # ... and a graph replay keeps the last tree
    a = h["active"]
    assert a["dedup"] is False
    assert a["topk"] == {"gdn": 2, "gdn_draft": 1, "mamba2": 1, "mamba2_draft": 1}  # the target's GDN backend only
    assert a["metadata"] == {"eager_linear": "none", "eager_tree": True, "replay_tree": True, "replay_linear": "chain"}


def test_the_memory_plan_counts_the_tree_width(observed: dict) -> None:
    h = observed["hooks"]
    oracle = h["plan_oracle"]
    for phase, width in (("pristine", "block"), ("active", "tree")):
        for branch in ("radix_off", "auto_fit"):
            got = h[phase]["plan"][branch]
            rest, size = oracle[width][branch]
            assert got["rest"] == pytest.approx(rest, abs=1e-9) and got["max_mamba_cache_size"] == size, (phase, got)
            assert got["block_after"] == 4  # the spec bag's block is its own again after the plan
    assert h["active"]["plan"]["auto_fit"]["max_mamba_cache_size"] < h["pristine"]["plan"]["auto_fit"][
        "max_mamba_cache_size"]  # a wider tree: fewer request slots, not an allocation failure


def test_sglangs_mamba_pool_keeps_dense_tree_wide_states_only_with_the_hooks(observed: dict) -> None:
    pool = observed["mamba_pool"]
    off, on = pool["inactive"], pool["active"]
    assert off["ssm"] == on["ssm"] == [3, 4, 8, 4, 16, 16]  # layers, requests + 1, 1 + budget, heads, state
    assert off["window"] == on["window"] == [3, 4, 8, 128, 3]
    assert not off["dense"] and "deduplicated" in off["start"]  # the start check refuses the chain layout
    assert on["dense"] and on["start"] is None
    assert "not 1 + budget = 9" in on["wider"]  # a tree wider than the pool's states is refused at start


def test_the_committed_index_is_the_last_accepted_node(observed: dict) -> None:
    idx = observed["index"]
    assert idx["bad"] == [] and idx["requests"] > 100
    assert idx["off_chain"] > idx["requests"] // 3  # paths that are not nodes 0, 1, 2, ...
    # the test's power: DFLASH's chain rule misses exactly those; the faults miss too
    assert idx["wrong"]["dflash_rule"] == idx["wrong"]["chain"] == idx["off_chain"]
    assert idx["wrong"]["deepest"] > 0 and idx["wrong"]["skip"] == idx["requests"]


def test_the_tracked_index_is_the_node_at_the_crossed_multiple_on_the_path(observed: dict) -> None:
    idx = observed["index"]
    assert idx["bad"] == [] and idx["crossings"] > 50, idx
    # the faults track nothing (deepest, skip) or follow DFLASH's chain (chain): each misses
    assert idx["track_wrong"]["deepest"] == idx["track_wrong"]["skip"] == idx["crossings"], idx
    assert idx["track_wrong"]["chain"] > 0, idx


def test_tree_steps_keep_the_crossed_state_for_the_radix_cache(observed: dict) -> None:
    for run in observed["decode_tracked"]:
        assert run["plain"] and run["track_bad"] == [], run
        assert run["crossings"] > 0 and run["tracked"] == run["crossings"], run  # one state per crossing, no more
    upstream = observed["decode_tracked_faults"]["upstream"]  # 0.5.17's own rule: nothing tracked
    assert all(r["tracked"] == 0 and r["track_bad"] for r in upstream), upstream
    assert any(r["track_bad"] for r in observed["decode_tracked_faults"]["unmapped"])
    assert not any(r["tracked"] for r in observed["decode"])  # a batch that does not track writes no track slot


def test_tree_steps_on_a_hybrid_target_emit_plain_decoding(observed: dict) -> None:
    for run in observed["decode"]:
        assert run["plain"] and run["arrays_sent"] and run["commits"] == run["steps"], run
        assert run["tokens"] > run["steps"] and run["deep"] > 0 and run["off_chain"] > 0, run
        assert run["report"]["tree_steps"] == run["steps"], run
        assert run["report"]["hybrid"]["linear_backend"] == "GDNAttnBackend", run  # /server_info names the layers
    for fault, runs in observed["decode_faults"].items():
        assert not any(r["plain"] for r in runs), fault
    assert not any(r["plain"] or r["arrays_sent"] for r in observed["decode_no_arrays"])


def test_the_patched_kernels_follow_ddtree_parents_and_need_dense_windows(site: Path) -> None:
    proc = run_in_site(site, [str(KERNELS), "--device", "cpu", "--batch", "2", "--case", "budget 15",
                       "--case", "64 shrunk to 20, padded", "--dedup-windows"], {"TRITON_INTERPRET": "1"}, timeout=900)
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert [c["case"] for c in report["cases"]] == ["budget 15", "64 shrunk to 20, padded"]
    for case in report["cases"]:
        exact = case["tree_vs_path"]
        assert all(exact[k] == 0 for k in ("conv", "window", "o", "state", "parent")), case
        assert case["branching"] and case["dflash_chain_vs_path"]["o"] > 0, case
        commit = case["commit"]
        assert commit["accepted_conv"] and commit["accepted_o"], commit
        for wrong in ("dflash_index", "deepest_node"):
            assert commit[wrong]["requests_with_another_node"] > 0 and commit[wrong]["continued_anyway"] == 0, commit
        dedup = case["dedup_windows_vs_path"]  # outputs right, the committed windows wrong
        assert dedup["window"] > 0 and all(dedup[k] == 0 for k in ("conv", "o", "state")), dedup
    assert report["ok"] and proc.returncode == 0, proc.stderr[-2000:]
