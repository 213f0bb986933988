"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, the base's payload modules beside
upstream's): shadow-linear on the v2 DFLASH worker (`ddtree_v2_shadow`); prints one JSON object.

What runs for real: SGLang's `HookRegistry` applying what `ddtree_v2_args` registers at import (`load_plugins()`),
`SpeculativeAlgorithm.create_worker`, the shadow worker's own `__init__` and `forward_batch_generation` over the real
`DFlashWorkerV2`, the scheduler's real `get_internal_state` (hooked) and its msgpack IPC encoding.
Stand-ins, and why: upstream's `__init__` (it builds models and pools) sets what the worker reads after it;
upstream's `forward_batch_generation` (it runs models) answers a result with `accept_lens` and a graph flag, and
sets the batch's forward mode to verify as the real verify does; the scheduler object holds what
`get_internal_state` reads (v2_worker_cases.scheduler_state; 0.5.23: its internal-state controller stubbed).

Usage: python v2_shadow_cases.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import v2_worker_cases as wc  # beside this script: its Mode and scheduler_state
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative import ddtree_v2_args as v2args  # registers the hooks at import
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.version import __version__

BLOCK = 8
ARGS = dict(speculative_num_draft_tokens=BLOCK, speculative_ddtree_mode="shadow-linear", speculative_ddtree_budget=31,
            speculative_ddtree_budget_max=None, speculative_ddtree_topk_cap=4, speculative_ddtree_keep_chain=True)


class _HFConfig(dict):
    def to_dict(self) -> dict:
        return dict(self)


def shadow_worker(loaded: dict | None = None, **change):
    """The shadow worker `create_worker` picks, made by its own `__init__` (upstream's stubbed; `loaded`: the target
    config it loaded)."""
    cls = SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace(**{**ARGS, **change}))
    real = DFlashWorkerV2.__init__
    target = None if loaded is None else SimpleNamespace(
        model_runner=SimpleNamespace(model_config=SimpleNamespace(hf_config=_HFConfig(loaded))))

    def upstream_init(self, server_args, *args, **kwargs):
        self.block_size = int(server_args.speculative_num_draft_tokens)
        self._target_worker, self._draft_worker, self._additional_graph_memory_usage = target, None, {}

    DFlashWorkerV2.__init__ = upstream_init
    try:
        return cls(SimpleNamespace(**{**ARGS, **change}), 0, None, 0, None)
    finally:
        DFlashWorkerV2.__init__ = real


def steps(worker, lens: list[list[int]]) -> list:
    """A prefill, an idle batch, then one decode batch per entry of `lens` (its accept_lens; the odd ones replay a
    graph); what each call returned."""
    real = DFlashWorkerV2.forward_batch_generation
    decode = iter(lens)

    def upstream(self, batch, *args, **kwargs):
        kind = batch.forward_mode.kind
        accept = next(decode) if kind == "decode" else [1] * 2
        if kind == "decode":
            batch.forward_mode = wc.Mode(kind="target_verify")  # the verify leaves the batch in verify mode
        return SimpleNamespace(accept_lens=torch.tensor(accept, dtype=torch.int32), can_run_cuda_graph=sum(accept) % 2 == 1)

    DFlashWorkerV2.forward_batch_generation = upstream
    try:
        kinds = ["extend", "idle", *["decode"] * len(lens)]
        return [worker.forward_batch_generation(SimpleNamespace(forward_mode=wc.Mode(kind=k))) for k in kinds]
    finally:
        DFlashWorkerV2.forward_batch_generation = real


def main() -> None:
    load_plugins()
    out: dict = {"version": __version__, "registered": v2args._workers_registered}
    shadow_cls = SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace(**ARGS))
    out["selection"] = {
        "shadow": shadow_cls.__name__, "subclass": issubclass(shadow_cls, DFlashWorkerV2),
        "off": SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace(speculative_ddtree_mode="off")).__name__,
        "eagle_shadow": SpeculativeAlgorithm.EAGLE.create_worker(SimpleNamespace(
            speculative_ddtree_mode="shadow-linear", enable_multi_layer_eagle=False)).__name__,
    }
    worker = shadow_worker()
    lens = [[1, 8, 3], [2, 2, 8], [5]]
    results = steps(worker, lens)
    out["passed_through"] = [r.accept_lens.tolist() for r in results]
    out["lens"] = lens
    out["on_device"] = isinstance(worker.ddtree_stats.depth_counts, torch.Tensor) and \
        not worker.ddtree_stats.accepted_depth_hist
    out["state"] = wc.scheduler_state(worker)
    out["auto"] = shadow_worker(speculative_ddtree_budget="auto", speculative_ddtree_budget_max=63,
                                speculative_ddtree_topk_cap=None, speculative_ddtree_keep_chain=False
                                ).ddtree_internal_state()
    # A hub id is not read at argument parsing: the worker checks the config SGLang loaded; as shipped (no base is
    # untracked) and with this base marked untracked (the refusal a host would get)
    hub = dict(model_path="Qwen/Qwen3.5-9B", disable_radix_cache=False)
    shipped = v2args.UNTRACKED_HYBRID_RADIX_BASES
    for marking, bases in (("loaded", shipped), ("loaded untracked", (__version__,))):
        v2args.UNTRACKED_HYBRID_RADIX_BASES = bases
        out[marking] = {}
        for name, loaded, change in (
                ("hybrid, radix on", {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]},
                 {}),
                ("hybrid, radix off", {"model_type": "qwen3_5"}, {"disable_radix_cache": True}),
                ("dense", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, {})):
            try:
                shadow_worker(loaded, **{**hub, **change})
                out[marking][name] = None
            except ValueError as exc:
                out[marking][name] = f"{type(exc).__name__}: {exc}"
    v2args.UNTRACKED_HYBRID_RADIX_BASES = shipped
    plain = object.__new__(DFlashWorkerV2)
    plain.__dict__.update(_draft_worker=None, _additional_graph_memory_usage={},
                          _target_worker=SimpleNamespace(model_runner=None))
    out["dflash_state_has_ddtree"] = "ddtree" in wc.scheduler_state(plain)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
