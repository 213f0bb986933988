"""Per-node recurrent state of a hybrid target (ddtree_hybrid_state): the bytes SGLang 0.5.13.post1
allocates for tree verify, checked by hand from the shapes and against SGLang's own `MambaPool` on CPU;
the tree kernels' parent derivation on DDTree's own arrays; the committed / tracked node of a step
against a recurrence simulated over real DDTrees (and the wrong commits that must differ)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module

hs = load_payload_module("ddtree_hybrid_state")
du = load_ddtree_utils()

HERE = Path(__file__).resolve().parent

# Qwen3.6-27B's text config (the Qwen/Qwen3.6-27B model card: 64 layers laid out 16 x (3 Gated DeltaNet
# + 1 gated attention), GDN 48 value / 16 key heads of dim 128; conv kernel 4 and mamba_ssm_dtype
# float32 as every published Qwen3.5 text config carries them). bench/gpu/HYBRID.md says where from.
QWEN36_27B_TEXT = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
}
QWEN36_27B = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": QWEN36_27B_TEXT}


# ------------------------------------------------------------------------------------------ memory
def hand_bytes_per_node_per_layer(tp: int = 1) -> int:
    """Independent of the module: GDN conv input is q, k (16 heads x 128 each) and v (48 x 128),
    3 columns of history in bf16; the SSM state is 48 heads of 128 x 128 float32."""
    conv_dim = 16 * 128 + 16 * 128 + 48 * 128  # 10240
    return (conv_dim // tp) * 3 * 2 + (48 // tp) * 128 * 128 * 4


def test_qwen36_27b_shape_by_hand() -> None:
    shape, layers = hs.gdn_layers_from_hf(QWEN36_27B)
    assert layers == 48
    assert shape.conv == ((10240, 3),) and shape.temporal == (48, 128, 128)
    assert shape.conv_bytes == 61_440 and shape.ssm_bytes == 3_145_728
    assert shape.step_bytes == hand_bytes_per_node_per_layer() == 3_207_168
    assert hs.mamba_cache_per_req(shape, layers) == 153_944_064  # one slot's main state, all layers


@pytest.mark.parametrize("budget", [15, 64, 256])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_intermediate_bytes_by_hand(budget: int, tp: int) -> None:
    shape, layers = hs.gdn_layers_from_hf(QWEN36_27B, tp_size=tp)
    width = 1 + budget
    got = hs.intermediate_state_bytes(shape, num_linear_layers=layers, verify_width=width, max_running_requests=64)
    assert got.slots == 65 and got.width == width
    assert got.total == 65 * width * 48 * hand_bytes_per_node_per_layer(tp)
    assert got.per_slot == width * 48 * hand_bytes_per_node_per_layer(tp)
    assert got.ssm == 65 * width * 48 * (48 // tp) * 128 * 128 * 4


def test_the_layer_count_follows_full_attention_interval_as_sglang_reads_it() -> None:
    # SGLang 0.5.13.post1 ignores layer_types (configs/qwen3_next.py:258-268): an interval of 2 makes
    # every second layer full attention even where layer_types says otherwise.
    cfg = {**QWEN36_27B_TEXT, "full_attention_interval": 2}
    assert hs.gdn_layers_from_hf(cfg)[1] == 32
    assert hs.gdn_layers_from_hf({**QWEN36_27B_TEXT, "mamba_ssm_dtype": "bfloat16"})[0].ssm_dtype_bytes == 2
    assert hs.gdn_layers_from_hf(QWEN36_27B, ssm_dtype="bfloat16")[0].ssm_bytes == 3_145_728 // 2


def test_groups_that_do_not_divide_tp_are_padded_as_sglang_pads_them() -> None:
    # extra_groups_for_head_shards (configs/mamba_utils.py:29-38): n_groups 1 at tp 4 becomes 4.
    shape = hs.mamba2_state_shape(intermediate_size=4096, n_groups=1, num_heads=64, head_dim=64,
                                  state_size=128, conv_kernel=4, tp_size=4)
    assert shape.conv == (((4096 + 2 * 4 * 128) // 4, 3),)
    assert shape.temporal == (16, 64, 128)
    with pytest.raises(ValueError):
        hs.mamba2_state_shape(intermediate_size=4096, n_groups=8, num_heads=6, head_dim=64, state_size=128,
                              conv_kernel=4, tp_size=4)


def test_sglang_plans_for_the_block_while_allocating_for_the_tree() -> None:
    shape, layers = hs.gdn_layers_from_hf(QWEN36_27B)
    planned = hs.sglang_planned_intermediate_bytes(shape, num_linear_layers=layers,
                                                   speculative_num_draft_tokens=16, capped_requests=64)
    at_block = hs.intermediate_state_bytes(shape, num_linear_layers=layers, verify_width=16, max_running_requests=64)
    at_256 = hs.intermediate_state_bytes(shape, num_linear_layers=layers, verify_width=257, max_running_requests=64)
    assert at_block.total - planned == at_block.per_slot  # the padding row only
    assert at_256.total - planned > 15 * planned  # the tree's width is not in SGLang's plan


@pytest.mark.slow
def test_bytes_equal_sglang_mambapool_on_cpu() -> None:
    """SGLang's own Qwen3NextConfig.mamba2_cache_params and MambaPool.__init__ (meta tensors)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed in this interpreter")
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang has no distribution metadata")
    if version != "0.5.13.post1":
        pytest.skip(f"needs sglang 0.5.13.post1, found {version}")
    text = {k: v for k, v in QWEN36_27B_TEXT.items() if k not in ("model_type", "layer_types")}
    cases = [[64, 16], [64, 65], [7, 257], [1, 2]]
    for tp in (1, 4):
        request = {"config": text, "cases": cases, "tp_size": tp}
        proc = subprocess.run(
            [sys.executable, str(HERE / "sglang_scripts" / "mamba_pool_bytes.py"), json.dumps(request)],
            capture_output=True, text=True, timeout=600, check=False,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        shape, layers = hs.gdn_layers_from_hf(QWEN36_27B, tp_size=tp)
        assert got["layers"] == layers
        assert got["conv_shape"] == [list(s) for s in shape.conv]
        assert got["temporal_shape"] == list(shape.temporal)
        assert (got["conv_dtype"], got["ssm_dtype"]) == ("torch.bfloat16", "torch.float32")
        assert got["mamba_cache_per_req"] == hs.mamba_cache_per_req(shape, layers)
        for case in got["cases"]:
            ours = hs.intermediate_state_bytes(shape, num_linear_layers=layers, verify_width=case["width"],
                                               max_running_requests=case["spec_state_size"])
            assert case["ssm_shape"] == [layers, ours.slots, case["width"], *shape.temporal]
            assert case["conv_shapes"] == [[layers, ours.slots, case["width"], *c] for c in shape.conv]
            assert (case["ssm_bytes"], case["conv_bytes"]) == (ours.ssm, ours.conv)


# ------------------------------------------------------------------------------------------ tree indices
def _trees(seed: int):
    """Real DDTrees (CPU torch path): standard, capped, keep-chain, shrunk padded and unpadded."""
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = 15, 48
    logits = torch.randn((3, depth, vocab), generator=gen) * 3
    yield du.build_ddtree(logits, 64)
    yield du.build_ddtree(logits, 15, topk_cap=2)
    yield du.build_ddtree(logits, 40, keep_chain=True)
    big = du.build_ddtree(logits, 64)
    yield du.shrink_tree(big, 7, pad=True)
    yield du.shrink_tree(big, 7, pad=False)
    yield du.build_ddtree(logits, 0)  # root only


@pytest.mark.parametrize("seed", range(6))
def test_the_kernels_recover_ddtree_parents_from_ddtrees_own_arrays(seed: int) -> None:
    for tree in _trees(seed):
        for b in range(tree.batch_size):
            got = hs.parents_from_retrieve(tree.retrive_next_token[b].tolist(), tree.retrive_next_sibling[b].tolist())
            want = tree.parents[b].tolist()
            k = int(tree.num_nodes[b])
            assert got[1:k] == want[1:k]
            # the root and padding are never a child: the kernels leave them at 0, which no node reads
            # for the root (step 0 starts from the pool state) and no commit reads for padding
            assert got[0] == 0 and all(p == 0 for p in got[k:])


def test_the_kernels_need_parents_before_children() -> None:
    # first child with a lower index than its parent: the kernel's one pass reads an unset parent
    next_token, next_sibling = [2, -1, -1], [-1, -1, 1]  # 0 -> 2, 2's sibling 1 (chain out of order)
    assert hs.parents_from_retrieve(next_token, next_sibling) == [0, 0, 0]
    next_token, next_sibling = [1, 3, -1, -1], [-1, 2, -1, -1]  # the docstring's tree
    assert hs.parents_from_retrieve(next_token, next_sibling) == [0, 0, 0, 1]


P = (1 << 61) - 1


def _step(state: int, token: int) -> int:
    # a recurrence that remembers order (like an SSM state): state' = 1000003 * state + token + 1 mod P
    return (state * 1_000_003 + token + 1) % P


@pytest.mark.parametrize("seed", range(8))
def test_committing_the_last_committed_path_node_equals_a_linear_pass(seed: int) -> None:
    """Simulate SGLang's tree recurrence (every node from its parent's intermediate state, parents as the
    kernels derive them), walk the tree with random target tokens, commit `commit_step` and compare with
    the recurrence run over the committed tokens in order. The chain rule (`commit_len - 1`) and the
    deepest node must give a different state on some steps: the test has power against both."""
    rng = random.Random(seed)
    chain_rule_wrong = deepest_wrong = 0
    for tree in _trees(seed):
        bs, n = tree.parents.shape
        root_tokens = torch.tensor([rng.randrange(48) for _ in range(bs)])
        tokens = tree.full_token_ids(root_tokens)
        # target tokens that follow the tree often, down any child (not only the best-first one)
        target = torch.randint(0, 48, (bs, n), generator=torch.Generator().manual_seed(seed))
        for b in range(bs):
            for i in range(n):
                children = [c for c in range(1, int(tree.num_nodes[b])) if int(tree.parents[b, c]) == i]
                if children and rng.random() < 0.8:
                    target[b, i] = tokens[b, rng.choice(children)]
        accepted, accept_lengths, _bonus = du.follow_verified_tree(tree, target)
        for b in range(bs):
            parent = hs.parents_from_retrieve(tree.retrive_next_token[b].tolist(),
                                              tree.retrive_next_sibling[b].tolist())
            start = rng.randrange(P)
            state = [0] * n
            for i in range(n):  # index order, as the kernels run
                state[i] = _step(start if i == 0 else state[parent[i]], int(tokens[b, i]))
            path = accepted[b].tolist()
            full = int(accept_lengths[b]) + 1
            for commit_len in range(1, full + 1):  # a request may finish on the path
                linear = start
                for j in range(commit_len):
                    linear = _step(linear, int(tokens[b, path[j]]))
                assert state[hs.commit_step(path, commit_len)] == linear
                chain_rule_wrong += state[commit_len - 1] != linear
            deepest = max(range(int(tree.num_nodes[b])), key=lambda i: int(tree.depths[b, i]))
            deepest_wrong += state[deepest] != state[hs.commit_step(path, full)]
    assert chain_rule_wrong > 0 and deepest_wrong > 0


def _dflash_track_offset(before: int, commit_len: int, interval: int) -> int:
    # dflash_worker.py:1088-1105 for one request, on chain offsets
    after = before + commit_len
    if before // interval == after // interval:
        return -1
    offset = max(after // interval * interval - before - 1, 0)
    return offset if offset < commit_len else -1


def test_track_step_is_dflash_rule_mapped_through_the_path() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        interval = rng.choice([16, 64, 256])
        before = rng.randrange(1, 3 * interval)
        commit_len = rng.randrange(1, 17)
        path = [0] + sorted(rng.sample(range(1, 300), 16))
        offset = _dflash_track_offset(before, commit_len, interval)
        got = hs.track_step(path, commit_len, before, interval)
        assert got == (-1 if offset < 0 else path[offset])
        chain = list(range(17))
        assert hs.track_step(chain, commit_len, before, interval) == offset
        assert hs.commit_step(chain, commit_len) == commit_len - 1
    with pytest.raises(ValueError):
        hs.commit_step([0], 0)
