"""`--speculative-ddtree-mode shadow-linear` on the v2 DFLASH worker (SGLang 0.5.17 / 0.5.23; installed as
`sglang/srt/speculative/ddtree_v2_shadow.py` by the payload of each v2 base; one copy, shared).

promote's first stage runs shadow-linear and its settings gate asks `/server_info` → `internal_states[0].ddtree`
for the mode the worker runs. Upstream's v2 worker has no such report, so on a real 0.5.17 / 0.5.23 server that
gate could only answer "inconclusive" and every promote stopped (and rolled back) at its first stage; the lab's
stand-in engine reports stats on every base and hid it. `DDTreeShadowWorkerV2` is upstream's worker, its steps
unchanged (the linear DFLASH step serves, the overlap scheduler allowed), that counts its decode steps as v1's
shadow-linear counts them — steps, graph replays, accepted depths (summed on the device, read with the stats) —
and reports them with the settings under v1's names. `ddtree_v2_args`' hook on `SpeculativeAlgorithm.create_worker`
picks it for DFLASH in shadow-linear, no switch: it changes no token.

Unlike v1 it builds no trees: upstream's draft folds its sampler into the draft graph and returns tokens only
(17:speculative/dflash_worker_v2.py:341-363), so the draft logits a tree needs would cost a step its graph.
`avg_tree_nodes`, the build figures and `build_budgets` (empty) say so.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative import ddtree_stats as _stats
from sglang.srt.speculative import ddtree_v2_args as _v2args
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2


class DDTreeShadowWorkerV2(DFlashWorkerV2):
    """Upstream's v2 DFLASH worker, counted as v1's shadow-linear; nothing it serves changes."""

    def __init__(self, server_args: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(server_args, *args, **kwargs)
        # Argument parsing checked a local --model-path; the config SGLang loaded covers a hub id too.
        refusal = _v2args.shadow_refusal(server_args, loaded_config(self._target_worker))
        if refusal:
            raise _args.DDTreeConfigError(refusal)
        block = int(server_args.speculative_num_draft_tokens)
        budget = getattr(server_args, "speculative_ddtree_budget", None)
        self.ddtree_settings = _stats.settings(
            mode="shadow-linear", budget=_args.configured_budget(server_args, block), budget_auto=_args.is_auto(budget),
            topk_cap=getattr(server_args, "speculative_ddtree_topk_cap", None),
            keep_chain=bool(getattr(server_args, "speculative_ddtree_keep_chain", False)))
        self.ddtree_stats = _stats.DDTreeStats()

    def forward_batch_generation(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        decode = is_decode(batch)  # read first: the verify sets TARGET_VERIFY on the batch
        result = super().forward_batch_generation(batch, *args, **kwargs)
        if decode:
            self.ddtree_stats.add_linear_step(result, int(self.block_size))
        return result

    def ddtree_internal_state(self) -> dict[str, Any]:
        """`/server_info` → internal_states[0]["ddtree"] (`ddtree_v2_args`' hook on `get_internal_state`): v1's
        keys; no build budgets (no trees)."""
        runner = getattr(getattr(self._target_worker, "model_runner", None), "decode_cuda_graph_runner", None)
        return _stats.internal_state(
            self.ddtree_settings, self.ddtree_stats, auto=None,
            verify_graph_width=getattr(runner, "captured_req_width", None),
            verify_graph_max_bs=getattr(runner, "max_bs", None), build_graph_bs=None, build_budgets=[],
            verify_kernels=False, hybrid=None, profile=None)


def loaded_config(target_worker: Any) -> dict:
    """The target's config as SGLang loaded it ({} where there is none to read)."""
    hf_config = getattr(getattr(getattr(target_worker, "model_runner", None), "model_config", None), "hf_config", None)
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}


def is_decode(batch: Any) -> bool:
    """Whether upstream's v2 step runs this batch as a decode (its prefill path takes extend batches, and with DP
    attention a batch some rank extends; idle batches verify nothing)."""
    mode = batch.forward_mode
    return not (mode.is_extend() or getattr(batch, "is_extend_in_batch", False) or mode.is_idle())
