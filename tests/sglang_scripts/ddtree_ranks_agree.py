"""Run inside a patched sglang tree (PYTHONPATH): two gloo ranks of one TP group start a full-mode
DDTreeController each, with deliberately different free device memory (80 GiB and 6 GiB), then shape
the same 300 random verify steps (batch size, committed lengths, free KV slots; on and off the verify
graphs). Every decision must be identical on both ranks. The control run skips the agreement
(`agree_min` returns the rank's own value) and must disagree somewhere, which shows the check has
power. Then the verify kernels' start-up check passing on one rank only (`agree_verify_kernels`, as v1's
controller and the v2 tree step call it): both ranks must end without them, the one that passed having turned
its own off. Prints one JSON line from rank 0; exit 0 only if all hold.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FREE = {0: 80 * 2**30, 1: 6 * 2**30}
BUDGET, BLOCK, MAX_RUNNING, CONTEXT = 64, 16, 48, 1024


def _worker(dw):
    runner = SimpleNamespace(
        attn_backend=type("TritonAttnBackend", (), {"num_draft_tokens": BUDGET + 1})(),
        mambaish_config=None, hybrid_gdn_config=None, sliding_window_size=None, device="cpu",
        req_to_token_pool=SimpleNamespace(size=MAX_RUNNING, max_context_len=CONTEXT + 4 + BUDGET + 1),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: {"model_type": "qwen3"}),
                                     vocab_size=152_000, hidden_size=4096, dtype=torch.bfloat16),
        model=SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1, 1, dtype=torch.bfloat16))),
    )
    args = SimpleNamespace(speculative_ddtree_mode="full", speculative_ddtree_budget=BUDGET,
                           speculative_ddtree_topk_cap=None, speculative_ddtree_allow_hybrid_unsafe=False, tp_size=2)
    return SimpleNamespace(server_args=args, block_size=BLOCK, tp_rank=dist.get_rank(), page_size=1, model_runner=runner)


def _batch(rng: random.Random, row_width: int):
    bs = rng.randint(1, MAX_RUNNING)
    seq = torch.tensor([rng.randint(1, row_width - 1) for _ in range(bs)], dtype=torch.int64)
    free = rng.choice([10**6, rng.randint(0, 80 * bs)])
    alloc = SimpleNamespace(available_size=lambda: free)
    return SimpleNamespace(batch_size=lambda: bs, seq_lens_cpu=seq,
                           req_to_token_pool=SimpleNamespace(req_to_token=torch.empty(1, row_width)),
                           token_to_kv_pool_allocator=alloc, tree_cache=None)


def _shapes(dw, agree: bool) -> dict:
    dw.free_device_memory = lambda device: FREE[dist.get_rank()]
    dw.tp_cpu_group = lambda worker: dist.group.WORLD
    dw.evict_from_tree_cache = lambda cache, k: None
    real = dw.agree_min
    if not agree:
        dw.agree_min = lambda values, group: [int(v) for v in values]
    try:
        ctl = dw.DDTreeController.maybe_create(_worker(dw))
    finally:
        dw.agree_min = real
    ctl.verify_graph_width, ctl.verify_graph_max_bs = BUDGET + 1, 32
    rng = random.Random(7)
    row_width = CONTEXT + 4 + BUDGET + 1
    shapes = [tuple(vars(ctl.step_shape_for(_batch(rng, row_width))).values()) for _ in range(300)]
    return {"limits": [ctl.max_verify_tokens, ctl.max_mask_bytes], "shapes": shapes,
            "shrunk": ctl.stats.shrunk_steps, "verify_kernels": ctl.verify_kernels}


def _rank(rank: int, init: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    import sglang.srt.speculative.ddtree_worker as dw

    result = {}
    for agree in (True, False):
        mine = _shapes(dw, agree)
        both: list = [None, None]
        dist.all_gather_object(both, mine)
        result["agreed" if agree else "control"] = {
            "identical": both[0] == both[1],
            "limits": [b["limits"] for b in both],
            "shrunk": [b["shrunk"] for b in both],
            "differing_steps": sum(a != b for a, b in zip(both[0]["shapes"], both[1]["shapes"], strict=True)),
        }
    import sglang.srt.speculative.ddtree_ranks as dr
    import sglang.srt.speculative.ddtree_verify_step as vs

    for name, passed in (("both passed", True), ("rank 1 failed", rank == 0)):
        before = len(vs._KERNELS_OFF)
        every = dr.agree_verify_kernels(passed, dist.group.WORLD)
        both = [None, None]
        dist.all_gather_object(both, {"every": every, "turned_off": vs._KERNELS_OFF[before:]})
        result.setdefault("kernels", {})[name] = both
    if rank == 0:
        a, c, k = result["agreed"], result["control"], result["kernels"]
        off = {"every": False, "turned_off": ["off on another TP rank"]}
        result["ok"] = (a["identical"] and a["shrunk"][0] > 0 and not c["identical"] and c["differing_steps"] > 0
                        and k["both passed"] == [{"every": True, "turned_off": []}] * 2
                        and k["rank 1 failed"] == [off, {"every": False, "turned_off": []}])
        with open(out_path, "w") as f:
            json.dump(result, f)
    # Neither rank tears gloo down while the other may still be receiving, and neither runs the interpreter's
    # finalisation with gloo's threads alive: a rank once aborted there ("terminate called without an active
    # exception", SIGABRT) on a loaded 2-core machine, after its work was done.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(f"file://{os.path.join(tmp, 'rdzv')}", out), nprocs=2, join=True)
        with open(out) as f:
            result = json.load(f)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
