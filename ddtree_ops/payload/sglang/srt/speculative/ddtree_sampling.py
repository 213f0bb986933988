"""Sampled verification of a DDTree (T > 0), and the target distributions it samples from.

Installed on hosts as ``sglang/srt/speculative/ddtree_sampling.py``. Imports only torch; on CUDA the
walk runs in sgl_kernel's ``tree_speculative_sampling_target_only`` when it is importable, and the
plain torch walk here is the same rule (the CPU path and the tests' reference).

Why sampling on the tree is lossless: at a node with target distribution ``q`` and children carrying
the distinct tokens ``t_1 .. t_m`` (in node order), draw one coin ``u ~ U[0, 1)`` and move to the first
child ``t_j`` with ``u <= q(t_1) + .. + q(t_j)``; when there is none, the bonus token is drawn from
``q`` with ``t_1 .. t_m`` removed and renormalised. Each child is taken with probability ``q(t_j)``
and every other token with probability ``q(t)``: the emitted token is an exact sample of ``q``, and
the next node's ``q`` is the target's distribution after that token, so the walk emits exactly what
plain sampling emits, token by token. This is speculative sampling with a zero draft distribution
(SGLang's target-only tree sampling with thresholds 1.0).

Greedy requests (``top_k <= 1``) take the argmax walk (``follow_verified_tree``); both kinds share a
tree step, so one sampled request never turns the tree off for the batch.
"""

from __future__ import annotations

import torch

__all__ = [
    "SAMPLING_RULES",
    "sample_tree_walk",
    "target_probs",
    "tree_walk",
]

TOP_K_ALL = 1 << 30  # SGLang's "no top-k" (sampling_params.TOP_K_ALL)
# Plain SGLang's filter semantics per --sampling-backend (layers/sampler.py):
# - "pytorch": top_k_top_p_min_p_sampling_from_probs_torch: top-k and top-p together on the sorted
#   probabilities (a token is dropped at rank >= k or when the running sum before it, cum - p, exceeds
#   top_p), then min-p against the most probable token;
# - "flashinfer": top_k_top_p_sampling_from_probs(filter_apply_order="joint") keeps a token when fewer
#   than k tokens and less than top_p of the mass are strictly more probable (ties kept together); with
#   min-p it renormalises in turn: top-k (top_k_renorm_prob), then top-p over what is left
#   (top_p_renorm_prob, none at top_p >= 1), then min-p (min_p_sampling_from_probs).
SAMPLING_RULES = ("pytorch", "flashinfer")


