"""Per-node recurrent state of a hybrid (Gated DeltaNet / Mamba-2) target in a tree verify (installed as
`sglang/srt/speculative/ddtree_hybrid_state.py` by the ddtree-ops payload; pure Python, no torch).

What SGLang 0.5.13.post1 allocates for speculative verify on a hybrid target, and the index arithmetic
that connects DDTree's tree to SGLang's hybrid tree path (bench/gpu/HYBRID.md has the whole study):

- Memory. `MambaPool.__init__` (mem_cache/memory_pool.py:246-372) allocates, next to the main conv / SSM
  state, one intermediate SSM state and one conv window per verify token:
  `intermediate_ssm` `[layers, spec_state_size + 1, W, heads/tp, head_dim, state_size]` in the SSM dtype
  and `intermediate_conv_window` `[layers, spec_state_size + 1, W, conv_dim/tp, kernel - 1]` in the conv
  dtype (memory_pool.py:319-346), where `W = server_args.max_speculative_num_draft_tokens`
  (model_runner_kv_cache_mixin.py:298, 364) and `spec_state_size = max_running_requests`
  (model_runner_kv_cache_mixin.py:349). DDTree full mode raises `max_speculative_num_draft_tokens` to
  `1 + budget` (ddtree_args), so these buffers are sized for the whole tree. The per-step shapes come
  from `Mamba2StateShape.create` (configs/mamba_utils.py:141-177); for Qwen3-Next / Qwen3.5 / 3.6 the
  GDN fields map onto it in `Qwen3NextConfig.mamba2_cache_params` (configs/qwen3_next.py:286-306).
  SGLang's own memory plan (`handle_max_mamba_cache`, model_runner_kv_cache_mixin.py:82-184) counts
  `mamba_cache_per_req * requests * speculative_num_draft_tokens`: the DFLASH block, not `W`.
- Parents. The tree kernels derive each node's parent from the EAGLE-style first-child / next-sibling
  arrays, in node-index order (`_causal_conv1d_update_kernel`, layers/attention/mamba/
  causal_conv1d_triton.py:803-830); `parents_from_retrieve` is that loop in Python, so a test can show
  that DDTree's own `retrive_next_token` / `retrive_next_sibling` give back `DDTree.parents`.
- Commit. `HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`
  (layers/attention/hybrid_linear_attn_backend.py:967-1030) copies, per request, the intermediate state
  at one *step index inside the request's verify block* into the pool. For a tree that index is the
  last committed node on the accepted path (`commit_step`), not `commit_len - 1` (DFLASH's chain rule,
  speculative/dflash_worker.py:1085); radix-cache tracking maps its chain offset through the path the
  same way (`track_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# torch.dtype.itemsize of the state dtypes SGLang accepts (configs/mamba_utils.py:63-67).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# SGLang's defaults: conv state bfloat16 (SGLANG_MAMBA_CONV_DTYPE, environ.py:650), SSM state float32
# unless config.json's `mamba_ssm_dtype` or --mamba-ssm-dtype says otherwise (mamba_utils.py:68-103).
DEFAULT_CONV_DTYPE = "bfloat16"
DEFAULT_SSM_DTYPE = "float32"

GIB = 1 << 30


@dataclass(frozen=True)
class LinearStateShape:
    """One linear-attention layer's recurrent state for one request slot (SGLang's `Mamba2StateShape`):
    `conv` the conv-window tensors `(conv_dim / tp, kernel - 1)`, `temporal` the SSM state
    `(heads / tp, head_dim, state_size)`, with their dtypes' sizes in bytes."""

    conv: tuple[tuple[int, int], ...]
    temporal: tuple[int, int, int]
    conv_dtype_bytes: int = DTYPE_BYTES[DEFAULT_CONV_DTYPE]
    ssm_dtype_bytes: int = DTYPE_BYTES[DEFAULT_SSM_DTYPE]

    @property
    def conv_bytes(self) -> int:
        return sum(a * b for a, b in self.conv) * self.conv_dtype_bytes

    @property
    def ssm_bytes(self) -> int:
        h, d, s = self.temporal
        return h * d * s * self.ssm_dtype_bytes

    @property
    def step_bytes(self) -> int:
        """One layer, one request slot, one verify step (= one tree node): conv window + SSM state."""
        return self.conv_bytes + self.ssm_bytes


