"""How large a DDTree a full-mode verify step can afford (installed as
`sglang/srt/speculative/ddtree_step_budget.py` by the ddtree-ops payload; pure arithmetic, no torch).

A tree verify writes `1 + b` KV slots per request into its `req_to_token` row, feeds `bs * (1 + b)`
tokens through the target (fp32 logits of `vocab` floats each) and builds a custom mask of
`(1 + b) * (prefix + 1 + b)` bytes per request. The configured budget is the most a step uses; a step
whose batch cannot afford it takes the largest smaller budget on a fixed ladder (the Triton kernels
specialise on the budget, so a ladder bounds the compiled variants), and verifies linearly (upstream
DFLASH, which upstream sizes for) only when not even a one-node tree fits.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes a verify token costs beyond the KV cache, per vocabulary entry and per hidden unit: the
# logits in the model dtype and in fp32 plus one fp32 temporary (argmax / softmax) per vocab entry;
# residual stream, attention and MLP intermediates per hidden unit (MLPs run at ~3-4x hidden, in
# bf16, with a few live copies). Deliberately generous: a step that fits this never runs out.
BYTES_PER_VOCAB_ENTRY = 2 + 4 + 4
BYTES_PER_HIDDEN_UNIT = 64


def verify_graph_mask_bytes(max_bs: int, width: int, row_width: int) -> int:
    """The triton backend's CUDA-graph custom-mask buffer: a step's mask is `width * sum(prefix_i + width)`
    bytes and a prefix reaches at most the req_to_token row, so `max_bs` rows of `width * (row + width)`."""
    return int(max_bs) * int(width) * (int(row_width) + int(width))


def verify_graph_buffer_bytes(
    max_bs: int, width: int, *, row_width: int, context_len: int, heads: int, kv_splits: int, v_head_dim: int
) -> int:
    """Every static buffer the triton backend's `init_cuda_graph_state` allocates for `max_bs` requests of
    `width` tokens: decode scratch (attention logits and log-sum-exp, split counts: float32 / int32), the KV
    indices over the context (int64) and the custom mask (`verify_graph_mask_bytes`)."""
    tokens = int(max_bs) * int(width)
    scratch = 4 * tokens * int(heads) * int(kv_splits) * (int(v_head_dim) + 1) + 4 * tokens
    return scratch + 8 * tokens * int(context_len) + verify_graph_mask_bytes(max_bs, width, row_width)


def budget_ladder(budget: int) -> list[int]:
    """The budgets a step may use, largest first: the configured one, then 2^k - 1 below it."""
    ladder = [int(budget)]
    k = max(1, int(budget).bit_length())
    while k >= 1:
        b = (1 << k) - 1
        if b < ladder[-1]:
            ladder.append(b)
        k -= 1
    return ladder


def verify_token_bytes(vocab: int, hidden: int) -> int:
    return BYTES_PER_VOCAB_ENTRY * int(vocab) + BYTES_PER_HIDDEN_UNIT * int(hidden)


def max_verify_tokens_for(free_bytes: int, *, vocab: int, hidden: int, share: float = 0.5) -> int:
    """Verify tokens per step that `share` of the memory free after start-up can carry."""
    return max(0, int(free_bytes * share) // verify_token_bytes(vocab, hidden))


@dataclass(frozen=True)
class StepLimits:
    """What bounds one step's tree; read off the batch (host copies only) and the start-up sizing."""

    row_width: int  # req_to_token.shape[1]: slots a request's row can address
    max_verify_tokens: int  # bs * (1 + b) may not exceed this (logits + activations)
    max_mask_bytes: int  # the custom mask of the step may not exceed this


def _width_fits(n: int, batch_size: int, prefix_total: int, limits: StepLimits) -> bool:
    """`n` verify tokens per request within the logits and mask limits."""
    return batch_size * n <= limits.max_verify_tokens and n * prefix_total + batch_size * n * n <= limits.max_mask_bytes


