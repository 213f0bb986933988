"""The real payload in a real sglang 0.5.13.post1 tree (a copy of the dev venv's), on CPU:
files the payload does not touch stay byte-identical to RECORD; SGLang's own `prepare_server_args`
accepts the DDTree flags and refuses every bad combination with the promised message; the DDTree
verify bookkeeping and the worker guards behave (fake batch, CPU tensors).

Each subprocess imports sglang (~8 s), so the cases are batched into two subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from tests.payload_helpers import BASE_VERSION, copy_sglang_tree, venv_site

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "sglang_scripts"
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
DRAFT_CONFIG = {
    **QWEN3_CONFIG,
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 1,
    "block_size": 16,
    "dflash_config": {"block_size": 16, "target_layer_ids": [1, 2], "mask_token_id": 7},
}


# A tiny Qwen3-Next (Gated DeltaNet + attention, bench/gpu/make_tiny_hybrid.py's shape) and a Jamba
# (Mamba): full mode's hybrid table serves the first only under the proof's switch, refuses the second.
GDN_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 4096, "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "torch_dtype": "bfloat16",
}
# The same layers under a class no GPU proof has served (a Qwen3.6 MoE name on Qwen3.5-MoE's config, which SGLang
# parses): full mode unproven
GDN_UNPROVEN_CONFIG = {**GDN_CONFIG, "architectures": ["Qwen3_6MoeForCausalLM"], "model_type": "qwen3_5_moe_text"}
# (Jamba: Mamba layers SGLang's argument checks let through to ours; its Nemotron-H is refused by SGLang
# itself for the triton backend.)
MAMBA2_CONFIG = {**QWEN3_CONFIG, "architectures": ["JambaForCausalLM"], "model_type": "jamba",
                 "mamba_d_state": 16, "mamba_d_conv": 4, "attn_layer_period": 4, "attn_layer_offset": 1,
                 "expert_layer_period": 2, "expert_layer_offset": 1}


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    root = tmp_path_factory.mktemp("patched")
    built = B.build_bundle(None, root / "dist", site_dir=venv_site())
    site = copy_sglang_tree(root / "site")
    manifest = B.install_bundle(built.bundle_path, site)
    models = root / "models"
    for name, cfg in (("target", QWEN3_CONFIG), ("draft", DRAFT_CONFIG), ("gdn", GDN_CONFIG),
                      ("gdn_unproven", GDN_UNPROVEN_CONFIG), ("mamba2", MAMBA2_CONFIG)):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text(json.dumps(cfg))
    return site, manifest, models


def _run(site: Path, *argv: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    missing = [ln for ln in proc.stderr.splitlines() if "ModuleNotFoundError" in ln]
    assert not missing, (
        f"{missing[-1]}: an sglang dependency is missing from this venv "
        "(add it to scripts/sglang-cpu-requirements.txt)"
    )
    return proc


def test_untouched_files_byte_identical_to_record(patched):
    site, manifest, _ = patched
    patched_paths = [f.path for f in manifest.patched_files]
    bad = [b for b in B.check_tree_against_record(site, "sglang", BASE_VERSION, ignore=patched_paths)
           if b.startswith("sglang/")]
    assert bad == []
    for f in manifest.patched_files + manifest.new_files:
        assert B.sha256_hex((site / f.path).read_bytes()) == f.sha256, f.path
    # and the patched files really differ from pristine: the check above is not vacuous
    assert len(B.check_tree_against_record(site, "sglang", BASE_VERSION)) >= len(patched_paths)


def _cases(models: Path) -> tuple[list[dict], dict[str, object]]:
    base = ["--model-path", str(models / "target"), "--device", "cpu"]
    df = [*base, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(models / "draft"),
          "--speculative-num-draft-tokens", "16"]
    full = [*df, "--attention-backend", "triton", "--speculative-ddtree-mode", "full"]
    gdn_full = [*full, "--model-path", str(models / "gdn")]
    gdn_unproven_full = [*full, "--model-path", str(models / "gdn_unproven")]
    mamba2_full = [*full, "--model-path", str(models / "mamba2")]
    good = {
        "plain": base,
        "dflash only": df,
        "shadow default budget": [*df, "--speculative-ddtree-mode", "shadow-linear"],
        "full 64 cap 4": [*full, "--speculative-ddtree-budget", "64", "--speculative-ddtree-topk-cap", "4"],
        "full edges": [*full, "--speculative-ddtree-budget", "512", "--speculative-ddtree-topk-cap", "512"],
        "full budget 1": [*full, "--speculative-ddtree-budget", "1", "--speculative-ddtree-topk-cap", "1"],
        "mode case-insensitive": [*df, "--speculative-ddtree-mode", "Shadow-Linear"],
        "keep chain default budget": [*df, "--speculative-ddtree-mode", "shadow-linear",
                                      "--speculative-ddtree-keep-chain"],
        "full keep chain 64": [*full, "--speculative-ddtree-budget", "64", "--speculative-ddtree-keep-chain"],
        "keep chain budget = depth": [*full, "--speculative-ddtree-budget", "15", "--speculative-ddtree-keep-chain"],
        "full auto": [*full, "--speculative-ddtree-budget", "auto"],
        "full auto max 63 keep chain": [*full, "--speculative-ddtree-budget", "AUTO", "--speculative-ddtree-budget-max",
                                        "63", "--speculative-ddtree-keep-chain"],
        "shadow auto": [*df, "--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget", "auto"],
    }
    bad = {
        "mode without DFLASH": ([*base, "--speculative-ddtree-mode", "full"],
                                "--speculative-ddtree-mode requires --speculative-algorithm DFLASH"),
        "budget without DFLASH": ([*base, "--speculative-ddtree-budget", "8"],
                                  "--speculative-ddtree-budget requires --speculative-algorithm DFLASH"),
        "allow flag without DFLASH": ([*base, "--speculative-ddtree-allow-hybrid-unsafe"],
                                      "requires --speculative-algorithm DFLASH"),
        "budget with mode off": ([*df, "--speculative-ddtree-budget", "8"],
                                 "--speculative-ddtree-budget has no effect with --speculative-ddtree-mode off"),
        "bad mode": ([*df, "--speculative-ddtree-mode", "tree"],
                     "--speculative-ddtree-mode must be one of off, shadow-linear, full; got 'tree'"),
        "budget 0": ([*full, "--speculative-ddtree-budget", "0"], "--speculative-ddtree-budget must be in 1..512"),
        "budget 513": ([*full, "--speculative-ddtree-budget", "513"], "--speculative-ddtree-budget must be in 1..512"),
        "budget not int": ([*full, "--speculative-ddtree-budget", "many"],
                           "--speculative-ddtree-budget must be in 1..512 (non-root tree nodes) or auto, got 'many'"),
        "budget max without auto": ([*full, "--speculative-ddtree-budget", "64", "--speculative-ddtree-budget-max", "64"],
                                    "--speculative-ddtree-budget-max is the largest budget of --speculative-ddtree-budget "
                                    "auto"),
        "auto max 513": ([*full, "--speculative-ddtree-budget", "auto", "--speculative-ddtree-budget-max", "513"],
                         "--speculative-ddtree-budget-max must be in 1..512"),
        "auto cap above max": ([*full, "--speculative-ddtree-budget", "auto", "--speculative-ddtree-budget-max", "31",
                                "--speculative-ddtree-topk-cap", "32"],
                               "--speculative-ddtree-topk-cap must be in 1..31 (1..--speculative-ddtree-budget-max)"),
        "auto keep chain max below depth": ([*full, "--speculative-ddtree-budget", "auto",
                                             "--speculative-ddtree-budget-max", "7", "--speculative-ddtree-keep-chain"],
                                            "--speculative-ddtree-keep-chain needs --speculative-ddtree-budget-max >= "
                                            "the draft depth 15"),
        "cap 0": ([*full, "--speculative-ddtree-topk-cap", "0"], "--speculative-ddtree-topk-cap must be in 1..15"),
        "cap above budget": ([*full, "--speculative-ddtree-budget", "64", "--speculative-ddtree-topk-cap", "65"],
                             "--speculative-ddtree-topk-cap must be in 1..64"),
        "allow flag with shadow": ([*df, "--speculative-ddtree-mode", "shadow-linear",
                                    "--speculative-ddtree-allow-hybrid-unsafe"],
                                   "--speculative-ddtree-allow-hybrid-unsafe is refused"),
        "allow flag with full": ([*full, "--speculative-ddtree-allow-hybrid-unsafe"],
                                 "--speculative-ddtree-allow-hybrid-unsafe is refused: full mode on a hybrid"),
        # hybrids at argument parsing, before any pool exists (bench/gpu/HYBRID.md §3.4)
        "full on GDN, unproven": ([*gdn_unproven_full, "--disable-radix-cache"],
                                  "layer type gated-deltanet on qwen3.6-moe: SGLang's GDN tree kernels follow "
                                  "DDTree's parents"),
        "full on Mamba": ([*mamba2_full, "--disable-radix-cache"],
                            "have no tree-verify support in DDTree"),
        "full on flashinfer": ([*df, "--speculative-ddtree-mode", "full", "--attention-backend", "flashinfer"],
                               "supported: triton; got --attention-backend flashinfer"),
        "full on paged KV": ([*full, "--page-size", "16"], "--speculative-ddtree-mode full needs --page-size 1"),
        "keep chain without DFLASH": ([*base, "--speculative-ddtree-keep-chain"],
                                      "--speculative-ddtree-keep-chain requires --speculative-algorithm DFLASH"),
        "keep chain with mode off": ([*df, "--speculative-ddtree-keep-chain"],
                                     "--speculative-ddtree-keep-chain has no effect with --speculative-ddtree-mode off"),
        "keep chain budget below depth": ([*full, "--speculative-ddtree-budget", "14", "--speculative-ddtree-keep-chain"],
                                          "--speculative-ddtree-keep-chain needs --speculative-ddtree-budget >= the "
                                          "draft depth 15 (block size 16 - 1: the whole top-1 chain is in the tree), "
                                          "got --speculative-ddtree-budget 14"),
        "keep chain with a value": ([*full, "--speculative-ddtree-keep-chain", "true"], "unrecognized arguments: true"),
        "full with deterministic inference": ([*full, "--enable-deterministic-inference"],
                                              "cannot honour --enable-deterministic-inference"),
        "full with custom logit processors": ([*full, "--enable-custom-logit-processor"],
                                              "cannot apply custom logit processors per tree node"),
    }
    # Test-only switches refuse a server unless a test says it means them (issue 23).
    switched = {
        "biased walk switch": ({"SGLANG_DDTREE_TEST_BIASED_WALK": "1"}, [*full],
                               "SGLANG_DDTREE_TEST_BIASED_WALK=1 is a test switch"),
        "cycle switch on shadow": ({"SGLANG_DDTREE_TEST_CYCLE_BUDGETS": "1"},
                                   [*df, "--speculative-ddtree-mode", "shadow-linear"],
                                   "SGLANG_DDTREE_TEST_CYCLE_BUDGETS=1 is a test switch"),
    }
    unproven = {"SGLANG_DDTREE_TEST_UNPROVEN_HYBRID": "1", "SGLANG_DDTREE_ALLOW_TEST_SWITCHES": "1"}
    switched |= {
        "unproven hybrid switch alone": ({"SGLANG_DDTREE_TEST_UNPROVEN_HYBRID": "1"}, [*gdn_full, "--disable-radix-cache"],
                                         "SGLANG_DDTREE_TEST_UNPROVEN_HYBRID=1 is a test switch"),
        "mamba commit fault alone": ({"SGLANG_DDTREE_TEST_MAMBA_COMMIT": "deepest"}, [*full],
                                     "SGLANG_DDTREE_TEST_MAMBA_COMMIT=deepest is a test switch"),
        "mamba commit fault unknown": ({**unproven, "SGLANG_DDTREE_TEST_MAMBA_COMMIT": "oldest"}, [*full],
                                       "SGLANG_DDTREE_TEST_MAMBA_COMMIT must be one of deepest, chain, skip"),
        # SGLang's own refusal comes first (DFLASH's verify on a hybrid needs the radix cache off)
        "GDN with the radix cache": (unproven, gdn_full, "is not compatible with radix cache"),
        "GDN with auto": (unproven, [*gdn_full, "--disable-radix-cache", "--speculative-ddtree-budget", "auto"],
                          "--speculative-ddtree-budget auto is not available on hybrid targets yet"),
        "GDN on flashinfer kernels": (unproven, [*gdn_full, "--disable-radix-cache", "--linear-attn-backend", "flashinfer"],
                                      "needs SGLang's Triton linear-attention kernels"),
        "Mamba under the switch": (unproven, [*mamba2_full, "--disable-radix-cache"],
                                     "have no tree-verify support in DDTree"),
    }
    allowed = {"biased walk allowed in a test": {"SGLANG_DDTREE_TEST_BIASED_WALK": "1",
                                                 "SGLANG_DDTREE_ALLOW_TEST_SWITCHES": "1"}}
    cases = [{"name": k, "argv": v} for k, v in good.items()]
    cases += [{"name": k, "argv": v} for k, (v, _) in bad.items()]
    cases += [{"name": k, "argv": v, "env": env} for k, (env, v, _) in switched.items()]
    cases += [{"name": k, "argv": full, "env": env} for k, env in allowed.items()]
    cases.append({"name": "GDN full 64 under the proof's switch", "env": unproven,
                  "argv": [*gdn_unproven_full, "--disable-radix-cache", "--speculative-ddtree-budget", "64"]})
    # Qwen3-Next's GDN layers are proven (ddtree_utils.HYBRID_TREE_SUPPORT): served without any switch
    cases.append({"name": "GDN full 64 on a proven architecture",
                  "argv": [*gdn_full, "--disable-radix-cache", "--speculative-ddtree-budget", "64"]})
    # ServerArgs built in Python (Engine kwargs) goes through the same checks.
    cases.append({"name": "kwargs bad mode", "kwargs": {"model_path": str(models / "target"), "device": "cpu",
                                                         "speculative_ddtree_mode": "fast"}})
    expect: dict[str, object] = {k: "ok" for k in good} | {k: msg for k, (_, msg) in bad.items()}
    expect |= {k: msg for k, (_, _, msg) in switched.items()} | {k: "ok" for k in allowed}
    expect["GDN full 64 under the proof's switch"] = "ok"
    expect["GDN full 64 on a proven architecture"] = "ok"
    expect["kwargs bad mode"] = "--speculative-ddtree-mode must be one of off, shadow-linear, full; got 'fast'"
    cases.append({"name": "kwargs keep chain not a bool", "kwargs": {
        "model_path": str(models / "target"), "device": "cpu", "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(models / "draft"), "speculative_num_draft_tokens": 16,
        "speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_keep_chain": "no"}})
    expect["kwargs keep chain not a bool"] = "--speculative-ddtree-keep-chain must be a boolean (true or false), got 'no'"
    return cases, expect


def test_prepare_server_args_accepts_and_refuses(patched, tmp_path):
    site, _, models = patched
    cases, expect = _cases(models)
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    proc = _run(site, str(SCRIPTS / "server_args_cases.py"), str(cases_file))
    results = {r["name"]: r for r in (json.loads(ln[5:]) for ln in proc.stdout.splitlines() if ln.startswith("CASE "))}
    assert sorted(results) == sorted(expect), proc.stderr[-3000:]
    problems = []
    for name, want in expect.items():
        r = results[name]
        if want == "ok":
            if not r["ok"]:
                problems.append(f"{name}: refused: {r['error']}")
        elif r["ok"] or want not in json.dumps(r.get("error")).replace("\\", ""):
            problems.append(f"{name}: want error containing {want!r}, got {r}")
    assert not problems, "\n".join(problems)
    assert results["plain"]["speculative_ddtree_mode"] == "off"
    assert results["dflash only"]["speculative_ddtree_budget"] is None
    shadow = results["shadow default budget"]
    assert (shadow["speculative_ddtree_mode"], shadow["speculative_ddtree_budget"]) == ("shadow-linear", 15)
    full = results["full 64 cap 4"]
    assert (full["speculative_ddtree_mode"], full["speculative_ddtree_budget"], full["speculative_ddtree_topk_cap"]) == (
        "full", 64, 4)
    # Full mode keeps CUDA graphs: the target's verify graphs are captured at 1 + budget tokens per
    # request, the draft's at the block; every other mode keeps the block for both.
    assert full["disable_cuda_graph"] is False and results["dflash only"]["disable_cuda_graph"] is False
    widths = {name: (results[name]["target_verify_width"], results[name]["draft_verify_width"]) for name in
              ("dflash only", "shadow default budget", "full 64 cap 4", "full budget 1", "full auto",
               "full auto max 63 keep chain", "shadow auto")}
    assert widths == {"dflash only": (16, 16), "shadow default budget": (16, 16), "full 64 cap 4": (65, 16),
                      "full budget 1": (2, 16), "full auto": (128, 16), "full auto max 63 keep chain": (64, 16),
                      "shadow auto": (16, 16)}
    # auto: the budget stays "auto" (what the operator asked for, in /server_info), its maximum beside it.
    assert [(results[k]["speculative_ddtree_budget"], results[k]["speculative_ddtree_budget_max"]) for k in
            ("full auto", "full auto max 63 keep chain", "shadow auto", "full 64 cap 4")] == [
        ("auto", 127), ("auto", 63), ("auto", 127), (64, None)]
    assert results["full auto"]["req_to_token_extra"] == 4 + 128
    assert results["mode case-insensitive"]["speculative_ddtree_mode"] == "shadow-linear"
    assert [results[k]["speculative_ddtree_keep_chain"] for k in ("full 64 cap 4", "keep chain default budget",
                                                                 "full keep chain 64", "keep chain budget = depth")] == [
        False, True, True, True]
    assert results["keep chain default budget"]["speculative_ddtree_budget"] == 15
    # A full-mode verify writes 1 + budget slots per request: SGLang's own row-width formula must
    # hold that (a request near the context limit otherwise writes into the next request's row).
    extra = {name: results[name]["req_to_token_extra"] for name in
             ("dflash only", "shadow default budget", "full 64 cap 4", "full edges", "full budget 1")}
    assert extra == {"dflash only": 4 + 16, "shadow default budget": 4 + 16, "full 64 cap 4": 4 + 65,
                     "full edges": 4 + 513, "full budget 1": 4 + 16}


def test_tree_verify_bookkeeping_and_worker_guards(patched):
    site, _, _ = patched
    proc = _run(site, str(SCRIPTS / "ddtree_mock_verify.py"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["ok"], result["failures"]
    assert result["steps"] == 60


def test_tp_ranks_agree_on_every_step_shape(patched):
    """Issue 23: two gloo ranks with different free device memory (80 and 6 GiB) size their verify
    steps alike and shape 300 random steps identically; without the agreement they differ. A verify-kernel
    check that passed on one rank only leaves both on the torch path."""
    site, _, _ = patched
    env_extra = {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ddtree_ranks_agree.py")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", **env_extra},
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["ok"], result
    agreed, control = result["agreed"], result["control"]
    assert agreed["limits"][0] == agreed["limits"][1] and agreed["differing_steps"] == 0
    assert control["limits"][0] != control["limits"][1] and control["differing_steps"] > 0
    # the verify kernels' check failed on rank 1 only: rank 0 turns its own off, no rank walks on them
    assert result["kernels"]["rank 1 failed"][0] == {"every": False, "turned_off": ["off on another TP rank"]}


def test_hybrid_patches_in_sglangs_own_code(patched):
    """The hybrid backend's tree path and memory plan as the payload patches them (issue 25): SGLang's own
    methods on the CPU, the arrays and plan checked against what a DDTree step and its width need; the GDN
    recurrence compiled once per tree width, whatever the batch; a verify never re-runs the deferred state clears
    of the prefill batch the running batch was adopted from."""
    site, _, _ = patched
    proc = _run(site, str(SCRIPTS / "hybrid_backend_checks.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"failures": []}


def test_gdn_verify_kernels_follow_ddtree_parents_bit_for_bit(patched):
    """Issue 25, G1 on the CPU: the patched tree's Gated DeltaNet verify kernels (the short convolution, its tree
    tokens in a runtime loop, and the gated delta-rule recurrence) run under Triton's interpreter on random
    DDTrees: every valid node's output and cached conv window / SSM state equal its root-to-node path's, bit for
    bit, with DDTree's own first-child / next-sibling arrays, while DFLASH's chain verify of the same tokens
    differs (the check sees a wrong parent); the accepted node's state, committed, continues the path in a plain
    decode step, DFLASH's index and the deepest node do not. The GPU runs the same script compiled
    (bench/gpu/hybrid_kernels_check.py --device cuda)."""
    site, _, _ = patched
    script = Path(__file__).resolve().parents[1] / "bench/gpu/hybrid_kernels_check.py"
    proc = _run(site, str(script), "--device", "cpu", "--batch", "2", timeout=900, env={"TRITON_INTERPRET": "1"})
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert [c["case"] for c in report["cases"]] == ["budget 15", "budget 64", "keep-chain 31", "64 shrunk to 20, padded"]
    for case in report["cases"]:
        exact = case["tree_vs_path"]
        assert exact["nodes"] > case["batch"] and all(exact[k] == 0 for k in ("conv", "window", "o", "state", "parent")), case
        assert case["branching"], case  # the trees branch: a wrong parent would show
        assert case["dflash_chain_vs_path"]["o"] > 0, case
        commit = case["commit"]
        assert commit["accepted_conv"] and commit["accepted_o"], commit
        for wrong in ("dflash_index", "deepest_node"):
            assert commit[wrong]["requests_with_another_node"] > 0 and commit[wrong]["continued_anyway"] == 0, commit
    assert report["ok"] and proc.returncode == 0, proc.stderr[-2000:]
