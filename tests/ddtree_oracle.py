"""Test helpers for DDTree: the best-first heap oracle, a tiny float64 causal LM, drafters, decoders.

The heap oracle is the reference algorithm (what the DDTree reference and the SGLang port do): one
request at a time, pop the best frontier node, push its children. Its key reproduces the builder's
documented tie order: ``(-score, depth, pop index of the parent, token rank)``.
"""

from __future__ import annotations

import heapq
import importlib.util
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

_MODULE_PATH = (
    Path(__file__).resolve().parents[1] / "ddtree_ops/payload/sglang/srt/speculative/ddtree_utils.py"
)


def load_payload_module(stem: str = "ddtree_utils"):
    """Import a payload module (`ddtree_utils`, `ddtree_sampling`, ...) by path, as a host would see it:
    a standalone torch-only file beside the others."""
    name = f"{stem}_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _MODULE_PATH.with_name(f"{stem}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_ddtree_utils():
    return load_payload_module("ddtree_utils")


def tree_tensor_fields() -> list[str]:
    """The payload DDTree's tensor fields, in declaration order (budget and max_depth are ints)."""
    return [f.name for f in fields(load_ddtree_utils().DDTree) if f.name not in ("budget", "max_depth")]


def f32(x: float) -> float:
    """Round a Python float to float32 (a sum of two float32 values rounded once is the float32 sum)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class OracleTree:
    tokens: list[int]  # per non-root node, pop order
    parents: list[int]  # per node incl. root (-1)
    depths: list[int]
    scores: list[float]
    ranks: list[int]  # per node incl. root (-1)
    paths: list[tuple[int, ...]]  # per node incl. root (())


def oracle_logprobs(logits_row: torch.Tensor) -> list[list[float]]:
    """float32 log-probs exactly as the builder defines them: logits - logsumexp(logits); a position
    whose logits are all -inf has no token: -inf everywhere."""
    x = logits_row.float()
    rows = (x - torch.logsumexp(x, dim=-1, keepdim=True)).tolist()
    return [
        [float("-inf")] * len(row) if all(v == float("-inf") for v in raw) else row
        for row, raw in zip(rows, x.tolist(), strict=True)
    ]


def ranked_candidates(
    logits_row: torch.Tensor, budget: int, topk_cap: int | None
) -> tuple[list[list[float]], list[list[int]]]:
    """(log-probs per position, the top-cap token ids per position): tokens ranked by logit, then id
    (see the builder's docs), cap = min(topk_cap or budget, budget, vocab)."""
    vocab = logits_row.shape[1]
    cap = min(budget if topk_cap is None else topk_cap, budget, vocab)
    raw = logits_row.float().tolist()
    return oracle_logprobs(logits_row), [sorted(range(vocab), key=lambda v, row=row: (-row[v], v))[:cap] for row in raw]


def heap_oracle(logits_row: torch.Tensor, budget: int, topk_cap: int | None = None) -> OracleTree:
    """Best-first heap over one request's ``[depth, vocab]`` logits."""
    depth = logits_row.shape[0]
    tree = OracleTree(tokens=[], parents=[-1], depths=[0], scores=[0.0], ranks=[-1], paths=[()])
    if budget == 0 or depth == 0:
        return tree
    lp, ranked = ranked_candidates(logits_row, budget, topk_cap)

    heap: list[tuple[float, int, int, int]] = []

    def push_children(node: int) -> None:
        d = tree.depths[node]
        if d >= depth:
            return
        for rank, token in enumerate(ranked[d]):
            if lp[d][token] == float("-inf"):
                continue  # unreachable; the ranks after it are -inf too
            score = f32(tree.scores[node] + lp[d][token])
            if score == float("-inf"):
                continue
            heapq.heappush(heap, (-score, d + 1, node, rank))

    push_children(0)
    while heap and len(tree.tokens) < budget:
        neg_score, d, parent, rank = heapq.heappop(heap)
        token = ranked[d - 1][rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.scores.append(-neg_score)
        tree.ranks.append(rank)
        tree.paths.append(tree.paths[parent] + (token,))
        push_children(len(tree.tokens))
    return tree


def keep_chain_oracle(logits_row: torch.Tensor, budget: int, topk_cap: int | None = None) -> OracleTree:
    """Keep-chain tree of one request: the whole top-1 chain, the rest of the budget best-first.

    One best-first heap over all nodes with the builder's key; a popped chain node (rank 0 under a
    chain parent, reachable) is always taken, a popped non-chain node only while fewer than
    ``budget - reachable chain length`` of them are taken (a refused node's subtree is never pushed).
    Nodes come out in pop order, which is the builder's order restricted to the taken nodes.
    """
    depth, vocab = logits_row.shape
    if budget < depth:
        raise ValueError("keep-chain needs budget >= depth")
    tree = OracleTree(tokens=[], parents=[-1], depths=[0], scores=[0.0], ranks=[-1], paths=[()])
    if depth == 0 or vocab == 0:
        return tree
    lp, ranked = ranked_candidates(logits_row, budget, topk_cap)
    chain_len, score = 0, 0.0
    for d in range(depth):  # the chain's reachable length: its scores summed in float32
        score = f32(score + lp[d][ranked[d][0]])
        if score == float("-inf"):
            break
        chain_len += 1
    quota = budget - chain_len
    on_chain = [True]  # per taken node
    heap: list[tuple[float, int, int, int]] = []

    def push_children(node: int) -> None:
        d = tree.depths[node]
        if d >= depth:
            return
        for rank, token in enumerate(ranked[d]):
            score = f32(tree.scores[node] + lp[d][token])
            if score > float("-inf"):
                heapq.heappush(heap, (-score, d + 1, node, rank))

    push_children(0)
    taken_off_chain = 0
    while heap and (taken_off_chain < quota or len(tree.tokens) - taken_off_chain < chain_len):
        neg_score, d, parent, rank = heapq.heappop(heap)
        chain = on_chain[parent] and rank == 0
        if not chain:
            if taken_off_chain >= quota:
                continue
            taken_off_chain += 1
        token = ranked[d - 1][rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.scores.append(-neg_score)
        tree.ranks.append(rank)
        tree.paths.append(tree.paths[parent] + (token,))
        on_chain.append(chain)
        push_children(len(tree.tokens))
    return tree


def heap_oracle_lazy(topv: list[list[float]], topi: list[list[int]], budget: int) -> OracleTree:
    """The reference DDTree heap on precomputed top-K lists (what the reference code and the SGLang port run).

    ``topv[d][r]`` / ``topi[d][r]``: the rank-``r`` log-prob / token at position ``d``. Lazy expansion:
    popping a node pushes only its next sibling and its first child, O(budget log budget). Same keys,
    hence the same pop order, as ``heap_oracle``.
    """
    depth = len(topv)
    cap = len(topv[0]) if depth else 0
    tree = OracleTree(tokens=[], parents=[-1], depths=[0], scores=[0.0], ranks=[-1], paths=[()])
    heap: list[tuple[float, int, int, int]] = []
    if budget and depth and topv[0][0] > float("-inf"):
        heap.append((-topv[0][0], 1, 0, 0))
    while heap and len(tree.tokens) < budget:
        neg_score, d, parent, rank = heapq.heappop(heap)
        tree.tokens.append(topi[d - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.scores.append(-neg_score)
        tree.ranks.append(rank)
        node = len(tree.tokens)
        if rank + 1 < cap:
            s = f32(tree.scores[parent] + topv[d - 1][rank + 1])
            if s > float("-inf"):
                heapq.heappush(heap, (-s, d, parent, rank + 1))
        if d < depth:
            s = f32(-neg_score + topv[d][0])
            if s > float("-inf"):
                heapq.heappush(heap, (-s, d + 1, node, 0))
    return tree


# ----------------------------------------------------------------------------------------------
# Tiny deterministic causal LM (float64, RoPE), with a forward that takes any attention mask.
# ----------------------------------------------------------------------------------------------


class TinyLM:
    def __init__(
        self,
        vocab: int = 48,
        dim: int = 32,
        layers: int = 2,
        heads: int = 4,
        seed: int = 0,
        logit_scale: float = 3.0,
    ):
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale / math.sqrt(shape[0])

        self.vocab, self.dim, self.heads = vocab, dim, heads
        self.head_dim = dim // heads
        self.embed = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
        self.blocks = [
            {"qkv": w(dim, 3 * dim), "o": w(dim, dim), "up": w(dim, 4 * dim), "down": w(4 * dim, dim)}
            for _ in range(layers)
        ]
        self.head = w(dim, vocab, scale=logit_scale)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angle = positions.to(torch.float64)[..., None] * freqs  # [B, T, half]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # [B, 1, T, half]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens, positions ``[B, T]``; mask bool ``[B, T, T]`` (True = may attend). Logits ``[B, T, V]``."""
        b, t = tokens.shape
        x = self.embed[tokens]
        bias = torch.where(mask, 0.0, float("-inf")).to(torch.float64)[:, None]
        for blk in self.blocks:
            q, k, v = (self._norm(x) @ blk["qkv"]).split(self.dim, -1)
            q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
            q, k = self._rope(q, positions), self._rope(k, positions)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias, -1)
            x = x + (att @ v).transpose(1, 2).reshape(b, t, self.dim) @ blk["o"]
            x = x + torch.nn.functional.silu(self._norm(x) @ blk["up"]) @ blk["down"]
        return self._norm(x) @ self.head

    def causal_logits(self, seq: list[int]) -> torch.Tensor:
        """Logits ``[T, V]`` of a plain causal forward over ``seq``."""
        t = len(seq)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
        return self.forward(torch.tensor([seq]), torch.arange(t)[None], mask)[0]


def greedy_ar(model: TinyLM, prompt: list[int], n_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(int(model.causal_logits(seq)[-1].argmax()))
    return seq[len(prompt) :]


def sample_ar(
    model: TinyLM, prompt: list[int], n_new: int, gumbel: torch.Tensor, temperature: float
) -> list[int]:
    """AR sampling where the token at absolute position p is argmax(logits/T + gumbel[p])."""
    seq = list(prompt)
    for _ in range(n_new):
        logits = model.causal_logits(seq)[-1]
        seq.append(int((logits / temperature + gumbel[len(seq)]).argmax()))
    return seq[len(prompt) :]


def tree_forward(model: TinyLM, seqs: list[list[int]], tree, corrupt_mask: bool = False) -> torch.Tensor:
    """One verify forward per request: prefix causal, then the tree's ``n`` slots with the ancestor mask.

    ``seqs[b]`` ends with the root token (the previous bonus). Returns ``[B, n, V]`` tree logits.
    Requests are processed in one batch, left-aligned prefixes of equal length required.
    """
    batch = len(seqs)
    plen = len(seqs[0]) - 1
    assert all(len(s) - 1 == plen for s in seqs)
    n = tree.parents.shape[1]
    roots = torch.tensor([s[-1] for s in seqs])
    tokens = torch.cat(
        [torch.tensor([s[:-1] for s in seqs]).view(batch, plen), tree.full_token_ids(roots)], 1
    )
    positions = torch.cat(
        [torch.arange(plen).expand(batch, -1), tree.positions(torch.full((batch,), plen))], 1
    )
    total = plen + n
    mask = torch.zeros(batch, total, total, dtype=torch.bool)
    mask[:, :plen, :plen] = torch.ones(plen, plen, dtype=torch.bool).tril()
    mask[:, plen:, :plen] = True
    tree_mask = tree.tree_mask.clone()
    if corrupt_mask:  # deliberately let every node see all earlier slots (siblings included)
        tree_mask |= torch.ones(n, n, dtype=torch.bool).tril()
    mask[:, plen:, plen:] = tree_mask
    return model.forward(tokens, positions, mask)[:, plen:]


Drafter = Callable[[TinyLM, list[int], int], torch.Tensor]


def make_drafter(kind: str, seed: int, depth: int, noise: float = 1.5) -> Drafter:
    """Drafters return ``[depth, V]`` logits for the positions after ``seq``'s last token.

    random: Gaussian logits. noisy_oracle: the target's own greedy rollout logits plus noise.
    always_wrong: noisy oracle with the target's greedy token at each position set to -inf.
    sparse: -inf everywhere except two tokens per position (fewer reachable nodes than budget).
    exact: the target's greedy rollout logits (everything accepted).
    Deterministic in (seed, len(seq)) so that runs with different budgets see the same drafts.
    """

    def rollout(model: TinyLM, seq: list[int]) -> tuple[torch.Tensor, list[int]]:
        s = list(seq)
        rows, greedy = [], []
        for _ in range(depth):
            logits = model.causal_logits(s)[-1]
            rows.append(logits)
            greedy.append(int(logits.argmax()))
            s.append(greedy[-1])
        return torch.stack(rows), greedy

    def draft(model: TinyLM, seq: list[int], step: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + len(seq) * 7919 + step)
        noise_t = torch.randn(depth, model.vocab, generator=g, dtype=torch.float64)
        if kind == "random":
            return noise_t * 2.0
        if kind == "sparse":
            out = torch.full((depth, model.vocab), float("-inf"), dtype=torch.float64)
            keep = torch.randint(0, model.vocab, (depth, 2), generator=g)
            out.scatter_(1, keep, noise_t.gather(1, keep))
            return out
        rows, greedy = rollout(model, seq)
        if kind == "exact":
            return rows
        out = rows + noise * noise_t
        if kind == "always_wrong":
            out[torch.arange(depth), torch.tensor(greedy)] = float("-inf")
        return out

    return draft


def ddtree_decode(
    model: TinyLM,
    prompt: list[int],
    n_new: int,
    drafter: Drafter,
    budget: int,
    topk_cap: int | None,
    *,
    temperature: float = 0.0,
    gumbel: torch.Tensor | None = None,
    on_step: Callable[..., None] | None = None,
    corrupt_mask: bool = False,
    keep_chain: bool = False,
) -> tuple[list[int], list[int]]:
    """DDTree decoding; returns (generated tokens, accept length per step)."""
    du = load_ddtree_utils()
    seq = list(prompt)
    accepts = []
    while len(seq) - len(prompt) < n_new:
        draft_logits = drafter(model, seq)
        tree = du.build_ddtree(draft_logits[None].float(), budget, topk_cap, keep_chain=keep_chain)
        logits = tree_forward(model, [seq], tree, corrupt_mask=corrupt_mask)  # [1, n, V]
        if temperature == 0.0:
            target = logits.argmax(-1)
        else:
            node_pos = tree.positions(torch.tensor([len(seq) - 1]))  # [1, n]
            target = (logits / temperature + gumbel[(node_pos + 1).clamp(max=gumbel.shape[0] - 1)]).argmax(-1)
        accepted, accept_len, bonus = du.follow_verified_tree(tree, target)
        length = int(accept_len[0])
        path = accepted[0, 1 : 1 + length]
        emitted = [int(tree.token_ids[0, i - 1]) for i in path.tolist()] + [int(bonus[0])]
        if on_step is not None:
            on_step(
                seq=list(seq),
                tree=tree,
                logits=logits,
                target=target,
                accept_len=length,
                bonus=int(bonus[0]),
                draft_logits=draft_logits,
            )
        seq.extend(emitted)
        accepts.append(length)
    return seq[len(prompt) : len(prompt) + n_new], accepts


def dflash_linear_rule(
    candidates: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's compute_dflash_correct_drafts_and_bonus: accept while candidates[1:] == target[:-1]."""
    matches = candidates[:, 1:] == target_predict[:, :-1]
    correct_len = matches.to(torch.int64).cumprod(1).sum(1)
    bonus = target_predict.gather(1, correct_len.view(-1, 1)).view(-1)
    return correct_len, bonus


def tree_sampling_reference(
    *, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
    threshold_single=1.0, threshold_acc=1.0, deterministic=True,
) -> None:
    """sgl_kernel's ``tree_speculative_sampling_target_only``, one request at a time in Python loops
    (the kernel's rule: siblings in order, accept the first whose running target mass reaches the
    node's coin; otherwise draw the bonus from the target minus the rejected siblings' mass)."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur, prob_offset = 0, 0, (b, 0)
        coin = float(uniform_samples[b, 0])
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            acc = 0.0
            while cur != -1:
                token = int(candidates[b, cur])
                q = float(target_probs[prob_offset][token])
                acc = struct.unpack("f", struct.pack("f", acc + q))[0]  # the kernel sums in float32
                if coin <= acc / threshold_acc or q >= threshold_single:
                    prob_offset = (b, cur)
                    coin = float(uniform_samples[b, cur])
                    predicts[last] = token
                    accepted += 1
                    accept_index[b, accepted] = int(retrive_index[b, cur])
                    last = int(retrive_index[b, cur])
                    break
                draft_probs[prob_offset][token] = target_probs[prob_offset][token]
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = accepted
        residual = [max(0.0, float(target_probs[prob_offset][v]) - float(draft_probs[prob_offset][v]))
                    for v in range(vocab)]
        total = sum(residual)
        u = float(uniform_samples_for_final_sampling[b]) * total
        # An empty residual (the children held all the mass, the coin above its float32 sum) leaves
        # the kernel's draw at its last index: vocab - 1 (seen on the H200, issue 23).
        run, pick = 0.0, vocab - 1
        if total > 0:
            for v in range(vocab):
                run += residual[v]
                if run > u:
                    pick = v
                    break
        predicts[last] = pick
