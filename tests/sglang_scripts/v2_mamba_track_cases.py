"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, the payload's `ddtree_v2_args.py` and
`ddtree_args.py` beside upstream's): which track slots a linear DFLASH verify is built with, and which verify step
upstream's commit snapshots into them for the radix cache's recurrent-state tracking, before and after
`load_plugins()`; prints one JSON object.

What runs for real: `DFlashWorkerV2._update_target_mamba_state_after_verify` and `DFlashVerifyInput.prepare_for_verify`
(each base's own, with `spec_utils.prepare_mamba_track_for_verify` and `set_mamba_track_indices_from_reqs`) and
SGLang's `HookRegistry` applying what `ddtree_v2_args` registers at import. Stand-ins, and why: the attention backend
(records the step indices it is asked to snapshot: the copy itself is a GPU kernel), the worker's other fields (no
model on a CPU), the runtime bag's track interval and extra-buffer setting (`get_exec()` / `get_server_args()` /
`mamba_track_grid`, read-only configuration), `ForwardBatch.init_new` (records the slots the verify's forward batch
is built from, then stops: the rest needs a model runner), pinned host memory (needs a GPU driver).
The oracle: for each request, the last verify step (0-based, within its committed tokens) after which its length
is a multiple of the interval, else -1 (the state the scheduler records as `mamba_last_track_seqlen`).

Usage: python v2_mamba_track_cases.py
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative import ddtree_v2_args as v2args  # registers the hooks at import
from sglang.srt.speculative import dflash_worker_v2 as dw
from sglang.version import __version__


class _Backend:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def update_mamba_state_after_mtp_verify(self, **kwargs) -> None:
        self.calls.append(kwargs)


def oracle(pre: list[int], commit: list[int], interval: int) -> list[int]:
    return [max([j for j in range(c) if (p + j + 1) % interval == 0], default=-1)
            for p, c in zip(pre, commit, strict=True)]


def tracked(pre: list[int], commit: list[int], interval: int) -> list[int] | None:
    """The steps the base's commit asks the backend to snapshot (None: it asked for none)."""
    backend = _Backend()
    worker = object.__new__(dw.DFlashWorkerV2)
    worker._need_mamba_verify_commit = True
    worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, model=None))
    seq_lens = torch.tensor(pre, dtype=torch.int64)  # as the step left it: not advanced (17:…:1672, :1840)
    commit_lens = torch.tensor(commit, dtype=torch.int32)
    n = len(pre)
    batch = SimpleNamespace(seq_lens=seq_lens, mamba_track_indices=torch.arange(n, dtype=torch.int64),
                            req_pool_indices=torch.arange(n, dtype=torch.int64),
                            tree_cache=SimpleNamespace(page_size=1))
    kwargs = dict(batch=batch, seq_lens_pre_verify=seq_lens.clone(), commit_lens=commit_lens)
    params = inspect.signature(dw.DFlashWorkerV2._update_target_mamba_state_after_verify).parameters
    if "seq_lens_post_verify" in params:  # 0.5.23 is handed the post-verify lengths by its caller
        kwargs["seq_lens_post_verify"] = seq_lens + commit_lens.to(seq_lens.dtype)
    bag = SimpleNamespace(mamba=SimpleNamespace(mamba_track_interval=interval))
    with mock.patch.object(dw, "get_exec", lambda: bag), \
            mock.patch.object(dw, "mamba_track_grid", lambda page: interval, create=True):
        worker._update_target_mamba_state_after_verify(**kwargs)
    (call,) = backend.calls
    assert torch.equal(call["last_correct_step_indices"], commit_lens.to(torch.int64) - 1)
    steps = call["mamba_steps_to_track"]
    return None if steps is None else [int(s) for s in steps]


