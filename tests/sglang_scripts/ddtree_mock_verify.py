"""Run inside a patched sglang tree (PYTHONPATH): drive DDTreeVerifyInput.prepare_for_verify and
.verify with a fake ScheduleBatch on CPU and check the bookkeeping that makes full mode lossless:
emitted tokens = greedy decoding of a known target, committed KV slots = the accepted path's slots
in path order (req_to_token), all other slots freed, hidden states = the path's rows, custom mask =
prefix + ancestor mask in triton's row-major layout. Prints one JSON line; exit 0 only if all pass.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

import sglang.srt.speculative.ddtree_worker as dw
import torch
from sglang.srt.speculative.ddtree_penalties import chain_shape
from sglang.srt.speculative.ddtree_utils import build_ddtree, shrink_tree

VOCAB = 11
HID = 3


def fake_assign(req_pool_indices, req_to_token, start, end, out_cache_loc, bs):
    off = 0
    for i in range(bs):
        s, e = int(start[i]), int(end[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[off : off + (e - s)]
        off += e - s


class FakeAllocator:
    def __init__(self, size: int) -> None:
        self.free_slots = list(range(1, size))
        self.freed: list[int] = []

    def alloc(self, n: int) -> torch.Tensor:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, t: torch.Tensor) -> None:
        self.freed.extend(int(x) for x in t.flatten().tolist())


class FakeReq:
    def __init__(self, prompt: list[int], max_new: int, top_k: int = 1, top_p: float = 1.0) -> None:
        self.sampling_params = SimpleNamespace(top_k=top_k, top_p=top_p, min_p=0.0)
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.max_new = max_new
        self.grammar = None
        self.spec_verify_ct = 0
        self.spec_num_correct_drafts = 0
        self.kv_committed_len = len(prompt)
        self.kv_allocated_len = len(prompt)

    def update_finish_state(self) -> None:
        pass

    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


def target_next(seq: list[int]) -> int:
    """A deterministic 'target model': greedy next token of a sequence."""
    return (sum((i + 3) * t for i, t in enumerate(seq)) * 7 + len(seq)) % VOCAB


def main() -> int:
    torch.manual_seed(0)
    failures: list[str] = []
    steps = 0
    for trial in range(60):
        bs = 1 + trial % 3
        depth = 1 + trial % 5
        budget = [1, 3, 7, 15, 40][trial % 5]
        cap = [None, 1, 2, 4][trial % 4]
        n = budget + 1
        prefix = [int(x) for x in torch.randint(0, VOCAB, (bs,)) + 4]
        histories = [list(torch.randint(0, VOCAB, (prefix[i] + 1,)).tolist()) for i in range(bs)]
        # Draft logits that agree with the target often enough to accept several nodes.
        logits = torch.randn(bs, depth, VOCAB) * 2
        for i in range(bs):
            seq = list(histories[i])
            for d in range(depth):
                t = target_next(seq)
                if torch.rand(()) < 0.7:
                    logits[i, d, t] += 4.0
                seq.append(t)
        tree = build_ddtree(logits, budget, topk_cap=cap, keep_chain=budget >= depth and trial % 7 < 3)
        # Every fourth trial is a step padded to the graphs' width: the tree's first nodes hold KV
        # slots, the padding writes to the dummy slot 0.
        kv_width = 0
        if trial % 4 == 3:
            small = [0, budget // 2, budget - 1][trial % 3]
            tree, kv_width = shrink_tree(tree, small, pad=True), small + 1
        max_new = [64, 64, 2][trial % 3]
        # Every other trial samples some requests at a temperature so low that the target's peaked
        # node logits are one-hot: the sampled walk must then emit exactly the greedy walk.
        sampled = [trial % 2 == 1 and i % 2 == 0 for i in range(bs)]
        reqs = [FakeReq(histories[i][:-1], max_new, top_k=(1 << 30) if sampled[i] else 1,
                        top_p=0.95 if sampled[i] else 1.0) for i in range(bs)]
        sampling_info = SimpleNamespace(
            temperatures=torch.tensor([0.01 if x else 1.0 for x in sampled]),
            top_ks=torch.tensor([(1 << 30) if x else 1 for x in sampled]),
            top_ps=torch.tensor([0.95 if x else 1.0 for x in sampled]),
            min_ps=torch.zeros(bs), need_min_p_sampling=False, has_custom_logit_processor=False,
            logit_bias=None, penalizer_orchestrator=SimpleNamespace(is_required=False),
        )
        R, L = bs + 2, 512
        req_to_token = torch.full((R, L), -1, dtype=torch.int64)
        allocator = FakeAllocator(4096)
        seq_lens = torch.tensor(prefix, dtype=torch.int64)
        widths: list[int | None] = []
        controller = SimpleNamespace(stats=dw.DDTreeStats(), widths=widths, set_verify_width=widths.append,
                                     mark_phase=lambda name: None, stash_acceptance=lambda tree, nodes, sampled: None,
                                     hybrid=None)
        batch = SimpleNamespace(
            forward_mode=SimpleNamespace(is_idle=lambda: False),
            batch_size=lambda bs=bs: bs,
            device=torch.device("cpu"),
            seq_lens=seq_lens.clone(),
            seq_lens_cpu=seq_lens.clone(),
            seq_lens_sum=int(seq_lens.sum()),
            req_pool_indices=torch.arange(bs, dtype=torch.int64) + 1,
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
            token_to_kv_pool_allocator=allocator,
            tree_cache=None,
            reqs=reqs,
            input_ids=None,
            out_cache_loc=None,
            sampling_info=sampling_info,
        )
        dw.alloc_token_slots = lambda _cache, k, allocator=allocator: allocator.alloc(k)
        dw.assign_req_to_token_pool_func = fake_assign
        roots = torch.tensor([h[-1] for h in histories], dtype=torch.int64)
        tokens = tree.full_token_ids(roots)
        vi = dw.DDTreeVerifyInput(
            draft_token=tokens.reshape(-1),
            positions=tree.positions(seq_lens).reshape(-1),
            draft_token_num=n,
            kv_width=kv_width,
            tree=tree,
            controller=controller,
        )
        vi.prepare_for_verify(batch, 1)
        slots = batch.out_cache_loc.view(bs, n).clone()
        w = kv_width or n
        if kv_width and not bool((slots[:, w:] == 0).all()):
            failures.append(f"trial {trial}: padding slots {slots[:, w:].tolist()} are not the dummy slot 0")
        if len(set(slots[:, :w].flatten().tolist())) != bs * w or 0 in slots[:, :w]:
            failures.append(f"trial {trial}: tree slots {slots[:, :w].tolist()} not {bs * w} distinct allocated ones")
        # custom mask layout
        off = 0
        for i in range(bs):
            rows = vi.custom_mask[off : off + n * (prefix[i] + n)].view(n, prefix[i] + n)
            off += n * (prefix[i] + n)
            if not bool(rows[:, : prefix[i]].all()) or not torch.equal(rows[:, prefix[i] :], tree.tree_mask[i]):
                failures.append(f"trial {trial}: custom mask layout wrong for request {i}")
        if off != vi.custom_mask.numel():
            failures.append(f"trial {trial}: custom mask size {vi.custom_mask.numel()} != {off}")
        # target logits per node: argmax = target_next(history + path to node)
        nt_logits = torch.zeros(bs, n, VOCAB)
        hidden = torch.zeros(bs, n, HID)
        for i in range(bs):
            for node in range(int(tree.num_nodes[i])):
                path = []
                j = node
                while j > 0:
                    path.append(int(tree.token_ids[i, j - 1]))
                    j = int(tree.parents[i, j])
                nt_logits[i, node, target_next(histories[i] + path[::-1])] = 5.0
                hidden[i, node] = torch.tensor([i, node, 7.0])
        logits_output = SimpleNamespace(
            next_token_logits=nt_logits.view(bs * n, VOCAB), hidden_states=hidden.view(bs * n, HID)
        )
        new_bonus, commit_lens, next_hidden, ncorrect = vi.verify(
            batch=batch, logits_output=logits_output, page_size=1
        )
        steps += 1
        off = 0
        all_slots = set(int(x) for x in slots[:, :w].flatten().tolist())
        kept: set[int] = set()
        for i in range(bs):
            # expected: greedy walk
            expected, nodes = [], [0]
            seq = list(histories[i])
            node = 0
            while True:
                t = target_next(seq)
                child = None
                for c in range(1, int(tree.num_nodes[i])):
                    if int(tree.parents[i, c]) == node and int(tree.token_ids[i, c - 1]) == t:
                        child = c
                expected.append(t)
                if child is None:
                    break
                node = child
                nodes.append(child)
                seq.append(t)
            expected = expected[: max_new]
            if reqs[i].output_ids != expected:
                failures.append(f"trial {trial} req {i}: tokens {reqs[i].output_ids} != greedy {expected}")
            cl = int(commit_lens[i])
            if cl != len(expected):
                failures.append(f"trial {trial} req {i}: commit_len {cl} != {len(expected)}")
            want_slots = [int(slots[i, k]) for k in nodes[:cl]]
            got_slots = req_to_token[i + 1, prefix[i] : prefix[i] + cl].tolist()
            if got_slots != want_slots:
                failures.append(f"trial {trial} req {i}: req_to_token {got_slots} != path slots {want_slots}")
            kept.update(want_slots)
            rows = next_hidden[off : off + cl]
            off += cl
            if rows[:, 1].tolist() != [float(k) for k in nodes[:cl]] or not bool((rows[:, 0] == i).all()):
                failures.append(f"trial {trial} req {i}: hidden rows {rows.tolist()} != path {nodes[:cl]}")
            if int(new_bonus[i]) != reqs[i].output_ids[-1]:
                failures.append(f"trial {trial} req {i}: bonus {int(new_bonus[i])} != last token")
            if int(batch.seq_lens[i]) != prefix[i] + cl:
                failures.append(f"trial {trial} req {i}: seq_lens not advanced")
            if not bool((req_to_token[i + 1, prefix[i] + w :] == -1).all()):
                failures.append(f"trial {trial} req {i}: req_to_token written past the tree's {w} slots")
        if sorted(allocator.freed) != sorted(all_slots - kept):
            failures.append(f"trial {trial}: freed {sorted(allocator.freed)} != {sorted(all_slots - kept)}")
        if off != next_hidden.shape[0]:
            failures.append(f"trial {trial}: hidden rows {next_hidden.shape[0]} != {off}")
        if controller.stats.sampled_requests != sum(sampled) or controller.stats.greedy_requests != bs - sum(sampled):
            failures.append(f"trial {trial}: walk counts {controller.stats.as_dict()}")
        if controller.widths != [n]:
            failures.append(f"trial {trial}: verify width calls {controller.widths}")
    failures += guard_checks()
    failures += penalty_checks()
    failures += dflash_sampling_checks()
    failures += hook_checks()
    print(json.dumps({"ok": not failures, "steps": steps, "failures": failures[:10]}))
    return 0 if not failures else 1


class TritonAttnBackend:  # same class name as SGLang's: the worker checks the backend by name
    num_draft_tokens = 16  # the payload's triton_backend patch sets 1 + budget in full mode (_worker)


class FlashInferAttnBackend:
    num_draft_tokens = 16


class GDNAttnBackend:  # SGLang's GDN backend as the worker sees it: its class name and tree flag
    def __init__(self, topk: int) -> None:
        self.topk = topk


class Mamba2AttnBackend(GDNAttnBackend):
    pass


def _hybrid_backend(full, linear):
    """SGLang's HybridLinearAttnBackend: the triton backend for attention layers, a linear one for the rest."""
    return SimpleNamespace(full_attn_backend=full, linear_attn_backend=linear)


