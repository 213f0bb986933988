"""Run inside an unpacked SGLang 0.5.17 tree with the 0.5.17 payload installed (on PYTHONPATH): check the v2 tree
step's hybrid half (`ddtree_v2_hybrid.py` and its calls in `ddtree_worker_v2.py`) against the real upstream code and
print one JSON object.

What runs for real: the payload modules; SGLang's `HookRegistry`; `MambaAttnBackendBase.__init__`,
`_forward_metadata`, `_replay_metadata` and `init_cuda_graph_state` on GDN / Mamba-2 backend objects;
`conv_window_dedup_enabled` and `MambaPool.__init__` (meta tensors: the pool hard-wires "cuda"; `_is_cpu` forced
off so the layout decision is the GPU's); `KVCacheConfigurator._handle_max_mamba_cache`;
`HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`; the worker's `_tree_step`.
Stand-ins: the backends' model runner and pools (attributes only), the config bags the memory plan reads (real
`_ConfigBag`s), SGLang's Triton scatter kernel (its semantics in torch: `dst[slot_b] = src[b, step_b]`, step < 0
skipped), and, for whole decode steps, a made-up stateful hybrid target: a recurrence over the tokens that a node
computes from its parent's state, the parents derived from the verify input's first-child / next-sibling arrays the
way SGLang's conv kernel derives them, the next token a function of the state; plain decoding of it is the oracle.

Usage: python v2_hybrid_cases.py   (env: the DDTree test switches as the case needs)
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import v2_worker_cases as wc  # noqa: E402
from sglang.srt.layers.attention import hybrid_linear_attn_backend as hlab  # noqa: E402
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend  # noqa: E402
from sglang.srt.mem_cache import kv_cache_configurator as kvc  # noqa: E402
from sglang.srt.mem_cache import memory_pool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import _ConfigBag  # noqa: E402
from sglang.srt.speculative import ddtree_hybrid_state as hs  # noqa: E402
from sglang.srt.speculative import ddtree_v2_hybrid as hy  # noqa: E402
from sglang.srt.speculative import ddtree_v2_seams as seams  # noqa: E402
from sglang.srt.speculative import ddtree_worker_v2 as w  # noqa: E402
from sglang.srt.speculative.ddtree_sampling import tree_walk  # noqa: E402
from sglang.srt.speculative.ddtree_stats import DDTreeStats  # noqa: E402
from sglang.srt.speculative.ddtree_utils import build_ddtree  # noqa: E402
from sglang.srt.speculative.dflash_info import DFlashVerifyInput  # noqa: E402
from sglang.version import __version__  # noqa: E402

BUDGET, WIDTH = 7, 8  # the tree, 1 + budget


# --- the recurrence and the commit oracle ----------------------------------------------------------------------
P = (1 << 61) - 1


def step(state: int, token: int) -> int:
    """An order-sensitive recurrence (like an SSM state)."""
    return (state * 1_000_003 + token + 1) % P


def node_states(start: int, tokens: list[int], parents: list[int]) -> list[int]:
    """Every node's state as SGLang's tree kernels compute it: index order, each from its parent's (the root from
    the pool's)."""
    out = [0] * len(tokens)
    for i, tok in enumerate(tokens):
        out[i] = step(start if i == 0 else out[parents[i]], tok)
    return out


def walk_oracle(parents: list[int], tokens: list[int], target: list[int], num_nodes: int) -> list[int]:
    """The accepted path by hand: from the root follow the child holding the target's token."""
    path, node = [0], 0
    while True:
        kids = [c for c in range(1, num_nodes) if parents[c] == node and tokens[c] == target[node]]
        if not kids:
            return path
        node = kids[0]
        path.append(node)


def stand_in_runner(*, draft: bool = False) -> SimpleNamespace:
    pool = SimpleNamespace(get_mamba_indices=lambda rows: rows.to(torch.int32) + 100,
                           translate_mamba_indices=lambda idx: idx,
                           mamba_pool=SimpleNamespace(enable_linear_replayssm=False))
    return SimpleNamespace(device="cpu", is_draft_worker=draft, req_to_token_pool=pool, token_to_kv_pool=None,
                           server_args=SimpleNamespace(speculative_eagle_topk=1, enable_unified_memory=False))