def cases(seed: int, n: int = 400) -> list[tuple[list[int], list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        interval = rng.choice([16, 32, 64, 128])
        bs = rng.randint(1, 8)
        pre = [rng.randint(1, 600) for _ in range(bs)]
        commit = [rng.randint(1, 16) for _ in range(bs)]
        out.append((pre, commit, interval))
    return out


def run(seed: int) -> dict:
    agree, crossings, wrong = 0, 0, []
    for pre, commit, interval in cases(seed):
        want = oracle(pre, commit, interval)
        got = tracked(pre, commit, interval)
        crossings += sum(s >= 0 for s in want)
        if got == want:
            agree += 1
        elif len(wrong) < 5:
            wrong.append({"pre": pre, "commit": commit, "interval": interval, "want": want, "got": got})
    return {"agree": agree, "cases": len(cases(seed)), "crossings": crossings, "wrong": wrong}


class _Unpinned:
    """torch, its host tensors never pinned (pinning needs a GPU driver)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        return torch.tensor(data, *args, **kwargs)


class _Built(Exception):
    """`ForwardBatch.init_new` was reached: what it was handed is recorded."""


def verify_slots() -> dict:
    """The track slots (and the extend-time mask) the verify's forward batch is built from, after the base's own
    `DFlashVerifyInput.prepare_for_verify` on a decode batch whose slots a filter / merge nulled and whose extend-time
    mask is stale; the oracle: each request's ping-pong slot at its `mamba_next_track_idx`."""
    from sglang.srt.managers import schedule_batch as sb
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import dflash_info as di
    from sglang.srt.speculative import spec_utils as su

    mapping = torch.arange(100, 112, dtype=torch.int64).view(6, 2)  # request row -> its two ping-pong track slots
    rows = torch.tensor([3, 0, 5, 2])
    reqs = [SimpleNamespace(mamba_next_track_idx=i % 2, kv=SimpleNamespace(mamba_next_track_idx=i % 2))  # 0.5.23: .kv
            for i in range(4)]
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs, req_pool_indices=rows,
                            req_to_token_pool=SimpleNamespace(req_index_to_mamba_ping_pong_track_buffer_mapping=mapping),
                            mamba_track_indices=None, mamba_track_mask=torch.ones(4, dtype=torch.bool),
                            mamba_track_seqlens=None, input_ids=None, spec_info=None)
    seen: dict = {}

    def init_new(b, runner, **kwargs):
        seen["slots"] = None if b.mamba_track_indices is None else b.mamba_track_indices.tolist()
        seen["mask"] = None if b.mamba_track_mask is None else b.mamba_track_mask.tolist()
        raise _Built

    verify = object.__new__(di.DFlashVerifyInput)
    verify.__dict__.update(draft_token=torch.zeros(16, dtype=torch.int64), capture_hidden_mode=None, draft_token_num=4,
                           live_seq_lens_cpu=None)
    flags = SimpleNamespace(enable_mamba_extra_buffer=lambda: True, enable_mamba_extra_buffer_lazy=lambda: False)
    bag = SimpleNamespace(mamba=SimpleNamespace(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=False))
    with mock.patch.object(di, "ForwardBatch", SimpleNamespace(init_new=init_new)), \
            mock.patch.object(v2args._shared, "running_server_args", lambda: flags), \
            mock.patch.object(su, "get_server_args", lambda: flags, create=True), \
            mock.patch.object(su, "get_exec", lambda: bag, create=True), \
            mock.patch.object(sb, "torch", _Unpinned()), contextlib.suppress(_Built):
        di.DFlashVerifyInput.prepare_for_verify(verify, batch, SimpleNamespace(model_runner=None))
    seen["want"] = [int(mapping[int(r), reqs[i].mamba_next_track_idx]) for i, r in enumerate(rows)]
    return seen


def main() -> None:
    original = dw.DFlashWorkerV2._update_target_mamba_state_after_verify
    before, slots_before = run(1), verify_slots()
    registered = v2args.register_mamba_track()
    load_plugins()
    print(json.dumps({"version": __version__, "registered": registered, "before": before, "after": run(2),
                      "slots_before": slots_before, "slots_after": verify_slots(),
                      "hooked": dw.DFlashWorkerV2._update_target_mamba_state_after_verify is not original}))


if __name__ == "__main__":
    main()
