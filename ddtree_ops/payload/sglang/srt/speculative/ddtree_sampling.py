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
    "filtered_probs_top_k_first",
    "sample_tree_walk",
    "target_probs",
    "tree_walk",
]


def _sorted_desc(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Stable: among equal probabilities the lower token id ranks first, so a boundary tie is cut the
    # same way on every run.
    return torch.sort(probs, dim=-1, descending=True, stable=True)


def target_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[rows, vocab]``: the distribution SGLang's sampler draws a sampled request's token from.

    Per row: ``softmax(logits / temperature)``; keep the ``top_k`` most probable tokens that also lie in
    the top-p nucleus of the unfiltered distribution (a token is kept while the mass ranked above it is
    ``<= top_p``: the sampler's "joint" order); then drop tokens below ``min_p`` times the most probable
    one; renormalise. ``top_k >= vocab`` and ``top_p >= 1`` filter nothing.
    """
    probs = torch.softmax(logits.float() / temperatures.float().view(-1, 1), dim=-1)
    sorted_p, order = _sorted_desc(probs)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device).view(1, -1)
    mass_above = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = (rank < top_ks.view(-1, 1).to(torch.int64)) & (mass_above <= top_ps.float().view(-1, 1))
    if min_ps is not None:
        keep &= sorted_p >= sorted_p[:, :1] * min_ps.float().view(-1, 1)
    keep[:, 0] = True  # the most probable token always survives
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter_(1, order, kept)
    return out / out.sum(-1, keepdim=True)


def filtered_probs_top_k_first(
    scaled_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """float32 ``[rows, vocab]``: upstream DFLASH's sampled-verify distribution (top-k first, then top-p
    over the renormalised top-k), by one sort instead of sgl_kernel's renorm kernels.

    Why: ``top_k_renorm_prob`` searches its threshold by pivoting and, on a row whose top token ties
    (greedy rows carry ``top_k = 1`` in a mixed batch; bf16 logits tie often), runs for seconds to
    minutes (flashinfer issue 1049: the same search in ``top_k_mask_logits`` hangs on such rows).
    """
    probs = torch.softmax(scaled_logits.float(), dim=-1)
    sorted_p, order = _sorted_desc(probs)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device).view(1, -1)
    keep = rank < top_ks.view(-1, 1).to(torch.int64).clamp(min=1)
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    if top_ps is not None:
        renormed = sorted_p / sorted_p.sum(-1, keepdim=True)
        mass_above = torch.cumsum(renormed, dim=-1) - renormed
        keep = mass_above < top_ps.float().view(-1, 1)
        keep[:, 0] = True
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


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
    bs, n = tree.parents.shape
    depth = int(tree.max_depth)
    device = candidates.device
    rows = torch.arange(bs, device=device)
    valid = tree.valid
    cur = torch.zeros(bs, dtype=torch.int64, device=device)
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    accepted = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=device)
    accepted[:, 0] = 0
    accept_lengths = torch.zeros(bs, dtype=torch.int64, device=device)
    for level in range(1, depth + 1):
        q_cur = probs[rows, cur]  # [bs, vocab]
        child = valid & (tree.parents == cur[:, None]) & ~done[:, None]
        q_child = torch.where(child, q_cur.gather(1, candidates), torch.zeros((), device=device))
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
    # Bonus: the last node's distribution without its children's tokens (all of them were rejected).
    q_last = probs[rows, cur]
    child = valid & (tree.parents == cur[:, None])
    drop = torch.zeros(q_last.shape, dtype=torch.int32, device=device)
    drop.scatter_add_(1, candidates, child.to(torch.int32))
    residual = torch.where(drop > 0, torch.zeros((), device=device), q_last)
    total = residual.sum(-1)
    cum = torch.cumsum(residual, dim=-1)
    drawn = torch.argmax((cum > (final_coins * total)[:, None]).to(torch.int8), dim=1)
    # total == 0 only when rounding left a coin above the children's whole mass: the last child.
    bonus = torch.where(total > 0, drawn, torch.argmax(q_last, dim=-1))
    return accepted, accept_lengths, bonus


def _utils():
    """ddtree_utils beside this file (a package import on hosts; by path in tests and benchmarks)."""
    if __package__:
        from . import ddtree_utils

        return ddtree_utils
    import importlib.util
    import sys
    from pathlib import Path

    name = "ddtree_utils_for_" + __name__
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("ddtree_utils.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


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
    bonus = predicts.to(torch.int64)[flat.gather(1, lengths[:, None]).view(-1)]
    return accepted, lengths, bonus


def tree_walk(
    tree,
    candidates: torch.Tensor,
    logits: torch.Tensor,
    *,
    sampled_rows: list[int],
    temperatures: torch.Tensor | None = None,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    use_kernel: bool = True,
    coin_scale: float = 1.0,
    max_elements: int = 1 << 25,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every request's tree: argmax for greedy rows, the sampled walk for ``sampled_rows``.

    ``logits`` float ``[bs, n, vocab]`` (after any logit processors, penalties and biases);
    sampling parameters are per request (``[bs]``), read only for the sampled rows. ``coin_scale`` < 1
    biases the walk towards drafted children (a deliberate fault, to show a distribution test's power).
    ``max_elements`` bounds the ``[requests * n, vocab]`` distributions built at once (2^25: 128 MiB
    per float32 copy; at a 152k vocabulary and n = 65, 3 requests per chunk).
    Returns ``(accepted_nodes, accept_lengths, bonus_tokens)`` (see ``follow_verified_tree``).
    """
    bs, n, vocab = logits.shape
    accepted, lengths, bonus = _utils().follow_verified_tree(tree, torch.argmax(logits, dim=-1))
    if not sampled_rows:
        return accepted, lengths, bonus
    device = logits.device
    k = len(sampled_rows)
    # Every coin up front, so the draw does not depend on how the rows are chunked below.
    coins = torch.rand((k, n), device=device, generator=generator) * coin_scale
    final_coins = torch.rand((k,), device=device, generator=generator)
    kernel = _kernel() if (use_kernel and logits.is_cuda) else None
    walk = (lambda *args: _kernel_walk(kernel, *args)) if kernel is not None else sample_tree_walk
    # The distributions take ~10 float32 copies of [requests * n, vocab] (softmax, sort values and
    # ids, cumsum, the kernel's draft buffer): chunk the requests so one chunk holds max_elements.
    per_chunk = max(1, max_elements // (n * vocab))
    for lo in range(0, k, per_chunk):
        rows = sampled_rows[lo : lo + per_chunk]
        idx = torch.tensor(rows, dtype=torch.int64, device=device)
        probs = target_probs(
            logits.index_select(0, idx).reshape(-1, vocab),
            temperatures.index_select(0, idx).repeat_interleave(n),
            top_ks.index_select(0, idx).repeat_interleave(n),
            top_ps.index_select(0, idx).repeat_interleave(n),
            None if min_ps is None else min_ps.index_select(0, idx).repeat_interleave(n),
        ).view(len(rows), n, vocab)
        acc_s, len_s, bonus_s = walk(
            _tree_rows(tree, idx), candidates.index_select(0, idx), probs,
            coins[lo : lo + len(rows)], final_coins[lo : lo + len(rows)],
        )
        del probs
        accepted = accepted.index_copy(0, idx, acc_s)
        lengths = lengths.index_copy(0, idx, len_s)
        bonus = bonus.index_copy(0, idx, bonus_s)
    return accepted, lengths, bonus


def _tree_rows(tree, idx: torch.Tensor):
    """The same DDTree restricted to the requests ``idx`` (retrive_index renumbered)."""
    import dataclasses

    n = tree.parents.shape[1]
    fields = {}
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        fields[f.name] = value.index_select(0, idx) if isinstance(value, torch.Tensor) else value
    fields["retrive_index"] = torch.arange(len(idx) * n, dtype=torch.int64, device=idx.device).view(-1, n)
    return type(tree)(**fields)