def _mamba_pool(width, rows=49, layers=3):
    ssm = torch.zeros((layers, rows, width, 2, 4, 4), dtype=torch.float32)
    conv = [torch.zeros((layers, rows, width, 8, 3), dtype=torch.bfloat16)]
    return SimpleNamespace(mamba_cache=SimpleNamespace(intermediate_ssm=ssm, intermediate_conv_window=conv))


def _worker(mode="full", backend=TritonAttnBackend, hybrid_attr=None, hf=None, page_size=1, vocab=VOCAB,
            window=None, verify_width=None, budget=64, budget_max=None, linear=None, state_width=None, radix=False,
            head_dtype=torch.float32):
    attn_backend = backend()
    attn_backend.num_draft_tokens = verify_width or (65 if mode == "full" else 16)
    if linear is not None:
        attn_backend = _hybrid_backend(attn_backend, linear)
    runner = SimpleNamespace(
        attn_backend=attn_backend,
        mambaish_config=None,
        hybrid_gdn_config=None,
        sliding_window_size=window,
        device="cpu",
        req_to_token_pool=SimpleNamespace(size=48, max_context_len=256,
                                          mamba_pool=_mamba_pool(state_width or 65)),
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(to_dict=lambda: hf or {"model_type": "qwen3"}), vocab_size=vocab
        ),
        model=SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(vocab, 8).to(head_dtype))),
    )
    if hybrid_attr:
        setattr(runner, hybrid_attr, object())
    args = SimpleNamespace(
        speculative_ddtree_mode=mode,
        speculative_ddtree_budget=budget,
        speculative_ddtree_budget_max=budget_max,
        speculative_ddtree_topk_cap=None,
        speculative_ddtree_allow_hybrid_unsafe=False,
        disable_radix_cache=not radix,
        tp_size=1,
    )
    runner.server_args = args
    return SimpleNamespace(server_args=args, block_size=16, tp_rank=0, page_size=page_size, model_runner=runner)


