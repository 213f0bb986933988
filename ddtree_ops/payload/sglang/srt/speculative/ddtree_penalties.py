"""Penalties on verify logits, exactly as plain decoding applies them at every verified position
(installed as `sglang/srt/speculative/ddtree_penalties.py` by the ddtree-ops payload; imports only torch, and
SGLang's compiled repetition scaling lazily on CUDA). Used by the v1 worker (0.5.13.post1), and on the v2 bases
by the tree step and upstream's linear step (`ddtree_v2_penalties`) alike; each base's glue only says where the
penalizers' order comes from.

Plain decoding with the flags DFLASH runs under (no overlap scheduler) samples output token `L` of a
request from the target's float32 logits after `SamplingBatchInfo.apply_logits_bias`: the batch's
penalizers in their dict order (`PENALIZERS`), each in place. 0.5.17 too: its non-overlap plain step runs
on the scheduler's own sampling info (17:managers/scheduler.py:3680-3689, no `_forward_isolation` copy), whose
`acc_*_penalties` stay None, so `apply_logits_bias` (17:sampling/sampling_batch_info.py:284) reaches
`penalizer_orchestrator.apply` without `repeat`:
- frequency: `x - F(t)`, `F(t)` the penalty added once per earlier occurrence of `t` among the output
  tokens (a running float32 sum, as `scatter_add_` builds it step by step);
- presence: `x - P` for tokens that occurred;
- min_new_tokens: `x + -inf` at the stop tokens (stop ids, the tokenizer's extra stop ids, EOS) while
  `L < min_new_tokens`;
- repetition: `x * r` where `x < 0`, else `x / r`, for tokens that occurred;
then the logit bias is added (by the caller). A penalizer at its neutral value changes nothing (`x - 0`,
`x / 1`), so applying all four in the batch's order is exact for every request.

A verify position (a tree node, or a position of DFLASH's linear block) predicts the token after the
request's output so far *and the drafted tokens on its path*: its counts include both and its length is
`L + depth`. Holding the penalties fixed within a step (upstream DFLASH, and DDTree before issue 23; and
upstream never counts a DFLASH request's output at all) left plain decoding wherever a drafted token
repeated one (measured on the H200: tokens 2-14).

Only the columns a penalty touches change (the tokens already output, the stop tokens, the path's
tokens), so the work is a gather and a scatter per penalised request, never a dense `[nodes, vocab]` pass.
"""

from __future__ import annotations

import struct
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NOTHING_REQUIRED", "PENALIZERS", "RequestPenalties", "apply_verify_penalties", "chain_shape",
           "frequency_sums", "is_penalised", "order_of", "path_tokens", "penalise_and_bias", "request_penalties",
           "sglang_scale_fn"]

# SGLang's penalizer classes by the name this module applies them under.
PENALIZERS = {
    "BatchedFrequencyPenalizer": "frequency",
    "BatchedPresencePenalizer": "presence",
    "BatchedMinNewTokensPenalizer": "min_new_tokens",
    "BatchedRepetitionPenalizer": "repetition",
}
DEFAULT_ORDER = tuple(PENALIZERS.values())

ScaleFn = Callable[[torch.Tensor, torch.Tensor], None]

# What upstream's own penalty block reads once the glue has applied the penalties itself (a penalizer
# orchestrator that requires nothing).
NOTHING_REQUIRED = types.SimpleNamespace(is_required=False)


@dataclass(frozen=True)
class RequestPenalties:
    """One request's penalty settings and its output so far (the verify step's root token included)."""

    output_ids: Sequence[int]
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_ids: Sequence[int] = ()

    @property
    def active(self) -> bool:
        """Whether any verify position of this request is penalised (a path only lengthens the output)."""
        return (self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0
                or len(self.output_ids) < self.min_new_tokens)


