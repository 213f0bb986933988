"""Full DDTree on a hybrid target's recurrent layers (installed as `sglang/srt/speculative/ddtree_hybrid.py`
by the ddtree-ops payload; bench/gpu/HYBRID.md has the study, ddtree_hybrid_state the arithmetic).

SGLang verifies trees on hybrid targets through its linear-attention backend's tree path (`topk > 1`):
each node's conv window and SSM state follow the parent that the kernels derive from the first-child /
next-sibling arrays, and one state per node is kept in the mamba pool's intermediate buffers. DDTree
hands it its own arrays (`DDTree.retrive_next_token` / `retrive_next_sibling`, no conversion) and, after
the walk, commits the state of the last committed node on the accepted path, where DFLASH commits its
chain position `commit_len - 1`. The payload patches that make the backend take the tree path
(`hybrid_linear_attn_backend.patch`) and plan the buffers' memory (`model_runner_kv_cache_mixin.patch`)
ask `ddtree_args`; this module checks at start that they took, counts the memory, and maps the commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.speculative.ddtree_args import (
    FLAG_MODE,
    HYBRID_TREE_BACKENDS,
    TEST_UNPROVEN_HYBRID,
    DDTreeConfigError,
    check_hybrid_full_mode,
    mamba_commit_fault,
    test_switch,
)
from sglang.srt.speculative.ddtree_utils import DDTreeRefused, hybrid_kind, hybrid_support

logger = logging.getLogger(__name__)

GIB = 1 << 30
# SGLang's runtime config attribute per layer type DDTree drives (model_runner.<attr> is not None).
_RUNTIME_CONFIG = {"gated-deltanet": "hybrid_gdn_config"}


def linear_backend_of(attn_backend: Any) -> Any:
    """The linear-attention half of SGLang's HybridLinearAttnBackend (None on a dense target)."""
    return getattr(attn_backend, "linear_attn_backend", None)


def hf_config_dict(model_runner: Any) -> dict:
    """The config of the checkpoint SGLang loaded, as a dict ({} when the runner has none)."""
    hf_config = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(hf_config) if isinstance(hf_config, dict) else {}


def runtime_refusal(model_runner: Any, evidence: str) -> str | None:
    """Why full mode must not run on this hybrid target as SGLang built it (None: it may). The runtime
    counterpart of `ddtree_utils.hybrid_refusal`: the layer type from the backend SGLang chose, the
    support table, and the flags the hybrid path is wired for. `evidence`: what made it hybrid."""
    linear = linear_backend_of(getattr(model_runner, "attn_backend", None))
    name = "no linear-attention backend" if linear is None else type(linear).__name__
    layer_type = next((t for t, attr in _RUNTIME_CONFIG.items() if getattr(model_runner, attr, None) is not None), None)
    if name not in HYBRID_TREE_BACKENDS or layer_type is None:
        return (
            f"DDTree full mode refused: the target model is hybrid ({evidence}; {name}). DDTree commits tree "
            f"states only through {', '.join(HYBRID_TREE_BACKENDS)} on {', '.join(_RUNTIME_CONFIG)} layers. "
            f"Use {FLAG_MODE} shadow-linear."
        )
    # the architecture from the checkpoint SGLang loaded (the runtime config says only the layer type)
    architecture = (hybrid_kind(hf_config_dict(model_runner)) or (None, "an unknown architecture"))[1]
    status, why = hybrid_support(layer_type, architecture)
    if status != "proven" and not (status == "unproven" and test_switch(TEST_UNPROVEN_HYBRID)):
        return (
            f"DDTree full mode refused: the target model is hybrid ({evidence}), layer type {layer_type} "
            f"({name}) on {architecture}: {why}. Use {FLAG_MODE} shadow-linear."
        )
    try:
        check_hybrid_full_mode(model_runner.server_args)
    except DDTreeConfigError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class HybridStateMemory:
    """The mamba pool's per-node (intermediate) state buffers, as allocated."""

    width: int  # verify tokens per request the buffers hold
    rows: int  # request rows (max_running_requests + 1)
    ssm_bytes: int
    conv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.ssm_bytes + self.conv_bytes

    @property
    def per_row_bytes(self) -> int:
        return self.total_bytes // max(1, self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {
            "verify_width": self.width,
            "request_rows": self.rows,
            "intermediate_gib": round(self.total_bytes / GIB, 4),
            "per_request_gib": round(self.per_row_bytes / GIB, 4),
            "ssm_gib": round(self.ssm_bytes / GIB, 4),
            "conv_gib": round(self.conv_bytes / GIB, 4),
        }


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