QWEN3_NEXT = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}
# the same GDN layers in an architecture no GPU proof has served: full mode unproven
QWEN3_6_MOE = {"model_type": "qwen3_6_moe", "architectures": ["Qwen3_6MoeForConditionalGeneration"]}


def hybrid_checks(refused) -> list[str]:
    """Full mode on a GDN hybrid under the proof's switch: started only where the backend patch took, the
    per-node states are tree-wide and the radix cache is off; the commit maps DFLASH's chain offsets to
    the accepted path's nodes (and the test faults do what they say)."""
    out: list[str] = []
    gdn = dict(hybrid_attr="hybrid_gdn_config", hf=QWEN3_NEXT)
    with mock.patch.dict(os.environ, {"SGLANG_DDTREE_TEST_UNPROVEN_HYBRID": "1"}):
        for name, (worker, needles) in {
            "gdn without the backend patch": (_worker(**gdn, linear=GDNAttnBackend(0)), ("verifies chains", "Re-push")),
            "gdn states for a block": (_worker(**gdn, linear=GDNAttnBackend(2), state_width=16),
                                       ("recurrent states for 16 verify tokens", "1 + budget = 65")),
            "gdn with the radix cache": (_worker(**gdn, linear=GDNAttnBackend(2), radix=True), ("--disable-radix-cache",)),
            "mamba-2 under the switch": (_worker(hybrid_attr="mambaish_config", linear=Mamba2AttnBackend(2)),
                                         ("Mamba2AttnBackend",)),
        }.items():
            problem = refused(worker, *needles)
            if problem:
                out.append(f"hybrid {name}: {problem}")
        try:
            ctl = dw.DDTreeController.maybe_create(_worker(**gdn, linear=GDNAttnBackend(2)))
        except Exception as e:
            return [*out, f"hybrid gdn under the switch: refused: {e!r}"]
        if ctl.hybrid is None or ctl.hybrid.memory.width != 65 or ctl.internal_state()["hybrid"]["verify_width"] != 65:
            out.append(f"hybrid gdn: state not attached: {ctl.internal_state().get('hybrid')}")
        # accepted paths root-first, -1 padded; DFLASH's chain offsets: commit_len - 1, and a tracked offset
        path = torch.tensor([[0, 3, 9, -1], [0, 1, 2, 5], [0, -1, -1, -1]])
        vi = SimpleNamespace(accepted_nodes=path, tree=None)
        chain = torch.tensor([2, 3, 0])
        track = torch.tensor([1, -1, 0])
        steps, tracked = ctl.mamba_commit_steps(vi, chain, track)
        if steps.tolist() != [9, 5, 0] or tracked.tolist() != [3, -1, 0]:
            out.append(f"hybrid commit: {steps.tolist()} / {tracked.tolist()}, want [9, 5, 0] / [3, -1, 0]")
        linear_step = SimpleNamespace()  # DFLASH's own verify input: its chain is the block
        if ctl.mamba_commit_steps(linear_step, chain, track)[0] is not chain:
            out.append("hybrid commit: a linear step's chain indices were changed")
    tree = SimpleNamespace(valid=torch.tensor([[True] * 4, [True, True, False, False]]),
                           depths=torch.tensor([[0, 1, 2, 2], [0, 1, 3, 3]]))
    for fault, want in (("deepest", [2, 1]), ("skip", [-1, -1]), ("chain", [1, 0])):
        env = {"SGLANG_DDTREE_TEST_UNPROVEN_HYBRID": "1", "SGLANG_DDTREE_TEST_MAMBA_COMMIT": fault}
        with mock.patch.dict(os.environ, env):
            ctl = dw.DDTreeController.maybe_create(_worker(**gdn, linear=GDNAttnBackend(2)))
        vi = SimpleNamespace(accepted_nodes=torch.tensor([[0, 3], [0, 2]]), tree=tree)
        got = ctl.mamba_commit_steps(vi, torch.tensor([1, 0]), None)[0].tolist()
        if got != want:
            out.append(f"hybrid fault {fault}: committed {got}, want {want}")
    return out