def hybrid_step(fault: str = "") -> hy.HybridStepV2:
    """A started `HybridStepV2` on a stand-in target: a GDN backend in tree mode, dense per-node states."""
    if fault:
        os.environ["SGLANG_DDTREE_TEST_MAMBA_COMMIT"] = fault
    else:
        os.environ.pop("SGLANG_DDTREE_TEST_MAMBA_COMMIT", None)
    step_ = hy.HybridStepV2(WIDTH)
    linear = object.__new__(GDNAttnBackend)
    linear.topk = 2
    rows = 6
    cache = SimpleNamespace(intermediate_ssm=torch.zeros((1, rows, WIDTH, 1), dtype=torch.int64),
                            intermediate_conv_window=[torch.zeros((1, rows, WIDTH, 1), dtype=torch.int64)])
    runner = SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=linear),
                             req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache)),
                             server_args=SimpleNamespace(tp_size=1))
    step_.start(runner)
    return step_


def last_crossed(before: int, after: int, interval: int) -> int | None:
    """The last multiple of `interval` a step from `before` to `after` tokens crossed (the state after it is the one
    the radix cache keeps), by counting; None when it crossed none."""
    crossed = [t for t in range(before + 1, after + 1) if interval and t % interval == 0]
    return crossed[-1] if crossed else None


def index_oracle(trials: int = 60) -> dict:
    """The committed index per request (the worker's `HybridStepV2.commit_steps`, on the walk `tree_walk` gives)
    against an independent walk by hand: the last node on the accepted path; its state equals the recurrence over
    the committed tokens in order. DFLASH's chain rule (`commit_len - 1`) and the test faults must miss. The tracked
    index (`track_offsets` at a random prefix length and track interval, mapped the same way) against v1's scalar rule
    (`ddtree_hybrid_state.track_step`) and the state after the crossed multiple, by hand."""
    rng = random.Random(11)
    good = hybrid_step()
    faults = {f: hybrid_step(f) for f in ("chain", "deepest", "skip")}
    bad: list[str] = []
    requests = off_chain = crossings = 0
    wrong = dict.fromkeys(["dflash_rule", *faults], 0)
    track_wrong = dict.fromkeys(faults, 0)
    for trial in range(trials):
        bs, depth, vocab = rng.randint(1, 5), rng.randint(2, 7), rng.randint(3, 9)
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn((bs, depth, vocab), generator=gen) * rng.choice([1.0, 3.0])
        tree = build_ddtree(logits, rng.randint(1, 20), rng.choice([None, 2, 3]), keep_chain=False)
        n = tree.parents.shape[1]
        bonus = torch.randint(0, vocab, (bs,), generator=gen)
        tokens = tree.full_token_ids(bonus)
        parents_t = tree.parents.tolist()
        # target tokens that follow some child often (not only the best-first one)
        target = torch.randint(0, vocab, (bs, n), generator=gen)
        for b in range(bs):
            for i in range(n):
                kids = [c for c in range(1, int(tree.num_nodes[b])) if parents_t[b][c] == i]
                if kids and rng.random() < 0.8:
                    target[b, i] = tokens[b, rng.choice(kids)]
        verify_logits = torch.full((bs, n, vocab), -4.0).scatter_(2, target[:, :, None], 4.0)
        accepted, accept_lens, _ = tree_walk(tree, tokens, verify_logits, sampled_rows=[])
        commit_lens = accept_lens.to(torch.int32) + 1
        interval = rng.randint(1, 6)
        before = torch.tensor([rng.randrange(3 * interval + 1) for _ in range(bs)])
        offsets = hy.track_offsets(before, commit_lens, interval)
        got, tracked = (x.tolist() for x in good.commit_steps(tree, accepted, commit_lens, offsets))
        chain = (commit_lens.to(torch.int64) - 1).tolist()
        by_fault = {f: [x.tolist() for x in s.commit_steps(tree, accepted, commit_lens, offsets)]
                    for f, s in faults.items()}
        for b in range(bs):
            requests += 1
            k = int(tree.num_nodes[b])
            toks = tokens[b].tolist()
            path = walk_oracle(parents_t[b], toks, target[b].tolist(), k)
            parents_k = hs.parents_from_retrieve(tree.retrive_next_token[b].tolist(),
                                                 tree.retrive_next_sibling[b].tolist())
            start = rng.randrange(P)
            states = node_states(start, toks, parents_k)
            linear = start
            for node in path:
                linear = step(linear, toks[node])
            if got[b] != path[-1] or got[b] != hs.commit_step(path, len(path)) or states[got[b]] != linear:
                bad.append(f"{trial}/{b}: committed {got[b]}, path {path}")
            if len(path) != int(commit_lens[b]):
                bad.append(f"{trial}/{b}: commit_len {int(commit_lens[b])} for path {path}")
            off_chain += path != list(range(len(path)))
            wrong["dflash_rule"] += chain[b] < 0 or states[chain[b]] != linear
            for f, (steps, _) in by_fault.items():
                wrong[f] += steps[b] < 0 or states[steps[b]] != linear
            # tracking: the state after the crossed multiple T of the interval, by hand
            pre = int(before[b])
            want = last_crossed(pre, pre + len(path), interval)  # the state after `want` tokens: offset want - pre - 1
            expected = -1 if want is None else path[want - pre - 1]
            if tracked[b] != hs.track_step(path, len(path), pre, interval) or tracked[b] != expected:
                bad.append(f"{trial}/{b}: tracked {tracked[b]}, want {expected} (path {path}, {pre}, {interval})")
            if expected >= 0:
                crossings += 1
                state_t = start
                for node in path[: want - pre]:
                    state_t = step(state_t, toks[node])
                if states[tracked[b]] != state_t:
                    bad.append(f"{trial}/{b}: tracked state is not the state after {want} tokens")
                for f, (_, track_f) in by_fault.items():
                    track_f_b = track_f[b] if track_f is not None else -1
                    track_wrong[f] += track_f_b < 0 or states[track_f_b] != state_t
    return {"bad": bad[:10], "requests": requests, "off_chain": off_chain, "wrong": wrong, "crossings": crossings,
            "track_wrong": track_wrong}