class HybridTree:
    """A full-mode target's recurrent layers: checked at start, mapped per step."""

    def __init__(self, model_runner: Any, budget: int) -> None:
        self.linear = linear_backend_of(model_runner.attn_backend)
        if int(getattr(self.linear, "topk", 0) or 0) < 2:
            raise DDTreeRefused(
                f"DDTree full mode refused: the hybrid target's {type(self.linear).__name__} verifies chains, not "
                "trees (the payload's hybrid_linear_attn_backend patch is not installed). Re-push the payload "
                f"(ddtree-ops push) or use {FLAG_MODE} shadow-linear."
            )
        cache = model_runner.req_to_token_pool.mamba_pool.mamba_cache
        ssm = getattr(cache, "intermediate_ssm", None)
        conv = getattr(cache, "intermediate_conv_window", None)
        if ssm is None or conv is None:
            raise DDTreeRefused("DDTree full mode refused: the hybrid target's mamba pool has no per-node verify states.")
        width = int(ssm.shape[2])
        if width < budget + 1:
            raise DDTreeRefused(
                f"DDTree full mode refused: the hybrid target keeps recurrent states for {width} verify tokens per "
                f"request, not 1 + budget = {budget + 1} (--max-speculative-num-draft-tokens was not raised)."
            )
        self.memory = HybridStateMemory(
            width=width,
            rows=int(ssm.shape[1]),
            ssm_bytes=_nbytes(ssm),
            conv_bytes=sum(_nbytes(c) for c in conv),
        )
        self.fault = mamba_commit_fault()

    def log_start(self, tp_rank: int) -> None:
        if tp_rank != 0:
            return
        m = self.memory
        logger.info(
            "DDTree full (hybrid, %s): per-node recurrent states %.3f GiB (%.4f GiB per request row x %d rows, "
            "%d verify tokens each)",
            type(self.linear).__name__, m.total_bytes / GIB, m.per_row_bytes / GIB, m.rows, m.width,
        )
        if self.fault:
            logger.warning("DDTree: %s commit of the recurrent state (test fault): outputs are WRONG", self.fault)

    def commit_steps(
        self, verify_input: Any, chain_steps: torch.Tensor, track_steps: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFLASH's commit and tracking indices (offsets along the committed chain, < 0: none) as node
        indices of this step's verify block. A linear step's block is its chain: unchanged."""
        path = getattr(verify_input, "accepted_nodes", None)
        if path is None:
            return chain_steps, track_steps
        if self.fault == "chain":
            return chain_steps, track_steps
        untracked = None if track_steps is None else torch.full_like(track_steps, -1)
        if self.fault == "skip":
            return torch.full_like(chain_steps, -1), untracked
        if self.fault == "deepest":
            return deepest_nodes(verify_input.tree), untracked
        mapped = path_steps(path, chain_steps)
        return mapped, None if track_steps is None else path_steps(path, track_steps)

    def as_dict(self) -> dict[str, Any]:
        return {"linear_backend": type(self.linear).__name__, **self.memory.as_dict()}


def path_steps(accepted_nodes: torch.Tensor, chain_steps: torch.Tensor) -> torch.Tensor:
    """Node index at each request's offset along its accepted path (`accepted_nodes` [bs, depth + 1], root
    first); a negative offset stays -1 (nothing to copy)."""
    steps = chain_steps.to(torch.int64)
    nodes = accepted_nodes.to(torch.int64).gather(1, steps.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(steps >= 0, nodes, torch.full_like(nodes, -1))


def deepest_nodes(tree: Any) -> torch.Tensor:
    """Each request's deepest valid node, the lowest index among equals (the `deepest` test fault)."""
    depths = torch.where(tree.valid, tree.depths.to(torch.int64), -1)
    return depths.argmax(dim=1)


def replay_padding(bs: int, forward_mode: Any, spec_info: Any, counted: Any) -> Any:
    """How many of a replayed graph batch's `bs` rows are padding (`hybrid_linear_attn_backend.patch`).

    SGLang counts the rows whose length equals the graph's fill value (1). A target verify's lengths are
    taken before the step, so a real request on its first verify after a one-token prompt has length 1
    too: it was counted as padding, and the batch's last real row (that request when it joined last,
    else another) got the pad slot instead of its conv / SSM slot. The step then read and committed no
    state for that row, and its tokens left plain decoding's under DFLASH and DDTree alike (seen on the
    H200 on a trained hybrid pair). A verify knows its real batch: its draft tokens (DFLASH's, DDTree's and
    EAGLE's verify inputs all carry them) are `draft_token_num` per request. `counted` (SGLang's figure) is
    kept for everything else."""
    if spec_info is None or not forward_mode.is_target_verify():
        return counted
    tokens, width = getattr(spec_info, "draft_token", None), getattr(spec_info, "draft_token_num", 0)
    if not isinstance(tokens, torch.Tensor) or not width or tokens.numel() % width:
        return counted
    real = tokens.numel() // width
    return bs - real if 0 < real <= bs else counted