def guard_checks() -> list[str]:
    """The worker-start guards: hybrid targets (runtime attrs and config.json markers), windowed attention
    (runtime sliding window and config.json), backend, page size."""
    out: list[str] = []

    def refused(worker, *needles):
        try:
            dw.DDTreeController.maybe_create(worker)
        except dw.DDTreeRefused as e:
            missing = [n for n in needles if n not in str(e)]
            return f"message lacks {missing}: {e}" if missing else None
        return "not refused"

    cases = {
        "gdn runtime": (_worker(hybrid_attr="hybrid_gdn_config"), ("hybrid", "hybrid_gdn_config", "shadow-linear")),
        "mamba runtime": (_worker(hybrid_attr="mambaish_config"), ("mambaish_config",)),
        # GDN wired but not yet proven on this architecture: refused unless the proof's switch is on
        "gdn unproven": (_worker(hybrid_attr="hybrid_gdn_config", hf=QWEN3_6_MOE, linear=GDNAttnBackend(2)),
                         ("layer type gated-deltanet (GDNAttnBackend) on qwen3.6-moe", "not yet shown on a GPU",
                          "shadow-linear")),
        "gdn of an unknown architecture": (_worker(hybrid_attr="hybrid_gdn_config", linear=GDNAttnBackend(2)),
                                           ("on an unknown architecture: no tree-verify support",)),
        "mamba-2 backend": (_worker(hybrid_attr="mambaish_config", linear=Mamba2AttnBackend(2)),
                            ("Mamba2AttnBackend", "only through GDNAttnBackend")),
        "config marker": (_worker(hf={"model_type": "qwen3_6_moe"}), ("qwen3_6_moe",)),
        "runtime window": (_worker(window=4096), ("sliding window of 4096", "shadow-linear")),
        "config window": (_worker(hf={"model_type": "mistral", "sliding_window": 4096}), ("windowed attention",
                                                                                        "sliding_window")),
        "config swa layers": (_worker(hf={"model_type": "gemma3_text",
                                          "layer_types": ["sliding_attention", "full_attention"]}),
                              ("1 of 2 windowed",)),
        "flashinfer": (_worker(backend=FlashInferAttnBackend), ("FlashInferAttnBackend", "supported: triton")),
        "page size": (_worker(page_size=16), ("page-size 1",)),
        "unpatched backend width": (_worker(verify_width=16), ("16 tokens per request", "not installed")),
        # the tree drafts through the target's LM head in both modes: a quantized head, refused at start
        "fp8 head": (_worker(head_dtype=torch.float8_e4m3fn), ("full mode refused", "stored as torch.float8_e4m3fn",
                                                               "--speculative-ddtree-mode off")),
        "int8 head, shadow": (_worker(mode="shadow-linear", head_dtype=torch.int8),
                              ("shadow-linear mode refused", "stored as torch.int8")),
    }
    for name, (worker, needles) in cases.items():
        problem = refused(worker, *needles)
        if problem:
            out.append(f"guard {name}: {problem}")
    out += hybrid_checks(refused)
    for name, worker in {
        "qwen3 unused window": _worker(hf={"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False}),
        "shadow on hybrid": _worker(mode="shadow-linear", hybrid_attr="hybrid_gdn_config", backend=FlashInferAttnBackend),
        # proven (ddtree_utils.HYBRID_TREE_SUPPORT): full mode without any switch
        "full on qwen3-next": _worker(hybrid_attr="hybrid_gdn_config", hf=QWEN3_NEXT, linear=GDNAttnBackend(2)),
        "plain target": _worker(),
    }.items():
        try:
            ctl = dw.DDTreeController.maybe_create(worker)
            assert ctl is not None and ctl.budget == 64
        except Exception as e:
            out.append(f"guard {name}: refused unexpectedly: {e!r}")
    # A sampling backend whose filter rule the verify does not reproduce is refused (issue 23); the
    # CPU server-args cases cannot reach it (--device cpu forces the torch sampler).
    from sglang.srt.speculative import ddtree_args

    try:
        ddtree_args._check_full_mode(SimpleNamespace(sampling_backend="ascend", speculative_ddtree_budget=64))
        out.append("full mode accepted --sampling-backend ascend")
    except ddtree_args.DDTreeConfigError as e:
        if "got --sampling-backend ascend" not in str(e):
            out.append(f"sampling backend refusal: {e}")
    if dw.DDTreeController.maybe_create(_worker(mode="off")) is not None:
        out.append("mode off created a controller")
    ctl = dw.DDTreeController.maybe_create(_worker())
    ctl.set_verify_width(33)
    width = ctl._attn_backend.num_draft_tokens
    ctl.set_verify_width(16)
    if (width, ctl._attn_backend.num_draft_tokens) != (33, 16):
        out.append(f"verify width not set: {width}, {ctl._attn_backend.num_draft_tokens}")
    state = json.loads(json.dumps(ctl.internal_state()))
    if state.get("mode") != "full" or "accepted_depth_hist" not in state:
        out.append(f"internal_state: {state}")
    return out



def _lm_head(weight_full: torch.Tensor, rank: int, tp: int, padded_total: int) -> SimpleNamespace:
    """A vocab-parallel LM head shard laid out as SGLang's VocabParallelEmbedding (no added vocab)."""
    vocab = weight_full.shape[0]
    per = padded_total // tp
    start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
    local = torch.zeros(per, weight_full.shape[1])
    local[: end - start] = weight_full[start:end]
    shard = SimpleNamespace(num_org_elements=end - start, num_org_elements_padded=per, num_added_elements=0,
                            org_vocab_start_index=start)
    return SimpleNamespace(weight=local, shard_indices=shard)


def hook_checks() -> list[str]:
    """draft_logits under emulated TP (shard gather = column == token id), and the on_draft /
    on_verified hooks: shadow builds but never verifies; full installs the tree verify input only
    for plain greedy batches, shrunk to what the free KV pool holds."""
    import sglang.srt.distributed as dist

    out: list[str] = []
    torch.manual_seed(1)
    vocab, hid, tp, padded = 100, 8, 2, 128
    weight = torch.randn(vocab, hid)
    hs = torch.randn(6, hid)
    want = hs @ weight.T
    ctl = dw.DDTreeController.maybe_create(_worker(vocab=vocab))
    locals_: dict[int, torch.Tensor] = {}
    def capture(rank: int):
        def all_gather(x, dim=-1):
            locals_[rank] = x.clone()
            return x

        return lambda: SimpleNamespace(world_size=tp, all_gather=all_gather)

    for rank in range(tp):  # pass 1: what each rank would contribute
        dist.get_tp_group = capture(rank)
        ctl.draft_logits(hs, _lm_head(weight, rank, tp, padded))
    for rank in range(tp):  # pass 2: every rank sees the same gathered row
        dist.get_tp_group = lambda: SimpleNamespace(
            world_size=tp, all_gather=lambda x, dim=-1: torch.cat([locals_[r] for r in range(tp)], dim=dim))
        got = ctl.draft_logits(hs, _lm_head(weight, rank, tp, padded))
        if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
            out.append(f"tp draft logits rank {rank}: mismatch {tuple(got.shape)}")
    dist.get_tp_group = lambda: SimpleNamespace(world_size=1)
    head = _lm_head(torch.randn(VOCAB, hid), 0, 1, VOCAB)
    if not torch.allclose(ctl.draft_logits(hs, head), hs @ head.weight[:VOCAB].T):
        out.append("tp=1 draft logits mismatch")

    def batch_for(bs, greedy=True, free=10_000, seq_lens=None, row_width=256):
        alloc = FakeAllocator(free + 1)
        seq = torch.tensor(seq_lens or [5 + i for i in range(bs)], dtype=torch.int64)
        info = SimpleNamespace(is_all_greedy=greedy, has_custom_logit_processor=False, logit_bias=None,
                               penalizer_orchestrator=SimpleNamespace(is_required=False))
        alloc.available_size = lambda: len(alloc.free_slots)
        return SimpleNamespace(
            forward_mode=SimpleNamespace(is_idle=lambda: False), batch_size=lambda: bs, device=torch.device("cpu"),
            seq_lens=seq.clone(), seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()),
            req_pool_indices=torch.arange(bs, dtype=torch.int64), sampling_info=info,
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(bs, row_width, dtype=torch.int64)),
            token_to_kv_pool_allocator=alloc, tree_cache=None, reqs=[], input_ids=None, out_cache_loc=None,
            spec_info="untouched", return_hidden_states=True,
        ), alloc

    dw.alloc_token_slots = lambda cache, k: cache_alloc[0].alloc(k)
    dw.assign_req_to_token_pool_func = fake_assign
    dw.evict_from_tree_cache = lambda cache, k: None
    draft_hidden = torch.randn(2, 16, hid)
    bonus = torch.tensor([3, 4])
    # (mode, greedy, free KV slots, verify graphs' largest batch or None, tree width installed or 0 for
    # the linear path, KV slots per request). On graphs a step the pool cannot afford whole is padded
    # to their width, down to the root alone; without them (or above their batch) it shrinks.
    for mode, greedy, free, graph_bs, want_n, want_kv in (
        ("shadow-linear", True, 10_000, None, 0, 0), ("full", True, 10_000, None, 65, 65),
        ("full", False, 10_000, None, 65, 65), ("full", True, 100, None, 32, 32), ("full", True, 3, None, 0, 0),
        ("full", True, 10_000, 32, 65, 65), ("full", True, 100, 32, 65, 32), ("full", True, 3, 32, 65, 1),
        ("full", True, 1, 32, 0, 0), ("full", True, 100, 1, 32, 32),
    ):
        want_tree = want_n > 0
        ctl = dw.DDTreeController.maybe_create(_worker(mode=mode))
        if graph_bs:
            ctl.verify_graph_width, ctl.verify_graph_max_bs = 65, graph_bs
        batch, alloc = batch_for(2, greedy, free)
        cache_alloc = [alloc]
        took = ctl.on_draft(batch, bonus_tokens=bonus, target_prefix_lens=batch.seq_lens,
                            draft_hidden=draft_hidden, lm_head=head)
        label = f"on_draft {mode} greedy={greedy} free={free} graphs={graph_bs}"
        if took != want_tree:
            out.append(f"{label}: took={took}")
            continue
        if took:
            vi = batch.spec_info
            n = want_n
            if not isinstance(vi, dw.DDTreeVerifyInput) or vi.draft_token_num != n:
                out.append(f"{label}: spec_info {type(vi).__name__}")
                continue
            toks = vi.draft_token.view(2, n)
            pos = vi.positions.view(2, n)
            if not torch.equal(toks[:, 0], bonus) or not torch.equal(pos, batch.seq_lens[:, None] + vi.tree.depths):
                out.append(f"{label}: root token / positions wrong")
            if ctl._attn_backend.num_draft_tokens != n or batch.out_cache_loc.numel() != 2 * n:
                out.append(f"{label}: verify width {ctl._attn_backend.num_draft_tokens}, slots {batch.out_cache_loc.numel()}")
            used = free - len(alloc.free_slots)
            padded = int(want_kv < want_n)
            if (vi.kv_width, used, int(vi.tree.num_nodes.max())) != (want_kv, 2 * want_kv, min(want_kv, 65)) or \
                    (ctl.stats.padded_steps, ctl.stats.shrunk_steps) != (padded, int(want_kv < 65)):
                out.append(f"{label}: kv width {vi.kv_width}, {used} slots taken, {int(vi.tree.num_nodes.max())} "
                           f"nodes, stats {ctl.stats.as_dict()}")
        else:
            if batch.spec_info != "untouched":
                out.append(f"{label}: linear path must keep upstream's verify input")
            if mode == "shadow-linear" and float(ctl.stats.nodes_sum) != 2 * 65:
                out.append(f"{label}: shadow tree not measured ({ctl.stats.nodes_sum})")
            ctl.on_verified(object(), [3, 0])
            fallback = 1 if mode == "full" else 0
            if ctl.stats.fallback_steps != fallback or ctl.stats.accepted_depth_hist != {3: 1, 0: 1}:
                out.append(f"{label}: stats {ctl.stats.as_dict()}")
            want_reason = {"full": "kv_pool"}.get(mode)
            if want_reason and dict(ctl.stats.fallback_reasons) != {want_reason: 1}:
                out.append(f"{label}: fallback reasons {dict(ctl.stats.fallback_reasons)}")
    out += step_limit_checks(batch_for, head, draft_hidden, bonus)
    out += build_graph_checks(batch_for, head, draft_hidden, bonus)
    out += auto_checks(batch_for, head, draft_hidden, bonus)
    return out