def _divide(numerator: int, denominator: int) -> int:
    # sglang.srt.distributed.utils.divide: exact division or an error.
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def mamba2_state_shape(
    *,
    intermediate_size: int,
    n_groups: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
    tp_size: int = 1,
    conv_dtype: str = DEFAULT_CONV_DTYPE,
    ssm_dtype: str = DEFAULT_SSM_DTYPE,
) -> LinearStateShape:
    """`Mamba2StateShape.create` (configs/mamba_utils.py:141-177): groups padded to a multiple of the TP
    size when they do not divide (`extra_groups_for_head_shards`, mamba_utils.py:29-38), conv dim
    `intermediate_size + 2 * n_groups * state_size`, heads split over TP."""
    if n_groups % tp_size:
        n_groups += tp_size - n_groups
    conv_dim = intermediate_size + 2 * n_groups * state_size
    return LinearStateShape(
        conv=((_divide(conv_dim, tp_size), conv_kernel - 1),),
        temporal=(_divide(num_heads, tp_size), head_dim, state_size),
        conv_dtype_bytes=DTYPE_BYTES[conv_dtype],
        ssm_dtype_bytes=DTYPE_BYTES[ssm_dtype],
    )


def gdn_state_shape(
    *,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    linear_conv_kernel_dim: int,
    tp_size: int = 1,
    conv_dtype: str = DEFAULT_CONV_DTYPE,
    ssm_dtype: str = DEFAULT_SSM_DTYPE,
) -> LinearStateShape:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5, Qwen3.6) as `Qwen3NextConfig.mamba2_cache_params`
    maps it (configs/qwen3_next.py:294-302): value heads are the SSM heads, the key head dim the state
    size, the key heads the groups."""
    return mamba2_state_shape(
        intermediate_size=linear_value_head_dim * linear_num_value_heads,
        n_groups=linear_num_key_heads,
        num_heads=linear_num_value_heads,
        head_dim=linear_value_head_dim,
        state_size=linear_key_head_dim,
        conv_kernel=linear_conv_kernel_dim,
        tp_size=tp_size,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )


def gdn_layers_from_hf(config: dict, *, tp_size: int = 1, ssm_dtype: str | None = None) -> tuple[LinearStateShape, int]:
    """(state shape, number of linear-attention layers) of a Qwen3-Next / Qwen3.5 / Qwen3.6 config.json
    (`text_config` first when present). The layer count follows SGLang, which reads
    `full_attention_interval` (layer `l` is full attention when `(l + 1) % interval == 0`,
    configs/qwen3_next.py:258-268), not `layer_types`. The SSM dtype: `ssm_dtype` (--mamba-ssm-dtype),
    else config.json's `mamba_ssm_dtype`, else float32 (configs/mamba_utils.py:70-103)."""
    text = config.get("text_config") or config
    interval = int(text["full_attention_interval"])
    layers = int(text["num_hidden_layers"])
    linear = sum(1 for i in range(layers) if (i + 1) % interval != 0)
    shape = gdn_state_shape(
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
        tp_size=tp_size,
        ssm_dtype=ssm_dtype or text.get("mamba_ssm_dtype") or DEFAULT_SSM_DTYPE,
    )
    return shape, linear


def mamba_cache_per_req(shape: LinearStateShape, num_linear_layers: int) -> int:
    """`BaseLinearStateParams.mamba_cache_per_req` (configs/mamba_utils.py:115-125): one request slot's
    main state over all linear layers; also one verify step's intermediate state over all layers."""
    return shape.step_bytes * int(num_linear_layers)


@dataclass(frozen=True)
class IntermediateStateBytes:
    """What `MambaPool` allocates for speculative verify (memory_pool.py:319-346), in bytes."""

    ssm: int
    conv: int
    slots: int  # spec_state_size + 1: one row per running request plus SGLang's padding row
    width: int  # verify tokens (tree nodes incl. the root) per request

    @property
    def total(self) -> int:
        return self.ssm + self.conv

    @property
    def per_slot(self) -> int:
        """One request slot: every node of one request's verify block, every linear layer."""
        return self.total // self.slots