# --- whole decode steps on a stateful stand-in hybrid target ------------------------------------------------------
VOCAB, BLOCK = 11, 4


def next_token(state: int) -> int:
    return (state >> 17) % VOCAB


def plain(start: int, bonus: int, count: int) -> list[int]:
    out, state, tok = [], start, bonus
    for _ in range(count):
        state = step(state, tok)
        tok = next_token(state)
        out.append(tok)
    return out


def scatter(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor) -> None:
    """SGLang's `_fused_mamba_state_scatter_with_mask_kernel`: dst[l, slot_b] = src[l, b, step_b], step < 0 skipped."""
    for b in range(steps.shape[0]):
        s = int(steps[b])
        if 0 <= s < src.shape[2] and 0 <= int(slots[b]) < dst.shape[1]:
            dst[:, int(slots[b])] = src[:, b, s]


def decode_run(seed: int, fault: str = "", attach: bool = True, steps_n: int = 6, track_interval: int = 0,
               track_fault: str = "") -> dict:
    """Several tree steps of the worker on a hybrid stand-in target; the emitted tokens must be plain decoding's. With
    `track_interval`, the batch tracks states for the radix cache (SGLang's runtime bag gives the interval): each
    crossed multiple `T` of it must leave the state after `T` tokens in the request's track slot. `track_fault`: what
    the test must catch, 0.5.17's upstream rule (`upstream`: the pre-verify length against itself) or the path offsets
    used as node indices (`unmapped`: DFLASH's chain layout)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs, width_row = 3, 80
    rows = torch.tensor([2, 0, 3])
    slots = rows.to(torch.int32) + 100  # the requests' mamba pool slots (the verify's own metadata)
    req_to_token = torch.zeros((4, width_row), dtype=torch.int32)
    req_to_token.view(-1)[:] = torch.randperm(4 * width_row, generator=gen).to(torch.int32) + 1
    starts = [rng.randrange(P) for _ in range(bs)]
    track_slots = rows.to(torch.int64) + 200  # the requests' radix-cache track slots
    pool_ssm = torch.zeros((1, 210, 1), dtype=torch.int64)
    for b in range(bs):
        pool_ssm[0, int(slots[b]), 0] = starts[b]
    inter = torch.zeros((1, bs + 1, WIDTH, 1), dtype=torch.int64)

    hybrid = hybrid_step(fault)
    if not attach:
        hybrid.attach_tree = lambda verify_input, tree: None
    linear = SimpleNamespace(forward_metadata=SimpleNamespace(mamba_cache_indices=slots), req_to_token_pool=SimpleNamespace(
        get_speculative_mamba2_params_all_layers=lambda: SimpleNamespace(
            temporal=pool_ssm, intermediate_ssm=inter, conv=[pool_ssm], intermediate_conv_window=[inter]),
        mamba_pool=SimpleNamespace(replayssm_is_kda=False)))
    backend = object.__new__(hlab.HybridLinearAttnBackend)
    backend.linear_attn_backend = linear
    tracked_writes = [0]

    def scatter_after_verify(caches, idx, steps, track, track_steps) -> None:  # the fused kernel's two scatters
        scatter(caches.temporal, caches.intermediate_ssm, idx, steps)
        if track is not None:
            scatter(caches.temporal, caches.intermediate_ssm, track, track_steps)
            tracked_writes[0] += int((track_steps >= 0).sum())

    hlab.scatter_mamba_states_after_mtp_verify = scatter_after_verify
    hy.get_exec = lambda: SimpleNamespace(mamba=SimpleNamespace(mamba_track_interval=track_interval))
    commits: list[list[int]] = []
    off_chain = [0]  # commits whose node is not DFLASH's chain index
    real_commit = hybrid.commit_steps

    def recording(tree, accepted, commit_lens, track=None):
        steps, tracked = real_commit(tree, accepted, commit_lens, track)
        if track_fault == "unmapped":
            tracked = track
        commits.append(steps.tolist())
        off_chain[0] += int((steps != commit_lens.to(torch.int64) - 1).sum())
        return steps, tracked

    hybrid.commit_steps = recording

    prefix = torch.tensor([5, 9, 2])
    bonus = torch.randint(0, VOCAB, (bs,), generator=gen)
    emitted: list[list[int]] = [[] for _ in range(bs)]
    want = [plain(starts[b], int(bonus[b]), steps_n * BLOCK) for b in range(bs)]
    recorded: dict = {}
    fed = [[int(bonus[b])] for b in range(bs)]  # every token each request has consumed or will next, in order
    initial = prefix.tolist()
    crossings, track_bad = 0, []

    def prepare_for_verify(self, batch, target_worker):
        recorded["verify"] = self
        return SimpleNamespace(spec_info=self), False

    def target_forward(batch=None, forward_batch=None, is_verify=False, skip_attn_backend_init=False):
        v = forward_batch.spec_info
        n = v.draft_token_num
        toks = v.draft_token.view(bs, n).tolist()
        nt, ns = getattr(v, "retrieve_next_token", None), getattr(v, "retrieve_next_sibling", None)
        logits = torch.full((bs * n, VOCAB), -5.0)
        for b in range(bs):
            if nt is None:  # no tree arrays: the kernels run a chain (each node after the one before)
                parents = [max(i - 1, 0) for i in range(n)]
            else:
                parents = hs.parents_from_retrieve(nt[b].tolist(), ns[b].tolist())
            states = node_states(int(pool_ssm[0, int(slots[b]), 0]), toks[b], parents)
            for i, s in enumerate(states):
                inter[0, b, i, 0] = s
                logits[b * n + i, next_token(s)] = 5.0
        hidden = torch.arange(bs * n, dtype=torch.float32)[:, None].repeat(1, 2)
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
                               can_run_cuda_graph=False)

    DFlashVerifyInput.prepare_for_verify = prepare_for_verify
    wc.s.assign_extend_cache_locs_func = wc.assign_cache_locs  # the shared step prepares the draft block
    worker = object.__new__(w.DDTreeWorkerV2)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.eye(VOCAB)),
                            get_input_embeddings=lambda: (lambda ids: ids[..., None].float()))
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), model=model,
                             attn_backend=backend)
    draft_hidden = torch.zeros((bs, BLOCK, VOCAB))
    worker.__dict__.update(
        block_size=BLOCK, device=torch.device("cpu"), model_runner=runner, _mask_token_id=VOCAB - 1,
        _target_worker=SimpleNamespace(model_runner=runner, forward_batch_generation=target_forward),
        draft_model_runner=SimpleNamespace(forward=lambda fb: SimpleNamespace(
            logits_output=SimpleNamespace(hidden_states=draft_hidden.reshape(-1, VOCAB)))),
        _draft_block_spec_info=None, _block_pos_offsets=torch.arange(BLOCK), _draft_block_ids_buf=None,
        tree_budget=BUDGET, tree_topk_cap=None, tree_keep_chain=False, sampling_rule="pytorch",
        ddtree_stats=DDTreeStats(),
        _append_target_hidden_to_draft_kv_by_loc=lambda **kw: None, _ddtree_hybrid=hybrid,
    )
    draft_input = seams.DDTreeDraftInputV2.from_dflash(
        w.DFlashWorkerV2._make_next_draft_input_decode(worker, bonus_tokens=bonus, new_seq_lens=prefix))
    arrays_sent = True
    real_offsets = hy.track_offsets
    if track_fault == "upstream":
        hy.track_offsets = lambda pre, lens, interval: real_offsets(pre, lens * 0, interval)
    for i in range(steps_n):
        # the draft guesses plain's next tokens at most depths (from the true pool state: a guess, not a reading)
        draft_hidden.normal_(generator=gen)
        for b in range(bs):
            guess = plain(int(pool_ssm[0, int(slots[b]), 0]), int(draft_input.bonus_tokens[b]), BLOCK - 1)
            for d, tok in enumerate(guess):
                if rng.random() < 0.7:
                    draft_hidden[b, d + 1, tok] += 6.0
        batch = SimpleNamespace(seq_lens=prefix.clone(), seq_lens_cpu=prefix.clone().to(torch.int32),
                                seq_lens_sum=int(prefix.sum()), req_pool_indices=rows, spec_info=draft_input,
                                out_cache_loc=None, sampling_info=None, reqs=[None] * bs,
                                mamba_track_indices=track_slots if track_interval else None)
        before = prefix.tolist()
        result = worker._tree_step(batch, None)
        arrays_sent &= getattr(recorded["verify"], "retrieve_next_token", None) is not None
        out = result.next_token_ids.view(bs, BLOCK).tolist()
        for b in range(bs):
            emitted[b] += out[b][: int(result.accept_lens[b])]
            fed[b] += out[b][: int(result.accept_lens[b])]
            crossed = last_crossed(before[b], int(result.new_seq_lens[b]), track_interval)
            if crossed is not None:  # the state after `crossed` tokens, by the recurrence over what was consumed
                crossings += 1
                state = starts[b]
                for tok in fed[b][: crossed - initial[b]]:
                    state = step(state, tok)
                if int(pool_ssm[0, int(track_slots[b]), 0]) != state:
                    track_bad.append(f"step {i} request {b}: track slot holds no state after {crossed} tokens")
        prefix = result.new_seq_lens
        draft_input = result.next_draft_input
    hy.track_offsets = real_offsets
    lens = [len(e) for e in emitted]
    report = worker.ddtree_internal_state()  # /server_info's ddtree: the tree steps and the hybrid layers
    return {"report": {"tree_steps": report["tree_steps"], "hybrid": report["hybrid"]},
            "plain": all(emitted[b] == want[b][: lens[b]] for b in range(bs)), "tokens": sum(lens),
            "steps": steps_n, "deep": sum(1 for c in commits for s in c if s > 0),
            "arrays_sent": arrays_sent, "commits": len(commits), "off_chain": off_chain[0], "crossings": crossings,
            "tracked": tracked_writes[0], "track_bad": track_bad[:5]}


# --- the hooks: inert without the switch, active with it ----------------------------------------------------------
def dedup_answer() -> bool:
    return bool(memory_pool.conv_window_dedup_enabled(False, False, 1, False))


def topk_answers() -> dict:
    out = {}
    for name, cls in (("gdn", GDNAttnBackend), ("mamba2", hlab.Mamba2AttnBackend)):
        for draft in (False, True):
            backend = object.__new__(cls)
            hlab.MambaAttnBackendBase.__init__(backend, stand_in_runner(draft=draft))
            out[f"{name}{'_draft' if draft else ''}"] = backend.topk
    return out


def bag(path: str, **fields) -> _ConfigBag:
    b = _ConfigBag(path)
    for k, v in fields.items():
        b._set(k, v)
    return b


PER_REQ = 1 << 20  # bytes of one request's state over all layers


class _Configurator(kvc.KVCacheConfigurator):
    """The real class (slotted dataclass) made without `__init__`; the mamba/full ratio fixed at 1."""

    def _calculate_mamba_ratio(self) -> int:
        return 1


def publish(spec: _ConfigBag, exec_: _ConfigBag, sched: _ConfigBag, mem: _ConfigBag) -> None:
    """The bags `kv_cache_configurator` reads through its module bindings, and `override` writing into `sched`."""
    kvc.get_spec, kvc.get_exec, kvc.get_schedule, kvc.get_memory = (lambda: spec), (lambda: exec_), (
        lambda: sched), (lambda: mem)

    def override(source: str, **fields) -> None:
        for k, v in fields.items():
            sched._set(k, v)

    kvc.get_context = lambda: SimpleNamespace(override=override)


def plan_answers() -> dict:
    """`_handle_max_mamba_cache` on stand-in bags: radix off with max_running set, and the auto-fit solve (radix on),
    each with its closed form at D = block and at D = 1 + budget."""
    spec = bag("spec", speculative_num_draft_tokens=4, speculative_eagle_topk=1)
    exec_ = bag("exec")
    exec_._set_sub("mamba", bag("exec.mamba", enable_linear_replayssm_spec=False, linear_replayssm_cache_len=16))
    out = {}
    for name, radix_off in (("radix_off", True), ("auto_fit", False)):
        sched = bag("schedule", max_running_requests=8, max_mamba_cache_size=None, mamba_full_memory_ratio=0.9,
                    disable_overlap_schedule=True, page_size=1)
        mem = bag("memory", disable_radix_cache=radix_off)
        publish(spec, exec_, sched, mem)
        conf = object.__new__(_Configurator)
        for k, v in dict(
            mambaish_config=SimpleNamespace(mamba2_cache_params=SimpleNamespace(layers=[0, 1, 2],
                                                                                mamba_cache_per_req=PER_REQ)),
            server_args=SimpleNamespace(max_speculative_num_draft_tokens=WIDTH),
            ps=SimpleNamespace(pp_size=1, attn_dp_size=1), spec_algorithm=SimpleNamespace(is_none=lambda: False),
            hybrid_gdn_config=object(), model_config=None, is_draft_worker=False,
        ).items():
            setattr(conf, k, v)
        rest = conf._handle_max_mamba_cache(100.0)
        out[name] = {"rest": rest, "max_mamba_cache_size": sched.max_mamba_cache_size,
                     "block_after": spec.speculative_num_draft_tokens}
    return out


def plan_oracle(width: int) -> dict:
    gib = 1 << 30
    k = 8  # radix off: max_running_requests
    radix_off = 100.0 - PER_REQ * (k + 1) * width / gib - (k + 1) * PER_REQ / gib
    budget = 100.0 * 0.9 / 1.9 * gib
    k_fit = int((budget - PER_REQ * (1 + width)) // (PER_REQ * (1 + width / 1)))
    capped = min(8, k_fit)
    auto_fit = 100.0 - PER_REQ * (capped + 1) * width / gib - (k_fit + 1) * PER_REQ / gib
    return {"radix_off": [radix_off, k], "auto_fit": [auto_fit, k_fit]}


def forward_batch(spec, bs: int = 2) -> SimpleNamespace:
    return SimpleNamespace(batch_size=bs, req_pool_indices=torch.arange(bs), mamba_track_indices=None,
                           mamba_track_mask=None, _original_batch_size=None, forward_mode=ForwardMode.TARGET_VERIFY,
                           spec_info=spec, input_ids=torch.zeros(bs * WIDTH, dtype=torch.int64))


def tree_verify_input(bs: int = 2):
    tree = build_ddtree(torch.randn((bs, 3, 5), generator=torch.Generator().manual_seed(3)) * 3, BUDGET)
    v = DFlashVerifyInput(draft_token=torch.zeros(bs * WIDTH, dtype=torch.int64),
                          positions=torch.zeros(bs * WIDTH, dtype=torch.int64), draft_token_num=WIDTH)
    hy.HybridStepV2.attach_tree(v, tree)
    return v, tree


def linear_input(bs: int = 2):
    return DFlashVerifyInput(draft_token=torch.zeros(bs * WIDTH, dtype=torch.int64),
                             positions=torch.zeros(bs * WIDTH, dtype=torch.int64), draft_token_num=WIDTH)


def metadata_answers() -> dict:
    """Eager `_forward_metadata` and graph `_replay_metadata` of a GDN backend in tree mode, for a DDTree verify
    (tree arrays) and for upstream's linear step (none)."""
    out = {}
    backend = object.__new__(GDNAttnBackend)
    hlab.MambaAttnBackendBase.__init__(backend, stand_in_runner())
    backend.topk = 2  # tree mode, as the hook sets it on a hybrid DDTree target
    try:
        meta = hlab.MambaAttnBackendBase._forward_metadata(backend, forward_batch(linear_input()))
        out["eager_linear"] = "none" if meta.retrieve_next_token is None and meta.retrieve_parent_token is None else "arrays"
    except AttributeError as e:
        out["eager_linear"] = f"AttributeError: {e}"
    v, tree = tree_verify_input()
    meta = hlab.MambaAttnBackendBase._forward_metadata(backend, forward_batch(v))
    out["eager_tree"] = (torch.equal(meta.retrieve_next_token, tree.retrive_next_token)
                         and torch.equal(meta.retrieve_next_sibling, tree.retrive_next_sibling)
                         and meta.retrieve_parent_token is not None)
    backend.init_cuda_graph_state(4, 4 * WIDTH)
    bs = 2

    def replay(spec):
        hlab.MambaAttnBackendBase._replay_metadata(backend, bs, torch.arange(bs), ForwardMode.TARGET_VERIFY, spec,
                                                   torch.tensor([5, 6]), num_padding=0)
        return backend.retrieve_next_token_list[bs - 1].tolist(), backend.retrieve_next_sibling_list[bs - 1].tolist()

    out["replay_tree"] = replay(v) == (tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist())
    chain = [list(range(1, WIDTH)) + [-1]] * bs, [[-1] * WIDTH] * bs
    after = replay(linear_input())
    out["replay_linear"] = "chain" if after == chain else (
        "previous tree" if after == (tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist()) else "other")
    return out