def auto_checks(batch_for, head, draft_hidden, bonus) -> list[str]:
    """--speculative-ddtree-budget auto (max 63): warm-up steps at the largest tree, exploration steps
    at each candidate (the chain as a linear step, not a fallback), each tree step's walk observed as
    what every smaller budget would have accepted, and a plan that follows the costs it is given."""
    from sglang.srt.speculative.ddtree_utils import follow_verified_tree

    out: list[str] = []
    ctl = dw.DDTreeController.maybe_create(_worker(budget="auto", budget_max=63, verify_width=64))
    if ctl.auto is None or ctl.budget != 63 or [c.name for c in ctl.auto.candidates] != ["chain", "15", "31", "63"]:
        return [f"auto: controller {ctl.budget}, {None if ctl.auto is None else ctl.auto.candidates}"]
    widths, built = [], []
    eager = ctl._build_eagerly
    ctl._build_eagerly = lambda tail, lm_head, budget: (built.append(budget), eager(tail, lm_head, budget))[1]
    g = torch.Generator().manual_seed(5)
    for step in range(64):
        batch, alloc = batch_for(2)
        dw.alloc_token_slots = lambda cache, k, alloc=alloc: alloc.alloc(k)
        ctl.mark_phase("step_start")
        took = ctl.on_draft(batch, bonus_tokens=bonus, target_prefix_lens=batch.seq_lens,
                            draft_hidden=draft_hidden, lm_head=head)
        if took:
            vi = batch.spec_info
            widths.append(vi.draft_token_num)
            target = torch.randint(0, VOCAB, vi.tree.parents.shape, generator=g)
            accepted, lens, _ = follow_verified_tree(vi.tree, target)
            ctl.stash_acceptance(vi.tree, accepted, [])
            ctl.on_verified(vi, lens.tolist())
        else:
            widths.append(0)
            if batch.spec_info != "untouched":
                out.append(f"auto step {step}: a chain step must keep upstream's verify input")
            ctl.on_verified(object(), [1, 0])
    if widths[:16] != [64] * 16:
        out.append(f"auto warm-up widths {widths[:16]}")
    if built != [w - 1 for w in widths if w] or ctl.build_budgets != [15, 31, 63]:
        out.append(f"auto builds at {built} for widths {widths} (budgets {ctl.build_budgets}): each step must build its pick")
    # Exploration steps 16, 32, 48: candidates other than the plan of their batch (the chain among them:
    # before its first step its cost here is a guess).
    if 0 not in widths[16:] or len(set(widths[16:])) < 2:
        out.append(f"auto exploration widths {[widths[i] for i in (16, 32, 48)]}, all after warm-up {widths[16:]}")
    stats = ctl.stats
    if stats.fallback_steps or stats.chain_steps != widths.count(0) or stats.tree_steps != 64 - widths.count(0):
        out.append(f"auto step counts {stats.as_dict()}")
    state = json.loads(json.dumps(ctl.internal_state()))
    report = state.get("auto") or {}
    if (state["budget"], state["budget_max"]) != ("auto", 63) or set(report.get("plan", {})) != {"1", "2", "4", "8",
                                                                                                  "16", "32", "64"}:
        out.append(f"auto internal_state: {state.get('budget')}, {state.get('budget_max')}, {report.get('plan')}")
    if sum(report.get("verified", {}).values()) != 64 or report.get("accepted_by_budget", {}).get("63") is None:
        out.append(f"auto report: {report}")
    # /metrics (prometheus_client, as SGLang's own collectors): the budgets stepped, the curve and the costs.
    from prometheus_client import REGISTRY, generate_latest
    from sglang.srt.speculative.ddtree_metrics import AutoMetrics

    metrics = AutoMetrics.maybe_create(ctl.auto.budgets, enabled=True, tp_rank=0)
    for name in report.get("verified", {}):
        metrics.observe_step(0 if name == "chain" else int(name))
    metrics.publish(ctl.auto.as_dict())
    text = generate_latest(REGISTRY).decode()
    for want in ('sglang:ddtree_step_budget_bucket{le="0.0"} 1.0', 'sglang:ddtree_accepted_by_budget{budget="63"}',
                 "sglang:ddtree_step_ms{"):
        if want not in text:
            out.append(f"auto /metrics lacks {want!r}")
    if AutoMetrics.maybe_create(ctl.auto.budgets, enabled=True, tp_rank=1) is not None:
        out.append("auto /metrics registered on a TP rank other than 0")
    # Start-up replays that make wide trees a hundred times dearer than the block: at a batch size no step has
    # measured yet (4; the steps above ran 2, whose own CPU timings rule there) the plan keeps to the block.
    ctl.auto.seed_start_costs({(w, bs): (1e-3 if w == 16 else 1e-1) for w in (16, 32, 64) for bs in (1, 2, 4)})
    if ctl.auto.plan[ctl.auto.bucket_index(4)].width != 16:
        out.append(f"auto plan under costly wide trees: {ctl.auto.as_dict()['plan']}")
    return out