def is_penalised(req: Any) -> bool:
    """`request_penalties(req).active` without building it: a step's check on every request of a batch."""
    sp = req.sampling_params
    return (float(getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0
            or float(getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0
            or float(getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0
            or len(req.output_ids) < int(getattr(sp, "min_new_tokens", 0) or 0))


def request_penalties(req: Any, *, req_eos: bool = False) -> RequestPenalties:
    """A request's penalty settings as plain's penalizers read them (stop tokens as
    BatchedMinNewTokensPenalizer collects them), with its output so far. `req_eos`: the base's min-new-tokens
    penalizer also bans the request's own `eos_token_ids` (the model's generation-config EOS ids; SGLang 0.5.23,
    23:sampling/penaltylib/min_new_tokens.py:39; 0.5.13 and 0.5.17 do not, though their `Req` has the field)."""
    sp = req.sampling_params
    stops = set(getattr(sp, "stop_token_ids", None) or ())
    if req_eos:
        stops |= set(getattr(req, "eos_token_ids", None) or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        stops |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        stops.add(getattr(tokenizer, "eos_token_id", None))
    return RequestPenalties(
        output_ids=req.output_ids,
        frequency=float(getattr(sp, "frequency_penalty", 0.0) or 0.0),
        presence=float(getattr(sp, "presence_penalty", 0.0) or 0.0),
        repetition=float(getattr(sp, "repetition_penalty", 1.0) or 1.0),
        min_new_tokens=int(getattr(sp, "min_new_tokens", 0) or 0),
        stop_ids=tuple(sorted(t for t in stops if t is not None)),
    )


def order_of(penalizers: Iterable[Any]) -> tuple[str, ...]:
    """The names (`PENALIZERS` values) of SGLang's penalizer classes in `penalizers`' iteration order (an
    orchestrator's `penalizers` dict, or a set of the classes); `DEFAULT_ORDER` unless all four are there."""
    order = tuple(PENALIZERS[c.__name__] for c in penalizers if getattr(c, "__name__", None) in PENALIZERS)
    return order if len(order) == len(PENALIZERS) else DEFAULT_ORDER


def sglang_scale_fn(logits: torch.Tensor) -> ScaleFn | None:
    """On CUDA plain's own compiled repetition scaling (its division is the one plain computes); else None
    (the eager `torch.where` of the same expression)."""
    if not logits.is_cuda:
        return None
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    return apply_scaling_penalties


def penalise_and_bias(
    logits: torch.Tensor, reqs: Sequence[Any], logit_bias: torch.Tensor | None, *, parents: torch.Tensor,
    depths: torch.Tensor, tokens: torch.Tensor, max_depth: int, order: Sequence[str], req_eos: bool = False,
) -> bool:
    """Penalties (exact per verify position, `apply_verify_penalties`) then the logit bias `[bs, vocab]` on
    the verify logits `[bs, n, vocab]` of a tree or of a chain (`parents` / `depths` / `tokens`, the root's
    token first, as `path_tokens` reads them) of the requests `reqs`; returns whether anything was applied.
    Requests at neutral settings are skipped: when none is penalised, no host read of device data. `req_eos` as
    in `request_penalties`."""
    rows = [i for i, req in enumerate(reqs) if is_penalised(req)]
    if rows:
        kw = {"scale_fn": fn} if (fn := sglang_scale_fn(logits)) is not None else {}
        apply_verify_penalties(logits, rows, [request_penalties(reqs[i], req_eos=req_eos) for i in rows],
                               path_tokens(parents, depths, tokens, max_depth), depths, order=order, **kw)
    if logit_bias is not None:
        logits.add_(logit_bias[:, None, :])
    return bool(rows) or logit_bias is not None


def chain_shape(bs: int, n: int, device: Any) -> dict[str, torch.Tensor]:
    """DFLASH's linear block as a tree: position j's parent is j - 1, its depth j."""
    j = torch.arange(n, device=device)
    return {"parents": (j - 1).expand(bs, n), "depths": j.expand(bs, n)}


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


_FREQUENCY_SUMS: dict[float, list[float]] = {}


def frequency_sums(penalty: float, upto: int) -> list[float]:
    """`sums[c]`: the frequency penalty added `c` times in float32, as plain's `scatter_add_` accumulates it
    step by step (`c * penalty` rounds differently). Double precision then one rounding per addition is
    float32 addition exactly (53 >= 2 * 24 + 2 bits)."""
    key = _f32(penalty)
    if key not in _FREQUENCY_SUMS and len(_FREQUENCY_SUMS) >= 64:  # each client may send its own value
        _FREQUENCY_SUMS.clear()
    sums = _FREQUENCY_SUMS.setdefault(key, [0.0])
    while len(sums) <= upto:
        sums.append(_f32(sums[-1] + key))
    return sums


def path_tokens(parents: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor, max_depth: int) -> torch.Tensor:
    """int64 `[bs, n, max_depth]`: every node's path from the root (root excluded, the node included),
    slot `d - 1` holding its depth-`d` token; -1 beyond the node's depth.

    `parents` int64 `[bs, n]` (-1: root, padding), `depths` `[bs, n]` (root and padding 0), `tokens`
    `[bs, n]` (the root's token first)."""
    bs, n = parents.shape
    width = max(1, int(max_depth))
    out = torch.full((bs, n, width), -1, dtype=torch.int64, device=tokens.device)
    node = torch.arange(n, device=tokens.device).expand(bs, n)
    for k in range(width):  # the k-th ancestor of each node sits at depth (its depth - k)
        slot = (depths - 1 - k).unsqueeze(2)
        keep = out.gather(2, slot.clamp(min=0))
        out.scatter_(2, slot.clamp(min=0), torch.where(slot >= 0, tokens.gather(1, node).unsqueeze(2), keep))
        node = parents.gather(1, node).clamp(min=0)
    return out


def _where_scale(x: torch.Tensor, scale: torch.Tensor) -> None:
    x[:] = torch.where(x < 0, x * scale, x / scale)


def apply_verify_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    requests: Sequence[RequestPenalties],
    paths: torch.Tensor,
    depths: torch.Tensor,
    *,
    order: Sequence[str] = DEFAULT_ORDER,
    scale_fn: ScaleFn = _where_scale,
) -> None:
    """Penalise the verify logits of the batch rows `rows` in place, each position exactly as plain
    decoding would there (module docstring).

    `logits` float32 `[bs, n, vocab]`; `requests[i]` belongs to row `rows[i]`; `paths` `[bs, n, D]`
    (`path_tokens`), `depths` `[bs, n]`; `order`: the penalizers' order (`PENALIZERS` values) in the
    batch. `scale_fn(x, s)` applies the repetition penalty to 1-D `x` in
    place (the server passes SGLang's compiled `apply_scaling_penalties`, whose division plain uses).
    """
    device = logits.device
    vocab = logits.shape[-1]
    for row, req in zip(rows, requests, strict=True):
        out = torch.as_tensor(list(req.output_ids), dtype=torch.int64, device=device)
        hist = torch.zeros(vocab, dtype=torch.int64, device=device).scatter_add_(0, out, torch.ones_like(out))
        stops = torch.as_tensor(sorted({int(t) for t in req.stop_ids if 0 <= int(t) < vocab}),
                                dtype=torch.int64, device=device)
        under_min = (len(req.output_ids) + depths[row]) < req.min_new_tokens  # [n]: stop tokens banned
        target = logits[row]  # [n, vocab]
        # Every node's columns that a penalty touches through the history alone: the tokens output so
        # far and the stop tokens. A column listed twice gets the same value twice.
        cols = torch.cat([torch.unique(out), stops])
        n = target.shape[0]
        counts = hist[cols].expand(n, -1)
        stop = torch.isin(cols, stops).expand(n, -1) & under_min[:, None]
        # The path's columns, counting the node's own path too; read before anything is written.
        path = paths[row]
        on = path >= 0
        path_cols = path.clamp(min=0)
        path_counts = hist[path_cols] + ((path.unsqueeze(2) == path.unsqueeze(1)) & on.unsqueeze(1)).sum(2)
        path_values = target.gather(1, path_cols)
        target[:, cols] = _penalised(target[:, cols], counts, stop, req, order, scale_fn)
        new_path = _penalised(path_values, path_counts, torch.isin(path_cols, stops) & under_min[:, None], req,
                              order, scale_fn)
        # Written last, over the history's value for a path token; only the real path slots (one
        # value per node and column, so duplicates agree).
        node_idx, slot_idx = on.nonzero(as_tuple=True)
        target[node_idx, path_cols[node_idx, slot_idx]] = new_path[node_idx, slot_idx]


def _penalised(values: torch.Tensor, counts: torch.Tensor, stop: torch.Tensor, req: RequestPenalties,
               order: Sequence[str], scale_fn: ScaleFn) -> torch.Tensor:
    """`values` after plain's penalizers in `order`, for tokens output `counts` times (`stop`: a banned
    stop token), each step the same float32 operation plain applies."""
    upto = int(counts.max()) if counts.numel() else 0
    seen = counts > 0
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    x = values.clone()
    for name in order:
        if name == "frequency":
            sums = torch.as_tensor(frequency_sums(req.frequency, upto), dtype=torch.float32, device=x.device)
            x = x - sums[counts]
        elif name == "presence":
            x = x - torch.where(seen, _f32(req.presence), zero)
        elif name == "min_new_tokens":
            x = x + torch.where(stop, float("-inf"), zero)
        elif name == "repetition" and req.repetition != 1.0:
            x = x.contiguous()
            scale_fn(x.view(-1), torch.where(seen, _f32(req.repetition), 1.0 + zero).view(-1).contiguous())
    return x