def hooks() -> dict:
    """Each hook's answer before anything is installed, installed but inactive, active, deactivated."""
    out = {}
    for phase in ("pristine", "installed_inactive", "active", "deactivated"):
        if phase == "installed_inactive":
            hy.install()
        elif phase == "active":
            hy.activate(hy.HybridSettings(verify_width=WIDTH))
        elif phase == "deactivated":
            hy.deactivate()
        out[phase] = {"dedup": dedup_answer(), "topk": topk_answers(), "plan": plan_answers(),
                      "metadata": metadata_answers()}
    out["plan_oracle"] = {"block": plan_oracle(4), "tree": plan_oracle(WIDTH)}
    return out


# --- SGLang's own MambaPool: the per-node states' width and layout --------------------------------------------------
def _meta_zeros(*args, size=None, dtype=None, device=None, **kwargs):
    if size is None:
        size = args[0] if len(args) == 1 and isinstance(args[0], tuple | list | torch.Size) else args
    return torch.empty(size, dtype=dtype, device="meta")


def mamba_pool_answers() -> dict:
    """`MambaPool.__init__` as the target's pool is built (width = max_speculative_num_draft_tokens = 1 + budget,
    DFLASH's topk 1), before and while the hooks are active, and the worker's start check on each pool."""
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=1):  # no process group here
        params = Qwen3NextConfig(num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_conv_kernel_dim=4).mamba2_cache_params
    zeros, is_cpu = torch.zeros, memory_pool._is_cpu
    memory_pool._is_cpu = False  # decide the layout as on the GPU (CPU always keeps dense windows)
    out = {}
    for phase, on in (("inactive", False), ("active", True)):
        hy.activate(hy.HybridSettings(verify_width=WIDTH)) if on else hy.deactivate()
        torch.zeros = _meta_zeros  # memory_pool calls torch.zeros through the module
        try:
            pool = memory_pool.MambaPool(size=4, spec_state_size=3, cache_params=params, device="cpu",
                                         mamba_layer_ids=params.layers, speculative_num_draft_tokens=WIDTH,
                                         speculative_eagle_topk=1)
        finally:
            torch.zeros = zeros
        cache = pool.mamba_cache
        window = cache.intermediate_conv_window[0]
        linear = object.__new__(GDNAttnBackend)
        linear.topk = 2
        runner = SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=linear),
                                 req_to_token_pool=SimpleNamespace(mamba_pool=pool),
                                 server_args=SimpleNamespace(tp_size=1))
        try:
            hy.HybridStepV2(WIDTH).start(runner)
            start = None
        except hy.DDTreeRefused as e:
            start = str(e)
        try:
            hy.HybridStepV2(WIDTH + 1).start(runner)  # a tree wider than the pool's states
            wider = None
        except hy.DDTreeRefused as e:
            wider = str(e)
        out[phase] = {"ssm": list(cache.intermediate_ssm.shape), "window": list(window.shape),
                      "dense": window.is_contiguous(), "start": start, "wider": wider,
                      "conv_dim": int(params.shape.conv[0][0]), "layers": len(params.layers)}
    hy.deactivate()
    memory_pool._is_cpu = is_cpu
    return out