def build_graph_checks(batch_for, head, draft_hidden, bonus) -> list[str]:
    """A step takes its tree from the captured full-budget build (ddtree_build_graphs) and installs
    the same verify input as the eager build; so does a shrunk step (the build's first nodes); CPU
    captures nothing."""
    from graph_stand_in import RerunGraph  # beside this script
    from sglang.srt.speculative.ddtree_build_graphs import DDTreeBuildGraphs

    out: list[str] = []
    verify_inputs = {}
    for use_graphs in (False, True):
        ctl = dw.DDTreeController.maybe_create(_worker(mode="full"))
        if ctl._build_graphs is not None:
            out.append("build graphs captured on CPU")
        if use_graphs:
            ctl._build_graphs = {ctl.budget: DDTreeBuildGraphs(ctl.budget_build(head, ctl.budget), [1, 4], depth=ctl.depth,
                                                               hidden=draft_hidden.shape[-1], dtype=draft_hidden.dtype,
                                                               device="cpu", new_graph=RerunGraph)}
        batch, alloc = batch_for(2)
        dw.alloc_token_slots = lambda cache, k, alloc=alloc: alloc.alloc(k)
        ctl.on_draft(batch, bonus_tokens=bonus, target_prefix_lens=batch.seq_lens, draft_hidden=draft_hidden,
                     lm_head=head)
        verify_inputs[use_graphs] = [batch.spec_info]
        if ctl.stats.build_graph_steps != int(use_graphs):
            out.append(f"build graphs={use_graphs}: build_graph_steps {ctl.stats.build_graph_steps}")
        shrunk, alloc = batch_for(2, free=100)  # the KV pool holds a 31-node tree, not 64
        dw.alloc_token_slots = lambda cache, k, alloc=alloc: alloc.alloc(k)
        ctl.on_draft(shrunk, bonus_tokens=bonus, target_prefix_lens=shrunk.seq_lens, draft_hidden=draft_hidden,
                     lm_head=head)
        verify_inputs[use_graphs].append(shrunk.spec_info)
        if shrunk.spec_info.draft_token_num != 32 or ctl.stats.build_graph_steps != 2 * int(use_graphs):
            out.append(f"build graphs={use_graphs}: shrunk step of width {shrunk.spec_info.draft_token_num}, "
                       f"{ctl.stats.build_graph_steps} graph builds")
    import os

    os.environ["SGLANG_DDTREE_PROFILE"] = "1"
    ctl = dw.DDTreeController.maybe_create(_worker(mode="full"))
    del os.environ["SGLANG_DDTREE_PROFILE"]
    batch, alloc = batch_for(2)
    dw.alloc_token_slots = lambda cache, k, alloc=alloc: alloc.alloc(k)
    ctl.on_draft(batch, bonus_tokens=bonus, target_prefix_lens=batch.seq_lens, draft_hidden=draft_hidden, lm_head=head)
    ctl.on_verified(batch.spec_info, [0, 0])
    phases = set(ctl.internal_state()["profile"])
    if phases != {"draft_done->built", "built->mask_ready", "mask_ready->step_done"}:
        out.append(f"profile phases of a tree step: {sorted(phases)}")
    if dw.DDTreeController.maybe_create(_worker(mode="full")).internal_state()["profile"] is not None:
        out.append("profile on without SGLANG_DDTREE_PROFILE")
    for eager, graphed in zip(verify_inputs[False], verify_inputs[True], strict=True):
        for name in ("draft_token", "positions", "custom_mask"):
            if not torch.equal(getattr(eager, name), getattr(graphed, name)):
                out.append(f"build graphs: verify input {name} differs from the eager build's")
    return out


