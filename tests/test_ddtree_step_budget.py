"""How large a tree a full-mode verify step may use: row width, logits and mask limits, at their
edges and against a brute-force oracle; and the windowed-attention / hybrid refusals of full mode."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from ddtree_oracle import load_ddtree_utils

_PATH = Path(__file__).resolve().parents[1] / "ddtree_ops/payload/sglang/srt/speculative/ddtree_step_budget.py"
_spec = importlib.util.spec_from_file_location("ddtree_step_budget_under_test", _PATH)
sb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sb  # dataclasses look their module up while the class is made
_spec.loader.exec_module(sb)
du = load_ddtree_utils()

BLOCK = 16  # DFLASH block size (--speculative-num-draft-tokens)


def sglang_row_width(context_len: int, max_draft_tokens: int) -> int:
    """req_to_token row width as SGLang 0.5.13.post1 sizes it (mem_cache/common.py):
    context_len + 4 + max_speculative_num_draft_tokens (page size 1)."""
    return context_len + 4 + max_draft_tokens


UNBOUNDED = dict(max_verify_tokens=10**9, max_mask_bytes=10**15)


@pytest.mark.parametrize("budget", [23, 24, 255])
def test_a_request_at_the_context_limit_gets_its_full_tree_once_rows_are_sized_for_it(budget: int) -> None:
    context_len = 1024
    # ddtree_args raises max_speculative_num_draft_tokens to 1 + budget in full mode.
    row = sglang_row_width(context_len, max(BLOCK, 1 + budget))
    for seq_len in (1, context_len - 4, context_len - 1, context_len):
        limits = sb.StepLimits(row_width=row, **UNBOUNDED)
        got = sb.step_budget(budget, batch_size=3, max_seq_len=seq_len, prefix_total=3 * seq_len, limits=limits)
        assert got == budget, (seq_len, got)


@pytest.mark.parametrize(("budget", "want"), [(23, 23), (24, 15), (255, 15)])
def test_rows_sized_for_the_block_only_shrink_the_tree_so_it_never_overflows(budget: int, want: int) -> None:
    # The upstream width (block size only): at seq_len = context_len - 4 the row holds 24 slots more.
    context_len = 1024
    row = sglang_row_width(context_len, BLOCK)
    seq_len = context_len - 4
    limits = sb.StepLimits(row_width=row, **UNBOUNDED)
    got = sb.step_budget(budget, batch_size=2, max_seq_len=seq_len, prefix_total=2 * seq_len, limits=limits)
    assert got == want
    assert seq_len + 1 + got <= row


def test_no_room_for_even_one_node_verifies_linearly() -> None:
    limits = sb.StepLimits(row_width=100, **UNBOUNDED)
    assert sb.step_budget(64, batch_size=1, max_seq_len=99, prefix_total=99, limits=limits) == 0
    assert sb.step_budget(64, batch_size=1, max_seq_len=98, prefix_total=98, limits=limits) == 1


def test_logits_bound_caps_the_batch_tokens() -> None:
    limits = sb.StepLimits(row_width=10**6, max_verify_tokens=32 * 64, max_mask_bytes=10**15)
    assert sb.step_budget(255, batch_size=32, max_seq_len=10, prefix_total=320, limits=limits) == 63
    assert sb.step_budget(255, batch_size=33, max_seq_len=10, prefix_total=330, limits=limits) == 31


def test_ladder_is_the_budget_then_powers_of_two_minus_one() -> None:
    assert sb.budget_ladder(255) == [255, 127, 63, 31, 15, 7, 3, 1]
    assert sb.budget_ladder(64) == [64, 63, 31, 15, 7, 3, 1]
    assert sb.budget_ladder(15) == [15, 7, 3, 1]
    assert sb.budget_ladder(1) == [1]


def test_step_budget_is_the_largest_ladder_budget_that_fits_randomised() -> None:
    rng = random.Random(12)
    for _ in range(3000):
        budget = rng.choice([1, 2, 15, 23, 24, 63, 64, 255, 512])
        bs = rng.randint(1, 64)
        row = rng.randint(16, 4096)
        seqs = [rng.randint(1, row) for _ in range(bs)]
        limits = sb.StepLimits(row_width=row, max_verify_tokens=rng.randint(1, 20_000),
                               max_mask_bytes=rng.randint(1, 10**8))
        got = sb.step_budget(budget, batch_size=bs, max_seq_len=max(seqs), prefix_total=sum(seqs), limits=limits)

        def fits(b: int, seqs=seqs, limits=limits) -> bool:  # the oracle: each request's own row, etc.
            n = 1 + b
            mask = sum(n * (s + n) for s in seqs)
            return all(s + n <= limits.row_width for s in seqs) and len(seqs) * n <= limits.max_verify_tokens \
                and mask <= limits.max_mask_bytes

        candidates = [b for b in [budget, *[(1 << k) - 1 for k in range(1, 11)]] if 1 <= b <= budget]
        best = max((b for b in candidates if fits(b)), default=0)
        assert got == best, (budget, bs, row, limits, got, best)


def test_memory_sizing_arithmetic() -> None:
    per = sb.verify_token_bytes(vocab=152_000, hidden=5120)
    assert per == 10 * 152_000 + 64 * 5120
    # batch 128 x budget 255 on a 152k vocab is the ~20 GB step the issue names: 10 GiB free holds far less.
    tokens = sb.max_verify_tokens_for(10 * 2**30, vocab=152_000, hidden=5120)
    assert tokens < 128 * 256
    assert tokens * per <= 5 * 2**30


def test_the_graph_mask_buffer_holds_the_worst_step_the_crash_did_not_fit() -> None:
    """The measured crashes (issue 23): 32 requests at --context-length 1024 and --cuda-graph-max-bs 32
    whose prefixes sum with the verify width to 1025 (960 + 65 in full 64, 1009 + 16 in DFLASH) verify
    a mask of n * sum(prefix + n) entries; upstream's buffer was max_bs * n * context_len. The sized
    buffer holds every step whose prefixes fit a row."""
    for n, step, upstream in ((65, 2_132_000, 2_129_920), (16, 524_800, 524_288)):
        assert n * 32 * 1025 == step and 32 * n * 1024 == upstream and step > upstream
        row = sglang_row_width(1024, max(n, BLOCK))
        assert sb.verify_graph_mask_bytes(32, n, row) >= n * 32 * (row + n) >= step
    rng = random.Random(5)
    for _ in range(500):
        max_bs, n, ctx = rng.randint(1, 64), rng.choice([16, 17, 65, 257, 513]), rng.choice([512, 1024, 4096])
        row = sglang_row_width(ctx, max(n, BLOCK))
        bs = rng.randint(1, max_bs)
        prefixes = [rng.randint(1, row) for _ in range(bs)]  # a root at most: prefix <= row
        assert n * sum(p + n for p in prefixes) <= sb.verify_graph_mask_bytes(max_bs, n, row)


def test_graph_buffers_grow_with_the_budget_and_are_counted() -> None:
    kw = dict(row_width=1024 + 4 + 513, context_len=1024, heads=32, kv_splits=8, v_head_dim=128)
    small, big = sb.verify_graph_buffer_bytes(32, 16, **kw), sb.verify_graph_buffer_bytes(32, 513, **kw)
    assert big > 30 * small
    # the KV indices (int64 over the context) dominate: 8 B x 32 x 513 x 1024 alone
    assert big >= 8 * 32 * 513 * 1024 + sb.verify_graph_mask_bytes(32, 513, kw["row_width"])


SIZING = dict(max_running=48, width=257, block_size=16, row_width=1024 + 4 + 257, vocab=152_000, hidden=5120)


def test_sizing_reserves_the_worst_step_and_one_sampled_walk() -> None:
    walk = 3 * 2**30
    s = sb.size_verify_steps(80 * 2**30, walk_bytes=walk, **SIZING)
    assert isinstance(s, sb.VerifySizing)
    assert s.max_verify_tokens == 48 * 257  # plenty of memory: the whole worst step
    assert s.reserve_bytes == s.max_verify_tokens * sb.verify_token_bytes(152_000, 5120) + s.max_mask_bytes + walk
    # less memory: fewer tokens, but at least what linear DFLASH verifies
    t = sb.size_verify_steps(20 * 2**30, walk_bytes=walk, **SIZING)
    assert isinstance(t, sb.VerifySizing) and 48 * 16 <= t.max_verify_tokens < 48 * 257
    assert sb.size_verify_steps(20 * 2**30, walk_bytes=walk, override_tokens=1024, **SIZING).max_verify_tokens == 1024


def test_sizing_refuses_naming_the_flag_to_lower() -> None:
    no_walk = sb.size_verify_steps(2 * 2**30, walk_bytes=3 * 2**30, **SIZING)
    assert isinstance(no_walk, str) and "--speculative-ddtree-budget" in no_walk and "sampled walk" in no_walk
    no_floor = sb.size_verify_steps(int(0.5 * 2**30), walk_bytes=2**20, **SIZING)
    assert isinstance(no_floor, str) and "--max-running-requests" in no_floor and "fewer than linear DFLASH" in no_floor


def test_sizing_is_monotone_in_free_memory_randomised() -> None:
    """More free memory never affords less: what the TP ranks agree on (the minimum) is safe on all."""
    rng = random.Random(9)
    for _ in range(300):
        kw = dict(max_running=rng.randint(1, 128), width=rng.choice([16, 65, 257, 513]), block_size=16,
                  row_width=rng.choice([1024, 4096, 32768]) + 533, vocab=rng.choice([4096, 152_000]),
                  hidden=rng.choice([256, 4096]), walk_bytes=rng.randint(0, 2**32))
        a, b = sorted(rng.randint(0, 2**37) for _ in range(2))
        sa, sb_ = sb.size_verify_steps(a, **kw), sb.size_verify_steps(b, **kw)
        if isinstance(sa, sb.VerifySizing):
            assert isinstance(sb_, sb.VerifySizing)
            assert sb_.max_verify_tokens >= sa.max_verify_tokens and sb_.max_mask_bytes >= sa.max_mask_bytes


# ------------------------------------------------- full-mode refusals from config.json -------------------

@pytest.mark.parametrize(("config", "evidence"), [
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window = 4096"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
     "5 of 6 windowed attention layers"),
    ({"model_type": "llama4_text", "attention_chunk_size": 8192}, "attention_chunk_size"),
    ({"model_type": "x", "text_config": {"model_type": "gemma3_text", "sliding_window": 512}},
     "text_config.sliding_window = 512"),
])
def test_windowed_attention_is_detected_and_refused(config: dict, evidence: str) -> None:
    windowed, reason = du.uses_windowed_attention(config)
    assert windowed and evidence in reason
    refusal = du.full_mode_refusal(config)
    assert refusal and "windowed attention" in refusal and evidence in refusal
    assert "--speculative-ddtree-mode shadow-linear" in refusal


@pytest.mark.parametrize("config", [
    {"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False},  # shipped but unused
    {"model_type": "llama", "sliding_window": None},
    {"model_type": "qwen3", "layer_types": ["full_attention"] * 4},
])
def test_plain_attention_models_are_not_refused(config: dict) -> None:
    assert du.uses_windowed_attention(config)[0] is False
    assert du.full_mode_refusal(config) is None


def test_hybrid_models_are_refused_without_an_escape_hatch() -> None:
    refusal = du.full_mode_refusal({"model_type": "qwen3_6_moe"})
    assert refusal and "hybrid" in refusal and "allow" not in refusal


@pytest.mark.parametrize(("config", "architecture"), [
    ({"model_type": "qwen3_next"}, "qwen3-next"),
    ({"model_type": "x", "architectures": ["Qwen3NextForCausalLM"]}, "qwen3-next"),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, "qwen3.5"),
    ({"model_type": "x", "architectures": ["Qwen3_5ForConditionalGeneration"]}, "qwen3.5"),
    ({"model_type": "x", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}, "qwen3.5-moe"),
    ({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}, "qwen3.5-moe"),
    ({"model_type": "qwen3_6_moe"}, "qwen3.6-moe"),
])
def test_gated_deltanet_hybrids_follow_the_support_table(config: dict, architecture: str) -> None:
    """GDN targets are told apart by architecture, and the table's status for (layer type, architecture)
    decides, nothing else: proven serves, unproven is refused with both named (served only under the
    proof's switch)."""
    kind = ("gated-deltanet", architecture)
    assert du.hybrid_kind(config) == kind
    for status in ("proven", "unproven"):
        with mock.patch.dict(du.HYBRID_TREE_SUPPORT, {kind: (status, "the evidence")}):
            refusal = du.full_mode_refusal(config)
            if status == "proven":
                assert refusal is None
            else:
                assert refusal and f"layer type gated-deltanet on {architecture}: the evidence" in refusal
                assert "shadow-linear" in refusal
                assert du.full_mode_refusal(config, allow_unproven_hybrid=True) is None
    with mock.patch.dict(du.HYBRID_TREE_SUPPORT, {}, clear=True):  # off the table: refused by name
        refusal = du.full_mode_refusal(config, allow_unproven_hybrid=True)
        assert refusal and "no tree-verify support in DDTree" in refusal and "no hybrid layer type is proven" in refusal


def test_the_support_table_lifts_only_what_the_h200_proved() -> None:
    """What the GPU proofs showed (bench/RESULTS.md): GDN layers serve full mode on Qwen3-Next, dense Qwen3.5 and
    Qwen3.5 MoE; Qwen3.6 class names, never served in a proof, stay unproven; refusals list what is proven."""
    for arch in ("qwen3-next", "qwen3.5", "qwen3.5-moe"):
        assert du.hybrid_support("gated-deltanet", arch)[0] == "proven"
    for arch in ("qwen3.6", "qwen3.6-moe"):
        assert du.hybrid_support("gated-deltanet", arch)[0] == "unproven"
    assert du.hybrid_support("mamba2", "nemotron-h")[0] == "refused"
    refusal = du.full_mode_refusal({"model_type": "qwen3_6_moe"})
    assert refusal and ("full mode runs on gated-deltanet on qwen3-next, gated-deltanet on qwen3.5, gated-deltanet on "
                        "qwen3.5-moe only") in refusal
    # the class SGLang builds decides over model_type (a Qwen3.6 class on Qwen3.5's config is not Qwen3.5)
    assert du.hybrid_kind({"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_6MoeForCausalLM"]}) == (
        "gated-deltanet", "qwen3.6-moe")


