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