def step_limit_checks(batch_for, head, draft_hidden, bonus) -> list[str]:
    """A step whose rows, logits or mask cannot hold the full tree verifies a smaller one (never
    writing past a request's req_to_token row), or linearly when not even one node fits."""
    out: list[str] = []
    cases = [
        # (label, seq_lens, row width, max verify tokens, expected tree width (0 = linear), reason)
        ("fits", [5, 6], 256, 10_000, 65, None),
        ("row near the limit", [5, 220], 256, 10_000, 32, None),  # 220 + 36 = 256: ladder 64, 63, 31
        ("row exactly full", [5, 191], 256, 10_000, 65, None),  # 191 + 65 = 256
        ("row one short", [5, 192], 256, 10_000, 64, None),  # ladder 64 → 63
        ("no room at all", [5, 255], 256, 10_000, 0, "step_limits"),
        ("logits bound", [5, 6], 256, 2 * 16, 16, None),  # bs * n <= 32 → n = 16 (budget 15)
        ("logits below one node", [5, 6], 256, 3, 0, "step_limits"),
    ]
    for label, seq_lens, row_width, max_tokens, want_n, reason in cases:
        ctl = dw.DDTreeController.maybe_create(_worker(mode="full"))
        ctl.max_verify_tokens = max_tokens
        batch, alloc = batch_for(2, True, 10_000, seq_lens=seq_lens, row_width=row_width)
        dw.alloc_token_slots = lambda cache, k, alloc=alloc: alloc.alloc(k)
        try:
            took = ctl.on_draft(batch, bonus_tokens=bonus, target_prefix_lens=batch.seq_lens,
                                draft_hidden=draft_hidden, lm_head=head)
        except Exception as e:  # an overflowing write raises in fake_assign (slice shorter than values)
            out.append(f"step limit {label}: {type(e).__name__}: {e}")
            continue
        got_n = batch.spec_info.draft_token_num if took else 0
        if got_n != want_n:
            out.append(f"step limit {label}: tree width {got_n}, want {want_n}")
        if took and batch.out_cache_loc.numel() != 2 * want_n:
            out.append(f"step limit {label}: {batch.out_cache_loc.numel()} slots for width {want_n}")
        if reason and ctl.stats.fallback_reasons.get(reason) != 1:
            out.append(f"step limit {label}: fallback reasons {dict(ctl.stats.fallback_reasons)}")
        if took and (want_n < 65) != (ctl.stats.shrunk_steps == 1):
            out.append(f"step limit {label}: shrunk_steps {ctl.stats.shrunk_steps}")
    # The verify input's own bound check: a tree that does not fit the row is refused, not written.
    ctl = dw.DDTreeController.maybe_create(_worker(mode="full"))
    batch, alloc = batch_for(2, True, 10_000, seq_lens=[5, 250], row_width=256)
    tree = build_ddtree(torch.randn(2, 15, VOCAB), 15)
    vi = dw.DDTreeVerifyInput(draft_token=tree.full_token_ids(bonus).reshape(-1),
                              positions=tree.positions(batch.seq_lens).reshape(-1), draft_token_num=16,
                              tree=tree, controller=ctl)
    try:
        vi.prepare_for_verify(batch, 1)
        out.append("prepare_for_verify wrote a tree past the end of a req_to_token row")
    except RuntimeError as e:
        if "does not fit a req_to_token row of 256" not in str(e):
            out.append(f"row bound check message: {e}")
    return out




class _Batch:  # weak-referenceable, as SGLang's orchestrator holds its batch
    def __init__(self, reqs, device="cpu"):
        self.reqs, self.device = reqs, device


def _plain_penalised(logits_row: torch.Tensor, req, sequence: list[int]) -> torch.Tensor:
    """The oracle: SGLang's own penalizers for a batch of this one request, fed its output tokens one
    decode step at a time (what plain decoding without the overlap scheduler has cumulated when it
    samples the next token), then applied to the row (in their dict order)."""
    from sglang.srt.sampling.penaltylib import (
        BatchedFrequencyPenalizer,
        BatchedMinNewTokensPenalizer,
        BatchedPenalizerOrchestrator,
        BatchedPresencePenalizer,
        BatchedRepetitionPenalizer,
    )

    batch = _Batch([req])
    orch = BatchedPenalizerOrchestrator(
        vocab_size=logits_row.shape[-1], batch=batch,
        penalizers={BatchedFrequencyPenalizer, BatchedMinNewTokensPenalizer, BatchedPresencePenalizer,
                    BatchedRepetitionPenalizer})
    for t in sequence:
        orch.cumulate_output_tokens(torch.tensor([t]))
    row = logits_row.clone().view(1, -1)
    if orch.is_required:
        orch.apply(row)
    return row.view(-1), orch