@pytest.mark.parametrize("config", [
    {"model_type": "nemotron_h"}, {"model_type": "jamba"}, {"model_type": "kimi_linear"},
    {"model_type": "lfm2"}, {"model_type": "qwen3", "mamba_d_state": 16},
    {"model_type": "x", "layer_types": ["linear_attention", "full_attention"]},
])
def test_other_hybrids_stay_refused_even_under_the_switch(config: dict) -> None:
    assert du.hybrid_kind(config) is None
    for allow in (False, True):
        refusal = du.full_mode_refusal(config, allow_unproven_hybrid=allow)
        assert refusal and "no tree-verify support in DDTree" in refusal and "shadow-linear" in refusal


def test_padded_step_budget_randomised() -> None:
    """Padded to the graphs' width, a step pays the whole width in logits and mask and only its tree in
    rows: the largest ladder budget (0 included) whose tree fits every row, None if the width does not
    fit the logits or mask limits or not even the root fits a row."""
    rng = random.Random(13)
    outcomes = set()
    for _ in range(3000):
        budget = rng.choice([1, 2, 15, 23, 63, 64, 255])
        width = 1 + budget
        bs = rng.randint(1, 48)
        row = rng.randint(16, 2048)
        seqs = [rng.randint(1, row) for _ in range(bs)]
        limits = sb.StepLimits(row_width=row, max_verify_tokens=rng.randint(1, 20_000),
                               max_mask_bytes=rng.randint(1, 10**8))
        got = sb.padded_step_budget(budget, width=width, batch_size=bs, max_seq_len=max(seqs),
                                    prefix_total=sum(seqs), limits=limits)
        width_fits = bs * width <= limits.max_verify_tokens and \
            sum(width * (s + width) for s in seqs) <= limits.max_mask_bytes
        candidates = [b for b in [budget, *[(1 << k) - 1 for k in range(0, 11)]] if 0 <= b <= budget]
        rows_fit = [b for b in candidates if all(s + 1 + b <= row for s in seqs)]
        want = max(rows_fit) if width_fits and rows_fit else None
        assert got == want, (budget, bs, row, limits, got, want)
        outcomes.add("none" if got is None else "zero" if got == 0 else "full" if got == budget else "shrunk")
    assert outcomes == {"none", "zero", "full", "shrunk"}


@pytest.mark.parametrize(("config", "refused_with"), [
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, None),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, None),
    ({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}, None),
    ({"model_type": "qwen3_6_moe", "architectures": ["Qwen3_6MoeForConditionalGeneration"]},
     "layer type gated-deltanet on qwen3.6-moe"),
    ({"model_type": "x", "layer_types": ["linear_attention", "full_attention"]}, "no tree-verify support in DDTree"),
])
def test_promotes_payload_verdict_follows_the_support_table(config: dict, refused_with: str | None) -> None:
    """promote asks the host's installed payload, through units.FULL_MODE_PROBE (its own Python, the module file
    loaded by path), before any change: the verdict is the support table's, proven architectures pass."""
    from ddtree_ops.agent.remote.units import FULL_MODE_PROBE

    proc = subprocess.run([sys.executable, "-c", FULL_MODE_PROBE, du.__file__, json.dumps(config)],
                          capture_output=True, text=True, timeout=120)
    refusal = json.loads(proc.stdout.strip().splitlines()[-1])["refusal"]
    if refused_with is None:
        assert refusal is None
    else:
        assert refusal and refused_with in refusal and "shadow-linear" in refusal