# --- refusals ------------------------------------------------------------------------------------------------------
GOOD = {**wc.GOOD, "disable_radix_cache": True, "linear_attn_backend": "triton", "linear_attn_decode_backend": None,
        "linear_attn_prefill_backend": None, "linear_attn_verify_backend": None, "enable_linear_replayssm": False,
        "enable_linear_replayssm_spec": False, "enable_unified_memory": False, "enable_page_major_kv_layout": False,
        "mamba_radix_cache_strategy": None}
QWEN35 = ("gated-deltanet", "qwen3.5")
UNPROVEN_ON = {"SGLANG_DDTREE_TEST_UNPROVEN_HYBRID": "1", "SGLANG_DDTREE_ALLOW_TEST_SWITCHES": "1"}


def refusals() -> dict:
    cases = {
        "good": ({}, QWEN35, {}),
        "good moe": ({}, ("gated-deltanet", "qwen3.5-moe"), {}),
        "qwen3-next": ({}, ("gated-deltanet", "qwen3-next"), {}),
        "mamba2": ({}, (None, None), {}),
        "unproven": ({}, ("gated-deltanet", "qwen3.6"), {}),
        "unproven allowed": ({}, ("gated-deltanet", "qwen3.6"), UNPROVEN_ON),
        "radix": ({"disable_radix_cache": False}, QWEN35, {}),
        "radix tracked": ({"disable_radix_cache": False, "mamba_radix_cache_strategy": "extra_buffer"}, QWEN35, {}),
        "verify backend": ({"linear_attn_verify_backend": "flashinfer"}, QWEN35, {}),
        "decode backend": ({"linear_attn_decode_backend": "flashinfer"}, QWEN35, {}),
        "replayssm": ({"enable_linear_replayssm": True}, QWEN35, {}),
        "replayssm spec": ({"enable_linear_replayssm_spec": True}, QWEN35, {}),
        "unified": ({"enable_unified_memory": True}, QWEN35, {}),
        "page major": ({"enable_page_major_kv_layout": True}, QWEN35, {}),
    }
    out = {name: hy.refusal(SimpleNamespace(**{**GOOD, **change}), kind, env) for name, (change, kind, env)
           in cases.items()}
    # through the worker's v2_refusal, with this process's environment (the case's switches)
    out["v2_refusal"] = w.v2_refusal(SimpleNamespace(**GOOD), hybrid=True, hybrid_kind=QWEN35)
    out["v2_refusal dense"] = w.v2_refusal(SimpleNamespace(**GOOD), hybrid=False)
    return out