def intermediate_state_bytes(
    shape: LinearStateShape, *, num_linear_layers: int, verify_width: int, max_running_requests: int
) -> IntermediateStateBytes:
    """Bytes of SGLang's per-node intermediate SSM states and conv windows for a hybrid target.

    `verify_width`: the buffers' step dimension, `max_speculative_num_draft_tokens` (`1 + budget` in
    DDTree full mode, the block size for DFLASH); `max_running_requests`: the model runner's
    `max_running_requests` after SGLang's capping (`mamba_spec_state_size`, model_runner_kv_cache_mixin.py:349;
    capped by the mamba pool in `_resolve_max_num_reqs`, :889-893). SGLang allocates
    `max_running_requests + 1` rows whatever the load: the memory is taken at start.
    """
    slots = int(max_running_requests) + 1
    steps = slots * int(verify_width) * int(num_linear_layers)
    return IntermediateStateBytes(
        ssm=steps * shape.ssm_bytes, conv=steps * shape.conv_bytes, slots=slots, width=int(verify_width)
    )


def sglang_planned_intermediate_bytes(
    shape: LinearStateShape, *, num_linear_layers: int, speculative_num_draft_tokens: int, capped_requests: int
) -> int:
    """What SGLang's memory plan sets aside for the same buffers before it sizes the KV pool
    (`handle_max_mamba_cache`, model_runner_kv_cache_mixin.py:105-109, 121-125, 158): per-request state x
    requests x `speculative_num_draft_tokens` (the DFLASH block in DDTree full mode, not `1 + budget`) and
    without the padding row. The gap to `intermediate_state_bytes` is memory the plan does not see."""
    return mamba_cache_per_req(shape, num_linear_layers) * int(capped_requests) * int(speculative_num_draft_tokens)


# ------------------------------------------------------------------------------------------ tree indices
def parents_from_retrieve(next_token: Sequence[int], next_sibling: Sequence[int]) -> list[int]:
    """The parent of every node as SGLang's tree kernels derive it (causal_conv1d_triton.py:783-830, stored
    to `retrieve_parent_token` at :977-985 and read by the GDN / Mamba-2 recurrences): nodes are visited
    in index order; node `i` makes its first child `next_token[i]` a child of `i` and its next sibling
    `next_sibling[i]` a child of `i`'s own parent. Unreached nodes (the root, padding) keep parent 0.

    Right only when a first child's index is above its parent's and siblings are chained in increasing
    index order (else a parent is read before it is set): DDTree's arrays are built that way."""
    n = len(next_token)
    parent = [0] * n
    for i in range(n):
        child = int(next_token[i])
        if child != -1:
            parent[child] = i
        sibling = int(next_sibling[i])
        if sibling != -1:
            parent[sibling] = parent[i]
    return parent


def commit_step(accepted_path: Sequence[int], commit_len: int) -> int:
    """Index, inside the request's verify block, of the node whose state is committed: the last node
    whose KV is committed. `accepted_path`: node indices by depth, root (0) first (DDTree's
    `accepted_nodes` row); `commit_len`: DFLASH's `commit_lens` entry, the tokens appended to the output
    this step (accepted drafts + bonus, fewer when the request finished on the path), which is also the
    number of KV slots committed (the root + the accepted drafts before the last appended token). Path
    offset `j` holds sequence position `seq_len_before + j`. For a chain this is DFLASH's `commit_len - 1`."""
    if commit_len < 1:
        raise ValueError(f"commit_len must be >= 1 (the root is always committed), got {commit_len}")
    return int(accepted_path[commit_len - 1])


def track_step(accepted_path: Sequence[int], commit_len: int, seq_len_before: int, interval: int) -> int:
    """Node whose state the radix cache tracks this step (`--mamba-scheduler-strategy extra_buffer`), or -1.

    DFLASH's rule (dflash_worker.py:1088-1105) on chain offsets: the step crosses a multiple `T` of
    `mamba_track_interval` when `before // I != (before + commit_len) // I`; the state after `T` tokens is
    the one after block offset `T - before - 1`, kept only when that offset was committed. On a tree the
    offset is a position on the accepted path, so the node is `accepted_path[offset]`
    (eagle_worker_v2.py:1381-1386 maps it through `accept_index` the same way)."""
    after = seq_len_before + commit_len
    if seq_len_before // interval == after // interval:
        return -1
    offset = max(after // interval * interval - seq_len_before - 1, 0)
    return int(accepted_path[offset]) if offset < commit_len else -1