def _sorted_desc(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The torch sampler's own call: which of two equally probable tokens ranks first (and so survives a
    # top-k or top-p boundary between them) is the sort's choice, and this makes the same one.
    return probs.sort(dim=-1, descending=True)


def _strictly_above(sorted_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sorted position: how many tokens, and how much mass, are strictly more probable (a
    run of equal probabilities shares its first member's figures)."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device).expand_as(sorted_p)
    new_run = torch.ones_like(sorted_p, dtype=torch.bool)
    new_run[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]
    first = torch.where(new_run, rank, torch.zeros_like(rank)).cummax(dim=-1).values
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    return first, mass_before.gather(-1, first)


def _keep_pytorch(sorted_p: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device).view(1, -1)
    keep = (rank < k.view(-1, 1)) & ~((torch.cumsum(sorted_p, dim=-1) - sorted_p) > p.view(-1, 1))
    return keep & ~(sorted_p < sorted_p[:, :1] * min_p.view(-1, 1))


def _keep_flashinfer(sorted_p: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    count, mass = _strictly_above(sorted_p)
    joint = (count < k.view(-1, 1)) & (mass < p.view(-1, 1))
    # With min-p the filters apply in turn, each on the renormalised survivors of the one before.
    top_k = count < k.view(-1, 1)
    renormed = torch.where(top_k, sorted_p, torch.zeros_like(sorted_p))
    renormed = renormed / renormed.sum(-1, keepdim=True)
    _, mass_k = _strictly_above(renormed)
    in_turn = top_k & ((mass_k < p.view(-1, 1)) | (p.view(-1, 1) >= 1.0))
    in_turn &= sorted_p >= sorted_p[:, :1] * min_p.view(-1, 1)
    return torch.where((min_p > 0).view(-1, 1), in_turn, joint)


def target_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None = None,
    *,
    rule: str = "pytorch",
    max_elements: int = 1 << 24,
) -> torch.Tensor:
    """float32 ``[rows, vocab]``: the distribution plain SGLang samples a request's token from.

    Per row ``softmax(logits / temperature)`` (float32, as the sampler divides and softmaxes in place),
    filtered by ``rule`` (see SAMPLING_RULES) and renormalised. A row at the identity settings
    (top_k all, top_p 1, min_p 0) is not filtered at all: plain samples it unfiltered (a filter at
    top_p 1 would still drop the tail where the float32 running sum passes 1), and it is not sorted
    either: only the filtered rows are (on a 152k vocabulary the sort of every row of a batch-64
    verify cost 21-27 ms of GPU time a step on the H200, as much as the 8B target's forward).
    Rows are processed ``max_elements`` entries at a time, so the sorting scratch is bounded whatever
    the row count.
    """
    if rule not in SAMPLING_RULES:
        raise ValueError(f"unknown sampling rule {rule!r}; one of {SAMPLING_RULES}")
    rows, vocab = logits.shape
    device = logits.device
    min_ps = torch.zeros(rows, device=device) if min_ps is None else min_ps.float()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    keep_fn = _keep_pytorch if rule == "pytorch" else _keep_flashinfer
    step = max(1, max_elements // vocab)
    for lo in range(0, rows, step):
        sl = slice(lo, lo + step)
        probs = torch.softmax(logits[sl].float() / temperatures[sl].float().view(-1, 1), dim=-1)
        out[sl] = probs
        k, p, m = top_ks[sl].to(torch.int64), top_ps[sl].float(), min_ps[sl]
        # One host sync per chunk, outside any graph: the walk that calls this copies its result back anyway.
        rows_f = ((k < TOP_K_ALL) | (p != 1.0) | (m > 0)).nonzero().view(-1)
        if rows_f.numel() == 0:
            continue
        sub = probs.index_select(0, rows_f)
        sorted_p, order = _sorted_desc(sub)
        keep = keep_fn(sorted_p, k.index_select(0, rows_f), p.index_select(0, rows_f), m.index_select(0, rows_f))
        kept = torch.zeros_like(sub).scatter_(1, order, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
        out.index_copy_(0, rows_f + lo, kept / kept.sum(-1, keepdim=True))
    return out


def sample_tree_walk(
    tree,
    candidates: torch.Tensor,
    probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled walk in plain torch (see the module docstring), batched over requests.

    ``tree``: a ``DDTree`` (or a row subset of one); ``candidates`` int64 ``[bs, n]`` root token then
    node tokens; ``probs`` float32 ``[bs, n, vocab]`` the target distribution at every node;
    ``coins`` float32 ``[bs, n]`` one ``U[0, 1)`` coin per node (used at the node it belongs to);
    ``final_coins`` float32 ``[bs]`` the coin of the bonus draw.
    Returns ``(accepted_nodes, accept_lengths, bonus_tokens)`` as ``follow_verified_tree`` does.
    """
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    node_probs = probs[rows[:, None], tree.parents.clamp(min=0), candidates]
    accepted, lengths, last = walk_node_probs(tree, node_probs, coins)
    return accepted, lengths, _draw_bonus(tree, candidates, probs[rows, last], last, final_coins)


def walk_node_probs(tree, node_probs: torch.Tensor, coins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk's descent alone: ``node_probs`` float32 ``[bs, n]``, node ``i``'s token's probability under
    its parent's distribution (the root's is never read). Returns ``(accepted_nodes, accept_lengths,
    last_node)``; the bonus is drawn from the last node's distribution (``_draw_bonus``). Plain torch: the
    reference of ``ddtree_verify_kernels.sampled_walk_triton``."""
    bs, n = tree.parents.shape
    depth = int(tree.max_depth)
    device = node_probs.device
    valid = tree.valid
    cur = torch.zeros(bs, dtype=torch.int64, device=device)
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    accepted = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=device)
    accepted[:, 0] = 0
    accept_lengths = torch.zeros(bs, dtype=torch.int64, device=device)
    for level in range(1, depth + 1):
        child = valid & (tree.parents == cur[:, None]) & ~done[:, None]
        q_child = torch.where(child, node_probs, torch.zeros((), device=device))
        coin = coins.gather(1, cur[:, None])
        # The kernel's rule: accumulate the children's mass in node order, take the first child
        # whose running sum reaches the coin (or that holds all the mass).
        ok = child & ((coin <= torch.cumsum(q_child, dim=1)) | (q_child >= 1.0))
        moved = ok.any(1)
        nxt = torch.argmax(ok.to(torch.int8), dim=1)
        cur = torch.where(moved, nxt, cur)
        accepted[:, level] = torch.where(moved, nxt, -1)
        accept_lengths += moved.to(torch.int64)
        done |= ~moved
    return accepted, accept_lengths, cur


def _draw_bonus(tree, candidates: torch.Tensor, q: torch.Tensor, last: torch.Tensor, final_coins: torch.Tensor) -> torch.Tensor:
    """The bonus token: drawn from ``q`` (``[bs, vocab]``, the last node's distribution) without its
    children's tokens (all of them were rejected), by the final coin."""
    residual, total = _residual(tree, candidates, q, last)
    cum = torch.cumsum(residual, dim=-1)
    drawn = torch.argmax((cum > (final_coins * total)[:, None]).to(torch.int8), dim=1)
    return _leftover_bonus(tree, candidates, q, last, total, drawn)


def _residual(tree, candidates: torch.Tensor, q: torch.Tensor, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (node ``cur``'s distribution, ``[bs, vocab]``) without its children's tokens, and its total mass."""
    child = tree.valid & (tree.parents == cur[:, None])
    drop = torch.zeros(q.shape, dtype=torch.int32, device=q.device)
    drop.scatter_add_(1, candidates, child.to(torch.int32))
    residual = torch.where(drop > 0, torch.zeros((), device=q.device), q)
    return residual, residual.sum(-1)


def _leftover_bonus(tree, candidates, q, cur, total, drawn) -> torch.Tensor:
    """The bonus token, with the leftover case resolved: when the children of the last node cover all
    of its distribution ``q`` (``total`` 0), the walk stopped there only because float32 rounding left the
    coin above the children's summed mass (exactly 1); that coin falls in the last child's share, so
    that child's token is the sample (sgl_kernel's draw from the empty residual returns vocab - 1)."""
    rows = torch.arange(cur.shape[0], device=cur.device)
    child = tree.valid & (tree.parents == cur[:, None]) & (q.gather(1, candidates) > 0)
    last = (child.to(torch.int64) * torch.arange(child.shape[1], device=cur.device)).argmax(1)
    return torch.where(total > 0, drawn, candidates[rows, last])


def _utils():
    """ddtree_utils beside this file."""
    return _sibling("ddtree_utils")


def _fused_kernels(t: torch.Tensor):
    """`ddtree_verify_kernels` where the verify step uses its kernels for `t` (ddtree_verify_step), else None."""
    return _sibling("ddtree_verify_step")._fused(t)


def _sibling(name: str):
    """A payload module beside this file (a package import on hosts; by path in tests and benchmarks)."""
    if __package__:
        import importlib

        return importlib.import_module(f"{__package__}.{name}")
    import importlib.util
    import sys
    from pathlib import Path

    key = f"{name}_for_{__name__}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]


def _kernel():
    try:
        from sgl_kernel import tree_speculative_sampling_target_only
    except Exception:  # no sgl_kernel (CPU hosts, tests): the torch walk is the same rule
        return None
    return tree_speculative_sampling_target_only


def _kernel_walk(kernel, tree, candidates, probs, coins, final_coins):
    bs, n = candidates.shape
    depth = int(tree.max_depth)
    device = candidates.device
    predicts = torch.empty((bs * n,), dtype=torch.int32, device=device)
    accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32, device=device)
    accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
    kernel(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates.contiguous(),
        retrive_index=torch.arange(bs * n, dtype=torch.int64, device=device).view(bs, n),
        retrive_next_token=tree.retrive_next_token.contiguous(),
        retrive_next_sibling=tree.retrive_next_sibling.contiguous(),
        uniform_samples=coins.contiguous(),
        uniform_samples_for_final_sampling=final_coins.contiguous(),
        target_probs=probs.contiguous(),
        draft_probs=torch.zeros_like(probs),
        threshold_single=1.0,
        threshold_acc=1.0,
        deterministic=True,
    )
    lengths = accept_num.to(torch.int64)
    flat = accept_index.to(torch.int64)
    on_path = torch.arange(depth + 1, device=device)[None, :] <= lengths[:, None]
    local = flat - torch.arange(bs, device=device)[:, None] * n
    accepted = torch.where(on_path, local, -1)
    drawn = predicts.to(torch.int64)[flat.gather(1, lengths[:, None]).view(-1)]
    last = accepted.gather(1, lengths[:, None]).view(-1)
    q = probs[torch.arange(bs, device=device), last]
    _, total = _residual(tree, candidates, q, last)
    return accepted, lengths, _leftover_bonus(tree, candidates, q, last, total, drawn)


def sampled_rows(reqs: list) -> list[int]:
    """Requests whose next token is sampled (top_k > 1 after SGLang's normalisation: T = 0 sets top_k 1); read
    per request from host data, never from the batch's merged `is_all_greedy` flag."""
    return [i for i, req in enumerate(reqs) if int(req.sampling_params.top_k) > 1]


def unfiltered_rows(reqs: list, rows: list[int]) -> list[int]:
    """Of ``rows``, the requests sampled at the identity settings (top_k all, top_p 1, min_p 0: plain samples the
    whole softmax), from the host's sampling params the batch's tensors are made of. A row left out here takes the
    filtered path, which finds its own filters on the device: leaving one out is never wrong, only slower."""
    out = []
    for i in rows:
        params = reqs[i].sampling_params
        if int(params.top_k) >= TOP_K_ALL and float(params.top_p) == 1.0 and float(params.min_p or 0.0) <= 0.0:
            out.append(i)
    return out


def tree_walk(
    tree,
    candidates: torch.Tensor,
    logits: torch.Tensor,
    *,
    sampled_rows: list[int],
    unfiltered: list[int] | None = None,
    temperatures: torch.Tensor | None = None,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    use_kernel: bool = True,
    coin_scale: float = 1.0,
    rule: str = "pytorch",
    max_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every request's tree: argmax for greedy rows, the sampled walk for ``sampled_rows``.

    ``logits`` float ``[bs, n, vocab]`` (after penalties and biases); sampling parameters are per
    request (``[bs]``), read only for the sampled rows; ``rule``: the server's --sampling-backend
    (``target_probs``). ``unfiltered``: the sampled rows at the identity settings (``unfiltered_rows``, host
    data); None: found on the device (one host sync). Those rows need no distribution per node: each node's
    row is read once for its log-sum-exp, the walk reads its children's probabilities, and only the last
    node's distribution is made, for the bonus (``_unfiltered_walk``). The filtered rows' distributions are
    made per node, a chunk of requests at a time (``_filtered_walk``). ``coin_scale`` < 1 biases the walk
    towards drafted children (a deliberate fault, to show a distribution test's power). Memory
    (``walk_bytes``): the distributions of one chunk of requests (``[requests * n, vocab]`` float32 and the
    kernel's zero draft copy), a chunk holding ``max_elements`` entries or one request, plus
    ``target_probs``' sorting scratch.
    Returns ``(accepted_nodes, accept_lengths, bonus_tokens)`` (see ``follow_verified_tree``).
    """
    bs, n, vocab = logits.shape
    device = logits.device
    k = len(sampled_rows)
    if k < bs:
        accepted, lengths, bonus = _greedy_walk(tree, candidates, torch.argmax(logits, dim=-1))
    else:  # every row is sampled: no argmax, no greedy walk (on a GPU its launches were most of a small walk's time)
        accepted = torch.full((bs, int(tree.max_depth) + 1), -1, dtype=torch.int64, device=device)
        lengths = torch.zeros((bs,), dtype=torch.int64, device=device)
        bonus = torch.zeros((bs,), dtype=torch.int64, device=device)
    if not sampled_rows:
        return accepted, lengths, bonus
    # Every coin up front, so the draw does not depend on how the rows are split and chunked below.
    coins = torch.rand((k, n), device=device, generator=generator) * coin_scale
    final_coins = torch.rand((k,), device=device, generator=generator)
    every = torch.tensor(sampled_rows, dtype=torch.int64, device=device)
    if unfiltered is None:
        flags = (top_ks.index_select(0, every).to(torch.int64) < TOP_K_ALL) | (top_ps.index_select(0, every).float() != 1.0)
        if min_ps is not None:
            flags |= min_ps.index_select(0, every).float() > 0
        unfiltered = [row for row, f in zip(sampled_rows, flags.tolist(), strict=True) if not f]
    plain = set(unfiltered)
    for kind, walk_rows in ((True, _unfiltered_walk), (False, _filtered_walk)):
        at = [j for j, row in enumerate(sampled_rows) if (row in plain) == kind]
        if not at:
            continue
        if len(at) == k:
            idx, row_coins, row_final = every, coins, final_coins
        else:
            idx = every[at]
            row_coins, row_final = coins[at], final_coins[at]
        params = (temperatures, top_ks, top_ps, min_ps)
        if len(at) == bs and sampled_rows == list(range(bs)):  # every row, in order: nothing to gather or scatter
            return walk_rows(tree, candidates, logits, idx, params, row_coins, row_final,
                             use_kernel=use_kernel, rule=rule, max_elements=max_elements)
        params = [None if t is None else t.index_select(0, idx) for t in params]
        acc_s, len_s, bonus_s = walk_rows(
            _tree_rows(tree, idx), candidates.index_select(0, idx), logits, idx, params, row_coins, row_final,
            use_kernel=use_kernel, rule=rule, max_elements=max_elements,
        )
        accepted = accepted.index_copy(0, idx, acc_s)
        lengths = lengths.index_copy(0, idx, len_s)
        bonus = bonus.index_copy(0, idx, bonus_s)
    return accepted, lengths, bonus


def _greedy_walk(tree, candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """follow_verified_tree's (accepted, lengths, bonus), by the verify step's one-launch kernel where it serves."""
    kernels = _fused_kernels(target)
    if kernels is None:
        return _utils().follow_verified_tree(tree, target)
    depth = int(tree.max_depth)
    accepted, packed = kernels.greedy_walk_triton(tree, candidates, target)
    return accepted, packed[:, depth], packed[:, depth + 1]


def _unfiltered_walk(trees, cands, logits, idx, params, coins, final_coins, *, max_elements: int, **_):
    """Requests ``idx`` at the identity settings: plain's probability of token t at a node is
    ``exp(logit / T - logsumexp(logits / T))`` (its softmax, to float32 rounding), so a node's row is read once
    for its log-sum-exp, the walk takes its children's probabilities from those, and only the last node's
    distribution is made, for the bonus."""
    bs, n, vocab = logits.shape
    k = idx.shape[0]
    flat = logits.reshape(bs * n, vocab)
    temps = params[0].float().view(-1)  # SGLang's are [bs, 1]
    kernels = _fused_kernels(logits)
    node_rows = (idx[:, None] * n + torch.arange(n, device=idx.device)).view(-1)
    if kernels is not None:
        lse = kernels.row_logsumexp_triton(flat, node_rows, temps.repeat_interleave(n)).view(k, n)
    else:
        lse = _row_logsumexp(flat, node_rows, temps.repeat_interleave(n), max_elements).view(k, n)
    parents = trees.parents.clamp(min=0)
    at_parent = flat.view(-1)[((idx[:, None] * n + parents) * vocab + cands).view(-1)].view(k, n).float()
    node_probs = torch.exp(at_parent / temps[:, None] - lse.gather(1, parents))
    if kernels is not None:
        accepted, lengths, last = kernels.sampled_walk_triton(trees, node_probs, coins)
    else:
        accepted, lengths, last = walk_node_probs(trees, node_probs, coins)
    last_lse = lse.gather(1, last[:, None])

    def bonus(lo: int, hi: int, rows) -> torch.Tensor:  # the last nodes' distributions of requests lo:hi
        q = torch.exp(flat.index_select(0, idx[lo:hi] * n + last[lo:hi]).float() / temps[lo:hi, None] - last_lse[lo:hi])
        return _draw_bonus(rows, cands[lo:hi], q, last[lo:hi], final_coins[lo:hi])

    per_chunk = max(1, max_elements // vocab)
    if k <= per_chunk:
        return accepted, lengths, bonus(0, k, trees)
    return accepted, lengths, torch.cat([bonus(lo, lo + per_chunk, _tree_slice(trees, lo, lo + per_chunk))
                                         for lo in range(0, k, per_chunk)])


def _row_logsumexp(x: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, max_elements: int) -> torch.Tensor:
    """float32 ``logsumexp(x[rows] / temperatures)`` per row, ``max_elements`` entries at a time (the reference of
    ``ddtree_verify_kernels.row_logsumexp_triton``)."""
    step = max(1, max_elements // x.shape[1])
    return torch.cat([
        torch.logsumexp(x.index_select(0, rows[lo:lo + step]).float() / temperatures[lo:lo + step, None], dim=-1)
        for lo in range(0, rows.shape[0], step)
    ])


def _filtered_walk(trees, cands, logits, idx, params, coins, final_coins, *, use_kernel: bool, rule: str,
                   max_elements: int):
    """Requests ``idx`` with filters (or not known to have none): the target distribution at every node
    (``target_probs``), walked in chunks of requests, by sgl_kernel's walk where it is importable."""
    bs, n, vocab = logits.shape
    k = idx.shape[0]
    kernel = _kernel() if (use_kernel and logits.is_cuda) else None
    walk = (lambda *args: _kernel_walk(kernel, *args)) if kernel is not None else sample_tree_walk
    # What every chunk needs, gathered once: a chunk is then a slice of it (the walk's time at T > 0 was its
    # chunks' launches and host syncs, at 6 requests a chunk on a 152k vocabulary).
    temps, ks, ps, mps = [None if t is None else t.repeat_interleave(n) for t in params]
    per_chunk = max(1, max_elements // (n * vocab))
    chunks = [(lo, min(k, lo + per_chunk)) for lo in range(0, k, per_chunk)]
    outs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for lo, hi in chunks:
        tokens = slice(lo * n, hi * n)
        probs = target_probs(
            logits.index_select(0, idx[lo:hi]).reshape(-1, vocab), temps[tokens], ks[tokens], ps[tokens],
            None if mps is None else mps[tokens], rule=rule, max_elements=max_elements,
        ).view(hi - lo, n, vocab)
        rows = trees if len(chunks) == 1 else _tree_slice(trees, lo, hi)
        outs.append(walk(rows, cands[lo:hi], probs, coins[lo:hi], final_coins[lo:hi]))
        del probs
    return outs[0] if len(outs) == 1 else tuple(torch.cat(parts) for parts in zip(*outs, strict=True))


def _tree_rows(tree, idx: torch.Tensor):
    """The same DDTree restricted to the requests ``idx`` (retrive_index renumbered)."""
    return _renumbered(tree, lambda value: value.index_select(0, idx))


def _tree_slice(tree, lo: int, hi: int):
    """Requests ``lo:hi`` of a DDTree (views; retrive_index renumbered)."""
    return _renumbered(tree, lambda value: value[lo:hi])


def _renumbered(tree, rows):
    import dataclasses

    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    fields = {name: rows(value) if isinstance(value, torch.Tensor) else value for name, value in fields.items()}
    batch, n = fields["parents"].shape
    fields["retrive_index"] = torch.arange(batch * n, dtype=torch.int64, device=fields["parents"].device).view(-1, n)
    return type(tree)(**fields)


# Bytes per entry of target_probs' scratch (softmax, sorted values and int64 ids, running sums, masks,
# the scattered result) and per entry of a walk chunk's distributions (float32 and the kernel's zero
# draft copy, the logits' row copy): what `walk_bytes` sizes.
SCRATCH_BYTES_PER_ENTRY = 48
CHUNK_BYTES_PER_ENTRY = 12


def walk_bytes(width: int, vocab: int, max_elements: int = 1 << 24) -> int:
    """Peak device memory of one sampled walk (``tree_walk``) at ``width`` verify tokens per request."""
    chunk = max(max_elements, int(width) * int(vocab))
    return CHUNK_BYTES_PER_ENTRY * chunk + SCRATCH_BYTES_PER_ENTRY * max_elements