def penalty_checks() -> list[str]:
    """Penalties on tree and chain verify logits (`adjust_verify_logits`, issue 23), bit for bit against
    SGLang's own penalizers fed the request's output plus each position's path; then a tree verify
    with penalties emits exactly plain greedy decoding with them."""
    out: list[str] = []
    rng = torch.Generator().manual_seed(23)
    vocab = 12
    tokenizer = SimpleNamespace(eos_token_id=11, additional_stop_token_ids={10})
    for trial in range(80):
        bs = 1 + trial % 3
        depth, budget = 1 + trial % 4, [3, 7, 15][trial % 3]
        reqs, histories = [], []
        for i in range(bs):
            hist = torch.randint(0, vocab, (2 + (trial + i) % 7,), generator=rng).tolist()
            sp = SimpleNamespace(
                top_k=1, frequency_penalty=[0.0, 0.8, 0.3][(trial + i) % 3], presence_penalty=[0.0, 0.5][trial % 2],
                repetition_penalty=[1.0, 1.3, 0.7][(trial // 2 + i) % 3],
                min_new_tokens=[0, len(hist) + 2, len(hist) + depth + 3][trial % 3], stop_token_ids={3},
            )
            req = FakeReq(hist[:1], 64)
            req.sampling_params, req.output_ids, req.tokenizer = sp, hist, tokenizer
            reqs.append(req)
            histories.append(hist)
        chain = trial % 4 == 3
        n = depth + 1 if chain else budget + 1
        logits = torch.randn(bs, n, vocab, generator=rng) * 3
        logits[..., 5] = logits[..., 6]  # ties: a scaled pair must stay bit-exact
        if chain:
            tokens = torch.randint(0, vocab, (bs, n), generator=rng)
            tokens[:, 0] = torch.tensor([h[-1] for h in histories])
            shape = chain_shape(bs, n, "cpu")
            paths = [[tokens[i, 1 : j + 1].tolist() for j in range(n)] for i in range(bs)]
        else:
            tree = build_ddtree(torch.randn(bs, depth, vocab, generator=rng), budget)
            tokens = tree.full_token_ids(torch.tensor([h[-1] for h in histories]))
            shape = {"parents": tree.parents, "depths": tree.depths}
            paths = []
            for i in range(bs):
                per = []
                for node in range(n):
                    path, j = [], node
                    while j > 0:
                        path.append(int(tokens[i, j]))
                        j = int(tree.parents[i, j])
                    per.append(path[::-1] if node < int(tree.num_nodes[i]) else [])
                paths.append(per)
        want = logits.clone()
        orch = None
        for i in range(bs):
            for node in range(n):
                want[i, node], orch = _plain_penalised(logits[i, node], reqs[i], histories[i] + paths[i][node])
        batch = _Batch(reqs)
        batch.sampling_info = SimpleNamespace(penalizer_orchestrator=orch, logit_bias=None)
        got = logits.clone()
        dw.adjust_verify_logits(got, batch, tokens=tokens, max_depth=depth if not chain else n - 1, **shape)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:3].tolist()
            out.append(f"penalties trial {trial} ({'chain' if chain else 'tree'}): differ at {bad}, "
                       f"got {[float(got[tuple(b)]) for b in bad]} want {[float(want[tuple(b)]) for b in bad]}")
    return out


def dflash_sampling_checks() -> list[str]:
    """Upstream's sampled DFLASH verify as patched (dflash_utils.patch): a mixed batch and a greedy-only
    batch left with is_all_greedy False (the stalled case) never reach sgl_kernel's renorm kernels, and
    greedy rows get exactly the greedy rule. The tree-sampling kernel is the tests' Python reference."""
    from pathlib import Path

    import sglang.srt.speculative.dflash_utils as up

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ddtree_oracle import tree_sampling_reference

    out: list[str] = []
    called: list[str] = []

    def renorm(*_a, **_k):
        called.append("renorm")
        raise RuntimeError("renorm kernel called (it spins on top_k-1 rows on GPU)")

    up._DFLASH_SAMPLING_VERIFY_AVAILABLE = True
    up.top_k_renorm_prob = up.top_p_renorm_prob = renorm
    up.tree_speculative_sampling_target_only = tree_sampling_reference
    torch.manual_seed(3)
    bs, block, vocab = 4, 5, VOCAB
    for label, top_ks in (("mixed", [1, 1 << 30, 1, 3]), ("greedy only, stale flag", [1, 1, 1, 1])):
        info = SimpleNamespace(
            temperatures=torch.tensor([[1.0], [0.8], [1.0], [0.7]]),
            top_ks=torch.tensor(top_ks, dtype=torch.int32),
            top_ps=torch.tensor([1.0, 0.95, 1.0, 0.9]),
            need_top_k_sampling=True, need_top_p_sampling=True,
        )
        candidates = torch.randint(0, vocab, (bs, block))
        logits = torch.randn(bs * block, vocab) * 3
        try:
            correct, bonus = up.compute_dflash_sampling_correct_drafts_and_bonus(
                candidates=candidates, next_token_logits=logits, sampling_info=info,
                threshold_single=1.0, threshold_acc=1.0)
        except Exception as e:  # noqa: BLE001 - reported as a failure
            out.append(f"dflash sampled verify ({label}): {type(e).__name__}: {e}")
            continue
        want_c, want_b = up.compute_dflash_correct_drafts_and_bonus(
            candidates=candidates, target_predict=logits.argmax(-1).view(bs, block))
        greedy = [i for i, k in enumerate(top_ks) if k == 1]
        if correct[greedy].tolist() != want_c[greedy].tolist() or bonus[greedy].tolist() != want_b[greedy].tolist():
            out.append(f"dflash sampled verify ({label}): greedy rows {correct.tolist()} {bonus.tolist()} "
                       f"!= greedy rule {want_c.tolist()} {want_b.tolist()}")
    if called:
        out.append(f"dflash sampled verify reached the renorm kernels {len(called)} times")
    return out


if __name__ == "__main__":
    sys.exit(main())
