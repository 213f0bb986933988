"""Triton fast path for ``ddtree_utils.build_ddtree`` (CUDA only; imported lazily and guarded).

Installed beside ``ddtree_utils.py``. Importing this module requires Triton; ``ddtree_utils`` falls back
to its plain torch path when the import fails, so hosts without Triton lose speed, not function. The
functions take the ``ddtree_utils`` module as their first argument (its key helpers and ``DDTree``)
instead of importing it, so neither module imports the other at import time.

Pipeline (no host-device synchronisation, so the whole call can be captured in a CUDA graph):
  1. ``_row_stats_kernel`` reads the logits once: per chunk of each row the max and the sum of
     ``exp(x - max)`` (combined into the row log-sum-exp), and the max of every sub-block of ``SUB``
     consecutive tokens.
  2. Top-K without a second full read: the row's top-K tokens (logit desc, token id asc) lie in the K
     sub-blocks with the largest maxima (ties to the lower block) -- each of K better sub-blocks would
     hold a token ranked above any token outside them. So ``_row_topk_kernel`` (one program per
     row) picks K sub-blocks out of ``vocab / SUB`` maxima, gathers their ``K * SUB`` logits and
     takes the exact top-K of those, both by radix select on order-preserving integer keys with
     ties to the lower index, then sorts just those K.
  3. ``_select_tree_kernel``: one program per request runs the per-depth beam (bitonic sorts of the
     ``(i+1)(j+1) <= budget`` candidate pairs), the global cut, node numbering, parents, the ancestor
     mask and SGLang's ``retrive_*`` arrays -- one launch for the whole selection.
``topk_logprobs_triton_glue`` keeps the first version of step 2 (torch ops) for the benchmark.
H200 figures and what each version cost: bench/RESULTS.md, "DDTree tree builder on the H200".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 64  # tokens per sub-block (the unit of the top-K prefilter)
CHUNK_SUBS = 64  # sub-blocks per program in the stats pass: 4096 tokens
# float32 key bits that are constant within a group of equal high bits, by input dtype: a bf16 value
# widened to float32 has 16 zero mantissa bits (after the order-preserving flip, all zeros or all
# ones), an fp16 value 13 (12 used: the radix takes two bits per step).
_LOW_BITS = {torch.bfloat16: 16, torch.float16: 12}
# num_warps by problem size (the key: the largest power-of-two block the kernel sorts or scans).
# Best of bench/bench_ddtree.py's sweep on the H200 (2026-11-29, batch 64, see bench/RESULTS.md);
# sizes not listed use the fallback rule at the call site, which agrees with these.
SELECT_WARPS: dict[int, int] = {256: 4, 1024: 4, 4096: 8}
TOPK_WARPS: dict[int, int] = {1024: 4, 4096: 8, 16384: 16}


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    chunk_max_ptr,
    chunk_sum_ptr,
    block_max_ptr,
    vocab,
    n_chunks,
    n_blocks,
    SUB_: tl.constexpr,
    NSUB: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    sub = tl.arange(0, NSUB)[:, None]
    lane = tl.arange(0, SUB_)[None, :]
    col = chunk * (NSUB * SUB_) + sub * SUB_ + lane
    x = tl.load(logits_ptr + row.to(tl.int64) * vocab + col, mask=col < vocab, other=float("-inf")).to(
        tl.float32
    )
    bmax = tl.max(x, axis=1)
    blk = chunk * NSUB + tl.arange(0, NSUB)
    tl.store(block_max_ptr + row.to(tl.int64) * n_blocks + blk, bmax, mask=blk < n_blocks)
    m = tl.max(bmax, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk contributes exp(-inf) = 0
    s = tl.sum(tl.sum(tl.exp(x - m_safe), axis=1), axis=0)
    tl.store(chunk_max_ptr + row * n_chunks + chunk, m)
    tl.store(chunk_sum_ptr + row * n_chunks + chunk, s)


@triton.jit
def _f32_key(x):
    """int32 whose signed order is the float order (-0.0 folded onto +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_f32(k):
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pack(score, index):
    """int64 key: descending order == (score desc, index asc); index < 2**31."""
    return (_f32_key(score).to(tl.int64) << 32) | (2147483647 - index).to(tl.int64)


@triton.jit
def _unpack(key):
    hi = (key >> 32).to(tl.int32)
    lo = key - (hi.to(tl.int64) << 32)
    return _key_f32(hi), (2147483647 - lo).to(tl.int32)


@triton.jit
def _select_tree_kernel(
    topv_ptr,  # f32 [B, D, K]
    topi_ptr,  # i64 [B, D, K]
    pair_i_ptr,  # i32 [P]
    pair_j_ptr,  # i32 [P]
    beam_score_ptr,  # f32 [B, D, N] scratch
    beam_parent_ptr,  # i32 [B, D, N] scratch
    beam_rank_ptr,  # i32 [B, D, N] scratch
    node_of_ptr,  # i32 [B, D, N] scratch
    sib_ptr,  # i64 [B, BLOCK_N1] scratch
    token_out,  # i64 [B, N]
    parent_out,  # i64 [B, N1]
    depth_out,  # i64 [B, N1]
    score_out,  # f32 [B, N1]
    rank_out,  # i64 [B, N1]
    num_out,  # i64 [B]
    mask_out,  # u8 [B, N1, N1], zeroed
    rindex_out,  # i64 [B, N1]
    rnext_out,  # i64 [B, N1]
    rsib_out,  # i64 [B, N1]
    # constexpr, not a runtime scalar: the loops below run over it, and Triton 3.6's CPU interpreter
    # cannot iterate over a runtime scalar (one compile per draft depth, which a server never changes)
    D: tl.constexpr,
    K,
    P,
    N: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr,
):
    b = tl.program_id(0)
    N1 = N + 1
    NEG_INF = float("-inf")
    beam_base = b * D * N

    # ---- per-depth beam: extend the previous beam by the top-K tokens, keep the best N ----
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < P
    pi = tl.load(pair_i_ptr + offs_p, mask=pmask, other=0)
    pj = tl.load(pair_j_ptr + offs_p, mask=pmask, other=0)
    keep = offs_p < N
    for d in range(D):
        prev = tl.load(beam_score_ptr + beam_base + (d - 1) * N + pi, mask=pmask & (d > 0), other=NEG_INF)
        root_prev = tl.where(pi == 0, 0.0, NEG_INF)
        prev = tl.where(d == 0, root_prev, prev)
        # <= 0 by construction: a child then never outscores its parent, so the global cut below
        # (ties: smaller depth first) is prefix-closed and every node_of read was written.
        lp = tl.minimum(tl.load(topv_ptr + (b * D + d) * K + pj, mask=pmask, other=NEG_INF), 0.0)
        cand = tl.where(pmask, prev + lp, NEG_INF)
        skey = tl.sort(_pack(cand, offs_p), descending=True)
        score, chosen = _unpack(skey)
        par = tl.load(pair_i_ptr + chosen, mask=keep, other=0)
        rk = tl.load(pair_j_ptr + chosen, mask=keep, other=0)
        out = beam_base + d * N + offs_p
        tl.store(beam_score_ptr + out, score, mask=keep)
        tl.store(beam_parent_ptr + out, par, mask=keep)
        tl.store(beam_rank_ptr + out, rk, mask=keep)
        tl.debug_barrier()  # the next depth reads this beam from other threads

    # ---- global cut over all depths: (score desc, depth asc, beam position asc) ----
    offs_m = tl.arange(0, BLOCK_M)
    m_total = D * N
    s_all = tl.load(beam_score_ptr + beam_base + offs_m, mask=offs_m < m_total, other=NEG_INF)
    skey = tl.sort(_pack(s_all, offs_m), descending=True)
    score, flat = _unpack(skey)
    sel = (offs_m < N) & (score > NEG_INF)
    num_valid = tl.sum(sel.to(tl.int32), axis=0)
    tl.store(node_of_ptr + beam_base + flat, offs_m + 1, mask=sel)
    tl.debug_barrier()
    dep0 = flat // N
    bpar = tl.load(beam_parent_ptr + beam_base + flat, mask=sel, other=0)
    brk = tl.load(beam_rank_ptr + beam_base + flat, mask=sel, other=0)
    pnode = tl.load(node_of_ptr + beam_base + (dep0 - 1) * N + bpar, mask=sel & (dep0 > 0), other=0)
    tok = tl.load(topi_ptr + (b * D + dep0) * K + brk, mask=sel, other=PAD)
    outm = offs_m < N
    row1 = b * N1 + 1 + offs_m
    tl.store(token_out + b * N + offs_m, tl.where(sel, tok, PAD), mask=outm)
    tl.store(parent_out + row1, tl.where(sel, pnode, -1).to(tl.int64), mask=outm)
    tl.store(depth_out + row1, tl.where(sel, dep0 + 1, 0).to(tl.int64), mask=outm)
    tl.store(score_out + row1, tl.where(sel, score, NEG_INF), mask=outm)
    tl.store(rank_out + row1, tl.where(sel, brk, -1).to(tl.int64), mask=outm)
    tl.store(parent_out + b * N1, -1)
    tl.store(depth_out + b * N1, 0)
    tl.store(score_out + b * N1, 0.0)
    tl.store(rank_out + b * N1, -1)
    tl.store(num_out + b, (num_valid + 1).to(tl.int64))

    # ---- ancestor mask and retrive_* ----
    offs_n = tl.arange(0, BLOCK_N1)
    nmask = offs_n < N1
    tl.store(rindex_out + b * N1 + offs_n, (b * N1 + offs_n).to(tl.int64), mask=nmask)
    tl.store(rnext_out + b * N1 + offs_n, tl.full([BLOCK_N1], -1, tl.int64), mask=nmask)
    tl.store(rsib_out + b * N1 + offs_n, tl.full([BLOCK_N1], -1, tl.int64), mask=nmask)
    tl.debug_barrier()
    par = tl.load(parent_out + b * N1 + offs_n, mask=nmask, other=-1).to(tl.int32)
    cur = offs_n
    mask_row = mask_out + (b * N1 + offs_n).to(tl.int64) * N1
    for _ in range(D + 1):  # one step per depth level: self, parent, grandparent, ...
        tl.store(mask_row + cur, tl.full([BLOCK_N1], 1, tl.uint8), mask=nmask)
        up = tl.load(parent_out + b * N1 + cur, mask=nmask, other=-1).to(tl.int32)
        cur = tl.where(up >= 0, up, cur)
    valid = nmask & (offs_n < num_valid + 1)
    group = tl.where(valid & (par >= 0), par, N1)
    skey = tl.sort(group.to(tl.int64) * 65536 + offs_n, descending=False)
    tl.store(sib_ptr + b * BLOCK_N1 + offs_n, skey)
    tl.debug_barrier()
    nxt = tl.load(sib_ptr + b * BLOCK_N1 + offs_n + 1, mask=offs_n + 1 < BLOCK_N1, other=N1 * 65536)
    prv = tl.load(sib_ptr + b * BLOCK_N1 + offs_n - 1, mask=offs_n >= 1, other=-65536)
    g = skey // 65536
    node = skey - g * 65536
    ng = nxt // 65536
    pg = prv // 65536
    real = g < N1
    tl.store(rsib_out + b * N1 + node, nxt - ng * 65536, mask=real & (ng == g))
    tl.store(rnext_out + b * N1 + g, node, mask=real & (pg != g))


@triton.jit
def _kth_largest(keys, valid, k, LOW_BIT: tl.constexpr):
    """Radix select: the k-th largest of int32 ``keys`` among ``valid``, two bits per step.

    Works on the biased unsigned key ``u = key + 2**31`` and returns the largest ``p`` (bits below
    ``LOW_BIT`` zero) with ``#(valid & u >= p) >= k``. Each step counts four thresholds at once
    (one reduction per two bits). Keys that come from bf16 (fp16) inputs are constant in their low
    16 (12) bits within a group of equal high bits, so those bits need no steps: compare
    ``u >> LOW_BIT`` with ``p >> LOW_BIT`` to classify.
    """
    u = keys.to(tl.int64) + 2147483648
    # a scalar derived from the keys: Triton specialises an int argument equal to 1 into a constexpr
    prefix = tl.min(u * 0, axis=0)
    digit = tl.arange(0, 4).to(tl.int64)
    for step in range((32 - LOW_BIT) // 2):
        shift = 30 - 2 * step
        thresholds = prefix + (digit << shift)
        count = tl.sum(((u[None, :] >= thresholds[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        best = tl.max(tl.where(count >= k, digit, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _select_k(keys, valid, k, LOW_BIT: tl.constexpr):
    """Mask of exactly the k best of ``keys`` (key desc, then position asc) among ``valid``."""
    p = _kth_largest(keys, valid, k, LOW_BIT)
    high = (keys.to(tl.int64) + 2147483648) >> LOW_BIT
    above = valid & (high > (p >> LOW_BIT))
    tied = valid & (high == (p >> LOW_BIT))
    need = k - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


@triton.jit
def _row_topk_kernel(
    logits_ptr,
    chunk_max_ptr,
    chunk_sum_ptr,
    block_max_ptr,
    block_scratch_ptr,  # i32 [rows, BLOCK_K]
    key_scratch_ptr,  # i64 [rows, BLOCK_K]
    topv_ptr,  # f32 [rows, K]
    topi_ptr,  # i64 [rows, K]
    vocab,
    n_chunks,
    n_blocks,
    K,
    KB,  # min(K, n_blocks), computed on the host
    SUB_: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOW_BIT: tl.constexpr,
):
    """Per row: log-sum-exp from the chunk stats, then the exact top-K (logit desc, id asc).

    Selection by radix select on order-preserving integer keys instead of sorting the row: the K best
    sub-blocks (max desc, block asc), then the K best tokens of their K * SUB logits, then a bitonic
    sort of just those K.
    """
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    cmax = tl.load(chunk_max_ptr + row * n_chunks + offs_c, mask=offs_c < n_chunks, other=float("-inf"))
    csum = tl.load(chunk_sum_ptr + row * n_chunks + offs_c, mask=offs_c < n_chunks, other=0.0)
    big = tl.max(cmax, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    lse = big_safe + tl.log(tl.sum(csum * tl.exp(cmax - big_safe), axis=0))

    # K best sub-blocks; ties on the max go to the lower block index.
    kb = KB
    offs_b = tl.arange(0, BLOCK_B)
    bvalid = offs_b < n_blocks
    bkey = _f32_key(tl.load(block_max_ptr + row64 * n_blocks + offs_b, mask=bvalid, other=float("-inf")))
    chosen = _select_k(bkey, bvalid, kb, LOW_BIT)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # chosen blocks in increasing block index
    tl.store(block_scratch_ptr + row * BLOCK_K + slot, offs_b, mask=chosen)
    tl.debug_barrier()

    # Their logits, flattened in increasing token id (blocks ascending, lanes ascending).
    offs_k = tl.arange(0, BLOCK_K)
    blk = tl.load(block_scratch_ptr + row * BLOCK_K + offs_k, mask=offs_k < kb, other=0)
    col = tl.reshape(blk[:, None] * SUB_ + tl.arange(0, SUB_)[None, :], [BLOCK_K * SUB_])
    kvalid = tl.reshape((offs_k < kb)[:, None] & (tl.arange(0, SUB_) >= 0)[None, :], [BLOCK_K * SUB_])
    cvalid = kvalid & (col < vocab)
    x = tl.load(logits_ptr + row64 * vocab + col, mask=cvalid, other=float("-inf")).to(tl.float32)
    xkey = _f32_key(x)
    chosen2 = _select_k(xkey, cvalid, K, LOW_BIT)
    slot2 = tl.cumsum(chosen2.to(tl.int32), axis=0) - 1
    tl.store(key_scratch_ptr + row * BLOCK_K + slot2, _pack(x, col), mask=chosen2)
    tl.debug_barrier()

    keys = tl.load(key_scratch_ptr + row * BLOCK_K + offs_k, mask=offs_k < K, other=-9223372036854775807)
    value, token = _unpack(tl.sort(keys, descending=True))
    # A row of only -inf logits has no token: -inf log-probs (as the torch path), not -inf - -inf.
    logprob = tl.where(lse > float("-inf"), tl.minimum(value - lse, 0.0), float("-inf"))
    tl.store(topv_ptr + row * K + offs_k, logprob, mask=offs_k < K)
    tl.store(topi_ptr + row * K + offs_k, token.to(tl.int64), mask=offs_k < K)


_PAIR_CACHE: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _pairs_i32(du, budget: int, cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (budget, cap, str(device))
    if key not in _PAIR_CACHE:
        pi, pj = du._pair_table(budget, cap, device)
        _PAIR_CACHE[key] = (pi.to(torch.int32), pj.to(torch.int32))
    return _PAIR_CACHE[key]


def _row_stats(draft_logits: torch.Tensor):
    batch, depth, vocab = draft_logits.shape
    rows = batch * depth
    logits = draft_logits.reshape(rows, vocab)
    if not logits.is_contiguous():
        logits = logits.contiguous()
    chunk = SUB * CHUNK_SUBS
    n_chunks = triton.cdiv(vocab, chunk)
    n_blocks = triton.cdiv(vocab, SUB)
    chunk_max = torch.empty((rows, n_chunks), device=logits.device, dtype=torch.float32)
    chunk_sum = torch.empty((rows, n_chunks), device=logits.device, dtype=torch.float32)
    block_max = torch.empty((rows, n_blocks), device=logits.device, dtype=torch.float32)
    _row_stats_kernel[(rows, n_chunks)](
        logits,
        chunk_max,
        chunk_sum,
        block_max,
        vocab,
        n_chunks,
        n_blocks,
        SUB_=SUB,
        NSUB=CHUNK_SUBS,
        num_warps=8,
    )
    return logits, chunk_max, chunk_sum, block_max


def topk_logprobs_triton(du, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``ddtree_utils.topk_logprobs``: two launches, the logits read once."""
    batch, depth, vocab = draft_logits.shape
    logits, chunk_max, chunk_sum, block_max = _row_stats(draft_logits)
    rows, n_chunks = chunk_max.shape
    n_blocks = block_max.shape[1]
    block_k = triton.next_power_of_2(k)
    block_scratch = torch.empty((rows, block_k), device=logits.device, dtype=torch.int32)
    key_scratch = torch.empty((rows, block_k), device=logits.device, dtype=torch.int64)
    topv = torch.empty((batch, depth, k), device=logits.device, dtype=torch.float32)
    topi = torch.empty((batch, depth, k), device=logits.device, dtype=torch.int64)
    tile = block_k * SUB
    _row_topk_kernel[(rows,)](
        logits,
        chunk_max,
        chunk_sum,
        block_max,
        block_scratch,
        key_scratch,
        topv,
        topi,
        vocab,
        n_chunks,
        n_blocks,
        k,
        min(k, n_blocks),
        SUB_=SUB,
        BLOCK_C=triton.next_power_of_2(n_chunks),
        BLOCK_B=triton.next_power_of_2(n_blocks),
        BLOCK_K=block_k,
        LOW_BIT=_LOW_BITS.get(draft_logits.dtype, 0),
        num_warps=TOPK_WARPS.get(tile, 4 if tile <= 2048 else 8 if tile <= 8192 else 16),
    )
    return topv, topi


def topk_logprobs_triton_glue(du, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first version (kept for the benchmark): stats kernel, then the top-K in torch ops."""
    batch, depth, vocab = draft_logits.shape
    logits, chunk_max, chunk_sum, block_max = _row_stats(draft_logits)
    rows, n_blocks = block_max.shape
    device = logits.device
    row_max = chunk_max.amax(1, keepdim=True)
    safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    lse = safe_max + torch.log((chunk_sum * torch.exp(chunk_max - safe_max)).sum(1, keepdim=True))

    kb = min(k, n_blocks)
    block_index = torch.arange(n_blocks, device=device)
    blocks = du._decode_keys(torch.topk(du._sort_keys(block_max, block_index), kb, dim=1).values)[1]
    cols = (blocks[:, :, None] * SUB + torch.arange(SUB, device=device)).reshape(rows, kb * SUB)
    inside = cols < vocab
    cols = torch.where(inside, cols, vocab - 1)
    values = torch.where(inside, logits.gather(1, cols).float(), float("-inf"))
    keys = torch.topk(du._sort_keys(values, cols), k, dim=1).values
    top_logits, top_ids = du._decode_keys(keys)
    values = torch.where(lse > float("-inf"), top_logits - lse, float("-inf")).clamp_(max=0.0)
    return values.view(batch, depth, k), top_ids.view(batch, depth, k)


def select_tree_triton(du, topv: torch.Tensor, topi: torch.Tensor, budget: int):
    """Same contract as ``ddtree_utils.select_tree_from_topk``, as one kernel launch (+ two fills)."""
    batch, depth, cap = topv.shape
    device = topv.device
    n = budget
    n1 = n + 1
    pair_i, pair_j = _pairs_i32(du, budget, cap, device)
    p = pair_i.numel()
    block_p = triton.next_power_of_2(p)
    block_m = triton.next_power_of_2(depth * n)
    block_n1 = triton.next_power_of_2(n1)
    f32, i64, i32 = torch.float32, torch.int64, torch.int32
    beam_score = torch.empty((batch, depth, n), device=device, dtype=f32)
    beam_parent = torch.empty((batch, depth, n), device=device, dtype=i32)
    beam_rank = torch.empty((batch, depth, n), device=device, dtype=i32)
    node_of = torch.full((batch, depth, n), -1, device=device, dtype=i32)  # -1: never a valid parent
    sib = torch.empty((batch, block_n1), device=device, dtype=i64)
    token_ids = torch.empty((batch, n), device=device, dtype=i64)
    parents = torch.empty((batch, n1), device=device, dtype=i64)
    depths = torch.empty((batch, n1), device=device, dtype=i64)
    scores = torch.empty((batch, n1), device=device, dtype=f32)
    ranks = torch.empty((batch, n1), device=device, dtype=i64)
    num_nodes = torch.empty((batch,), device=device, dtype=i64)
    mask = torch.zeros((batch, n1, n1), device=device, dtype=torch.uint8)
    rindex = torch.empty((batch, n1), device=device, dtype=i64)
    rnext = torch.empty((batch, n1), device=device, dtype=i64)
    rsib = torch.empty((batch, n1), device=device, dtype=i64)
    size = max(block_p, block_m)
    warps = SELECT_WARPS.get(size, 4 if size <= 1024 else 8 if size <= 4096 else 16)
    _select_tree_kernel[(batch,)](
        topv.contiguous(),
        topi.contiguous(),
        pair_i,
        pair_j,
        beam_score,
        beam_parent,
        beam_rank,
        node_of,
        sib,
        token_ids,
        parents,
        depths,
        scores,
        ranks,
        num_nodes,
        mask,
        rindex,
        rnext,
        rsib,
        depth,
        cap,
        p,
        N=n,
        PAD=du.PAD_TOKEN_ID,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
        BLOCK_N1=block_n1,
        num_warps=warps,
    )
    return du.DDTree(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        num_nodes=num_nodes,
        tree_mask=mask.view(torch.bool),
        scores=scores,
        token_ranks=ranks,
        retrive_index=rindex,
        retrive_next_token=rnext,
        retrive_next_sibling=rsib,
        budget=budget,
        max_depth=depth,
    )


def build_ddtree_triton(du, draft_logits: torch.Tensor, budget: int, cap: int):
    topv, topi = topk_logprobs_triton(du, draft_logits, cap)
    return select_tree_triton(du, topv, topi, budget)