def step_budget(
    budget: int,
    *,
    batch_size: int,
    max_seq_len: int,
    prefix_total: int,
    limits: StepLimits,
) -> int:
    """The budget this step's tree may use (0: verify linearly this step).

    `max_seq_len` is the longest committed sequence in the batch (its row must hold
    `seq_len + 1 + b` slots), `prefix_total` the sum of committed lengths (the mask's prefix part).
    """
    for b in budget_ladder(budget):
        n = 1 + b
        if max_seq_len + n <= limits.row_width and _width_fits(n, batch_size, prefix_total, limits):
            return b
    return 0


def padded_step_budget(
    budget: int,
    *,
    width: int,
    batch_size: int,
    max_seq_len: int,
    prefix_total: int,
    limits: StepLimits,
) -> int | None:
    """The tree budget of a step padded to `width` verify tokens per request (the verify CUDA graphs'
    width, `1 + budget`), or None when it cannot be padded.

    A padded step's logits and custom mask are those of the whole width, whatever its tree; only its
    tree's `1 + b` slots are written into the request's req_to_token row (the padding's KV goes to
    SGLang's dummy slot). So the width must fit the logits and mask limits (else the step shrinks
    unpadded, `step_budget`), and the largest ladder budget whose tree fits the row is taken, down to
    0: the root alone, a plain decode step on the same graph.
    """
    if not _width_fits(int(width), batch_size, prefix_total, limits):
        return None
    for b in [*budget_ladder(budget), 0]:
        if max_seq_len + 1 + b <= limits.row_width:
            return b
    return None


@dataclass(frozen=True)
class VerifySizing:
    """A full-mode server's verify memory, sized once at start: the steps' limits and what is reserved."""

    max_verify_tokens: int
    max_mask_bytes: int
    walk_bytes: int  # one sampled walk's distributions and scratch (ddtree_sampling.walk_bytes)
    reserve_bytes: int


def size_verify_steps(
    free_bytes: int,
    *,
    max_running: int,
    width: int,
    block_size: int,
    row_width: int,
    vocab: int,
    hidden: int,
    walk_bytes: int,
    override_tokens: int | None = None,
) -> VerifySizing | str:
    """The verify limits that the free device memory after start-up affords, or why it affords none.

    The worst step holds every running request's full tree (`max_running * width` tokens, a mask of
    `width * (row + width)` bytes each) and one sampled walk. The walk must fit whole (its chunk holds
    at least one request's `width` distributions); the mask takes at most a quarter of what is left,
    the tokens half of the rest (`max_verify_tokens_for`). A step beyond the limits shrinks its tree;
    fewer tokens than linear DFLASH verifies (`max_running * block_size`) refuses the start.
    """
    worst_tokens = int(max_running) * int(width)
    worst_mask = verify_graph_mask_bytes(max_running, width, row_width)
    left = int(free_bytes) - int(walk_bytes)
    if left <= 0:
        return (
            f"{free_bytes / 2**30:.2f} GiB free after start-up cannot hold one sampled walk over {width} "
            f"verify tokens ({walk_bytes / 2**30:.2f} GiB). Lower --speculative-ddtree-budget or "
            "--mem-fraction-static."
        )
    mask = min(worst_mask, left // 4)
    tokens = min(worst_tokens, max_verify_tokens_for(left - mask, vocab=vocab, hidden=hidden))
    if override_tokens is not None:
        tokens = min(tokens, int(override_tokens))
    floor = min(worst_tokens, int(max_running) * int(block_size))
    if tokens < floor:
        return (
            f"{free_bytes / 2**30:.2f} GiB free after start-up holds {tokens} verify tokens per step, fewer "
            f"than linear DFLASH needs ({floor}). Lower --mem-fraction-static or --max-running-requests."
        )
    reserve = tokens * verify_token_bytes(vocab, hidden) + mask + int(walk_bytes)
    return VerifySizing(max_verify_tokens=tokens, max_mask_bytes=mask, walk_bytes=int(walk_bytes), reserve_bytes=reserve)