def kinds() -> dict:
    """`target_kind` on SGLang's own config classes (the layer type its runtime config gives, the architecture)."""
    from sglang.srt.configs.nemotron_h import NemotronHConfig
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    def model_config(hf):
        return SimpleNamespace(hf_config=hf, linear_attn_registry_result=None, is_draft_model=False)

    next_ = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"])
    return {"qwen3-next": list(hy.target_kind(model_config(next_))),
            "nemotron-h": list(hy.target_kind(model_config(NemotronHConfig())))}


if __name__ == "__main__":
    out = {"version": __version__}
    out["refusals"] = refusals()
    out["kinds"] = kinds()
    out["hooks"] = hooks()
    out["mamba_pool"] = mamba_pool_answers()
    out["index"] = index_oracle()
    out["decode"] = [decode_run(seed) for seed in range(4)]
    out["decode_tracked"] = [decode_run(seed, steps_n=10, track_interval=seed % 4 + 2) for seed in range(6)]
    out["decode_faults"] = {f: [decode_run(seed, fault=f) for seed in range(4)] for f in ("chain", "deepest", "skip")}
    out["decode_tracked_faults"] = {f: [decode_run(seed, steps_n=10, track_interval=seed % 4 + 2, track_fault=f)
                                        for seed in range(6)] for f in ("upstream", "unmapped")}
    out["decode_no_arrays"] = [decode_run(seed, attach=False) for seed in range(4)]
    print(json.dumps(out))
