"""Bench-only audit of a hybrid server, step by step (issue 25, HYBRID.md §1.11).

Loaded by Python at start-up when this directory leads PYTHONPATH (run_device.sh's AUDIT token); active
only when DDTREE_STATE_AUDIT names an output path. It wraps `Scheduler.run_batch` and `ModelRunner.forward`
and writes one JSON line per batch: the rows (request, prompt hash, mamba slot, length before the step), the
batch's pending clear indices, a fingerprint of every slot's conv window and SSM state before and after the
step, committed KV that changed since it was committed (and the K/V sums of what the step committed), the
verify input against the batch's own lengths (and, eagerly, what the attention kernel was given), KV slot
integrity, and the target's top-2 logits (with, on an eager server, every sublayer's output) for each decode
row / verify row's first token. `analyze.py` then
follows each request: a slot that changes while its owner is not stepping (clobbered), a verify whose commit
leaves the slot as it was (lost), the first length at which a speculative server's state leaves plain
decoding's for the same request, and the first sublayer where a token leaves plain's.

Nothing here changes what the server computes; it only reads the pool between steps (after a device
sync), so it slows steps and must never run in a speed measurement. Needs the non-overlap scheduler:
with overlap, a step's fingerprint would race the next step."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

_OUT = os.environ.get("DDTREE_STATE_AUDIT")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_image_sitecustomize() -> None:
    """Run the image's own sitecustomize too, if it has one (this file shadows it)."""
    me = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if me is not None:
            sys.modules["sitecustomize"] = me


def _fingerprint(pool) -> list[list[float]]:
    import torch

    cache = pool.mamba_pool.mamba_cache
    rows = []
    for t in (cache.temporal, cache.conv[0]):
        x = t.detach().double().flatten(2)  # [layers, slots, ...]
        rows.append(x.sum(-1).sum(0))
        rows.append(x.abs().sum(-1).sum(0))
    return torch.stack(rows, 1).tolist()  # per slot: [ssm sum, ssm |sum|, conv sum, conv |sum|]


def _kv_sums(scheduler, slots):
    """Per token slot, each full-attention layer's K and V summed: [len(slots), 2 * layers]."""
    import torch

    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    pool = getattr(pool, "full_kv_pool", pool)
    return torch.stack([b[slots].float().flatten(1).sum(1) for b in (*pool.k_buffer, *pool.v_buffer)], 1)


def _tokens_after(rec: dict, i: int) -> int:
    """Tokens of row i whose KV and state the step leaves committed (analyze.state_tokens's rule)."""
    if rec["mode"] in ("EXTEND", "MIXED") or rec.get("correct") is None:
        return rec["seq"][i]
    return rec["seq"][i] + rec["correct"][i] + 1


_VERIFY_ISSUES: list[dict] = []  # the target's verify-input checks of the current step (run_batch collects them)


def _free_slots(allocator):
    import torch

    parts = [t for t in (getattr(allocator, "free_pages", None), getattr(allocator, "release_pages", None))
             if t is not None]
    return torch.cat([t.to(torch.int64) for t in parts]) if parts else None


def _slot_integrity(owner, rpi, lengths: list[int], new_slots, width: int) -> list[dict]:
    """KV slots held by the batch's rows (their first `lengths` positions) must be neither free nor handed
    out again; a step's new slots must be distinct, not held, not still free. Rows/positions are reported."""
    import torch

    r2t = owner.req_to_token_pool.req_to_token
    held = [r2t[int(rpi[i]), :n].to(torch.int64) for i, n in enumerate(lengths)]
    owner_of = torch.cat([torch.full((len(h),), i, device=r2t.device) for i, h in enumerate(held)]) if held else None
    held_all = torch.cat(held) if held else None
    issues: list[dict] = []
    free = _free_slots(owner.token_to_kv_pool_allocator)

    def where(mask, of):  # first few (row, position) pairs of a flat mask
        idx = mask.nonzero().flatten()[:6].tolist()
        if of is None:
            return [(i // width, i % width) for i in idx]
        out = []
        for i in idx:
            r = int(of[i])
            out.append((r, i - sum(len(h) for h in held[:r])))
        return out

    def flag(what: str, mask, of) -> None:
        if mask.any():
            issues.append({"what": what, "at": where(mask, of)})

    def repeated(t):
        _, inv, cnt = t.unique(return_inverse=True, return_counts=True)
        return cnt[inv] > 1

    def some(t) -> bool:
        return t is not None and t.numel() > 0

    if some(held_all):
        flag("held slots shared", repeated(held_all), owner_of)
        if some(free):
            flag("held slots free", torch.isin(held_all, free), owner_of)
    if some(free) and free.unique().numel() != free.numel():
        issues.append({"what": "free list duplicates", "n": int(free.numel() - free.unique().numel())})
    if new_slots is not None and width:
        new = new_slots.to(torch.int64)
        flag("new slots repeated", repeated(new), None)
        if some(held_all):
            flag("new slots held", torch.isin(new, held_all), None)
        if some(free):
            flag("new slots still free", torch.isin(new, free), None)
    return issues


def _check_verify_input(runner, fb) -> list[dict]:
    """What a linear verify's inputs must be, from the batch's own lengths (GPU): the CPU mirror and sum of
    the lengths, each row's positions, KV slots and custom-mask rows. A DDTree step's positions and mask
    follow its tree: only the lengths and slots are checked there."""
    import torch

    issues: list[dict] = []
    bs, spec = fb.batch_size, fb.spec_info
    width = int(spec.draft_token_num)
    seq = fb.seq_lens[:bs].to(torch.int64)
    seq_l = seq.tolist()
    if fb.seq_lens_cpu is not None and fb.seq_lens_cpu[:bs].tolist() != seq_l:
        issues.append({"what": "seq_lens_cpu", "cpu": fb.seq_lens_cpu[:bs].tolist(), "gpu": seq_l})
    if fb.seq_lens_sum is not None and int(fb.seq_lens_sum) != sum(seq_l):
        issues.append({"what": "seq_lens_sum", "sum": int(fb.seq_lens_sum), "want": sum(seq_l)})
    steps = torch.arange(width, device=seq.device)
    issues += _slot_integrity(runner, fb.req_pool_indices[:bs], seq_l, fb.out_cache_loc[: bs * width], width)
    want_loc = runner.req_to_token_pool.req_to_token[fb.req_pool_indices[:bs, None].to(torch.int64),
                                                     seq[:, None] + steps[None, :]]
    loc = fb.out_cache_loc[: bs * width].view(bs, width).to(want_loc.dtype)
    bad = (loc != want_loc).any(1).nonzero().flatten().tolist()
    if bad:
        issues.append({"what": "out_cache_loc", "rows": bad})
    if getattr(spec, "retrieve_next_token", None) is not None:
        return issues
    pos = fb.positions[: bs * width].view(bs, width).to(torch.int64)
    bad = (pos != seq[:, None] + steps[None, :]).any(1).nonzero().flatten().tolist()
    if bad:
        issues.append({"what": "positions", "rows": bad, "first": pos[bad, 0].tolist(), "seq": [seq_l[r] for r in bad]})
    mask = getattr(spec, "custom_mask", None)
    if mask is not None:
        q = steps[:, None]
        start, rows = 0, []
        for i, n in enumerate(seq_l):
            want = (torch.arange(n + width, device=seq.device)[None, :] <= n + q).flatten()
            got = mask[start:start + want.numel()]
            if got.numel() != want.numel() or not torch.equal(got.to(torch.bool), want):
                rows.append(i)
            start += want.numel()
        if rows:
            issues.append({"what": "custom_mask", "rows": rows, "mask_len": int(mask.numel()), "want_len": start})
    return issues


def _check_attention_metadata(runner, fb) -> list[dict]:
    """What the full-attention kernel read in a verify (its metadata outlives the forward): each row's KV
    index range must be its request's committed slots, its query block `draft_token_num` wide and its mask
    range sized for prefix + block. The verify-input checks above see what the batch says; this sees what
    the kernel was given."""
    import torch

    backend = getattr(runner.attn_backend, "full_attn_backend", runner.attn_backend)
    md = getattr(backend, "forward_metadata", None)
    if md is None or getattr(md, "kv_indptr", None) is None:
        return [{"what": "attention metadata", "backend": type(backend).__name__, "missing": True}]
    bs, width = fb.batch_size, int(fb.spec_info.draft_token_num)
    seq = fb.seq_lens[:bs].to(torch.int64).tolist()
    indptr = md.kv_indptr[: bs + 1].to(torch.int64).tolist()
    issues, rows = [], []
    table = runner.req_to_token_pool.req_to_token
    for i, n in enumerate(seq):
        got = md.kv_indices[indptr[i]:indptr[i + 1]].to(torch.int64)
        want = table[int(fb.req_pool_indices[i]), :n].to(torch.int64)
        if indptr[i + 1] - indptr[i] != n or not torch.equal(got, want):
            rows.append({"row": i, "len": indptr[i + 1] - indptr[i], "want": n,
                         "first_off": (got != want).nonzero().flatten()[:4].tolist() if got.numel() == n else None})
    if rows:
        issues.append({"what": "kv_indices", "backend": type(backend).__name__, "rows": rows[:8]})
    qo = getattr(md, "qo_indptr", None)
    if qo is not None and qo[: bs + 1].tolist() != [i * width for i in range(bs + 1)]:
        issues.append({"what": "qo_indptr", "got": qo[: bs + 1].tolist()})
    mi = getattr(md, "mask_indptr", None)
    if mi is not None:
        want, acc = [0], 0
        for n in seq:
            acc += width * (n + width)
            want.append(acc)
        if mi[: bs + 1].tolist() != want:
            issues.append({"what": "mask_indptr", "got": mi[: bs + 1].tolist(), "want": want})
    return issues


_LAYER_ROWS: list[dict] = []  # per step: each decode row's / verify row's first token, per sublayer output
_CAPTURE: dict = {}  # the forward in flight: which token rows to fingerprint, and what each sublayer gave


def _fp_rows(t, rows):
    """[sum, |sum|] of each picked token's row of a sublayer output (a layer's (hidden, residual): their sum)."""
    if isinstance(t, tuple):
        t = t[0] + t[1] if len(t) > 1 and t[1] is not None and t[1].shape == t[0].shape else t[0]
    x = t.detach()[rows].float().flatten(1)
    return [[a, b] for a, b in zip(x.sum(1).tolist(), x.abs().sum(1).tolist(), strict=True)]


def _hook_layers(runner) -> None:
    """Forward hooks on every decoder layer and its mixer / MLP. They run eagerly only (a CUDA graph replays
    no Python): the per-layer comparison needs eager servers, plain's included."""
    import torch

    layers = getattr(getattr(runner.model, "model", None), "layers", None)
    if layers is None:
        return
    for i, layer in enumerate(layers):
        mods = [(f"{i}", layer)] + [(f"{i}.{n}", m) for n, m in layer.named_children()
                                    if n in ("linear_attn", "self_attn", "attn", "mlp")]
        for name, mod in mods:
            def hook(mod, inp, out, name=name):
                try:  # never let the diagnosis break a forward
                    if _CAPTURE.get("rows") is None or (torch.cuda.is_available()
                                                        and torch.cuda.is_current_stream_capturing()):
                        return
                    _CAPTURE["fp"][name] = _fp_rows(out, _CAPTURE["rows"])
                except Exception as e:  # noqa: BLE001
                    _CAPTURE.get("fp", {})[f"{name} error"] = repr(e)[:200]
            mod.register_forward_hook(hook)


def _install_verify_checks(module) -> None:
    import torch

    cls = module.ModelRunner
    original = cls.forward

    def forward(self, forward_batch, *args, **kwargs):
        mode = forward_batch.forward_mode
        target = not self.is_draft_worker
        if mode.is_target_verify() and target:
            try:
                _VERIFY_ISSUES.extend(_check_verify_input(self, forward_batch))
            except Exception as e:  # noqa: BLE001 - a diagnosis must not stop the server
                _VERIFY_ISSUES.append({"what": "check failed", "error": repr(e)[:300]})
        pick = None
        if target and (mode.is_target_verify() or mode.is_decode()):
            if not getattr(self, "_audit_hooked", False):
                self._audit_hooked = True
                _hook_layers(self)
            bs = forward_batch.batch_size
            width = int(forward_batch.spec_info.draft_token_num) if mode.is_target_verify() else 1
            pick = torch.arange(bs, device=forward_batch.seq_lens.device) * width
            _CAPTURE.update(rows=pick, fp={})
        try:
            out = original(self, forward_batch, *args, **kwargs)
        finally:
            fp = _CAPTURE.pop("fp", None)
            _CAPTURE.pop("rows", None)
        if mode.is_target_verify() and target and not getattr(out, "can_run_graph", False):
            try:
                _VERIFY_ISSUES.extend(_check_attention_metadata(self, forward_batch))
            except Exception as e:  # noqa: BLE001
                _VERIFY_ISSUES.append({"what": "attention check failed", "error": repr(e)[:300]})
        if pick is not None:
            try:
                logits = out.logits_output.next_token_logits[pick].float()
                val, tok = logits.topk(2, dim=-1)
                _LAYER_ROWS.append({"rpi": forward_batch.req_pool_indices[: len(pick)].tolist(),
                                    "pos": forward_batch.positions[pick].tolist(), "layers": fp or {},
                                    "top2": [[[int(t[0]), round(float(v[0]), 4)], [int(t[1]), round(float(v[1]), 4)]]
                                             for t, v in zip(tok.tolist(), val.tolist(), strict=True)]})
            except Exception as e:  # noqa: BLE001
                _LAYER_ROWS.append({"error": repr(e)[:300]})
        return out

    cls.forward = forward


def _install(module) -> None:
    import torch

    cls = module.Scheduler
    original = cls.run_batch
    out = open(f"{_OUT}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 - open for the server's life
    notes: set[str] = set()
    kv_seen: dict[str, tuple] = {}  # rid -> (its committed positions' token slots, their KV sums)

    def note(text: str) -> None:  # once each: an audit that cannot read the pool must not stop the server
        if text not in notes:
            notes.add(text)
            out.write(json.dumps({"note": text}) + "\n")

    def before(self, batch) -> dict | None:
        pool = getattr(self, "req_to_token_pool", None)
        if batch is None or pool is None or not hasattr(pool, "mamba_pool") or not batch.reqs:
            return None
        if getattr(self, "enable_overlap", False):
            note("overlap scheduler on: no audit")
            return None
        clear = getattr(batch, "mamba_clear_indices", None)
        rec = {
            "ct": self.forward_ct + 1,
            "mode": batch.forward_mode.name,
            "rids": [r.rid for r in batch.reqs],
            "phash": [hash(tuple(r.origin_input_ids)) & 0xFFFFFFFF for r in batch.reqs],
            "slots": pool.req_index_to_mamba_index_mapping[batch.req_pool_indices].tolist(),
            "seq": batch.seq_lens.tolist(),
            "clear": clear.tolist() if clear is not None else None,
            "_rpi": batch.req_pool_indices.clone(),
            "rpi": batch.req_pool_indices.tolist(),
        }
        running = getattr(self, "running_batch", None)
        live = [i for i, r in enumerate(running.reqs) if not r.finished()] if running is not None else []
        if batch.forward_mode.is_extend() and live and batch.out_cache_loc is not None:
            # a prefill's new slots against the committed ones of the running requests (finished ones have
            # released theirs but stay in the batch until it is filtered) and the free list
            rec["prefill_issues"] = _slot_integrity(self, running.req_pool_indices[live],
                                                    [int(running.seq_lens[i]) for i in live], batch.out_cache_loc, 1)
        torch.cuda.synchronize()
        rec["pre"] = _fingerprint(pool)
        return rec

    def after(self, rec: dict, result) -> None:
        torch.cuda.synchronize()
        rec["post"] = _fingerprint(self.req_to_token_pool)
        nxt = getattr(result, "next_token_ids", None)
        rec["next"] = nxt.tolist() if isinstance(nxt, torch.Tensor) else None
        rec["correct"] = getattr(result, "num_correct_drafts_per_req_cpu", None)
        rec["graph"] = bool(getattr(result, "can_run_cuda_graph", False))
        rec["kv"] = check_kv(self, rec)
        rec["verify_issues"], _VERIFY_ISSUES[:] = list(_VERIFY_ISSUES), []
        rec["layer_rows"], _LAYER_ROWS[:] = list(_LAYER_ROWS), []
        out.write(json.dumps(rec) + "\n")

    def check_kv(self, rec: dict) -> list[dict]:
        """A committed position's KV must never change: compare every row's earlier positions (their
        token slots and KV sums) with what was seen when they were committed, then remember the new ones."""
        rpi, events = rec.pop("_rpi"), []
        after = [_tokens_after(rec, i) for i in range(len(rec["rids"]))]
        rec["slot_issues"] = _slot_integrity(self, rpi, after, None, 0)
        rows = self.req_to_token_pool.req_to_token[rpi]
        for i, (rid, n) in enumerate(zip(rec["rids"], after, strict=True)):
            slots = rows[i, :n].to(torch.int64)
            sums = _kv_sums(self, slots)
            if rid in kv_seen:
                old_slots, old_sums = kv_seen[rid]
                m = min(len(old_slots), n)
                moved = (old_slots[:m] != slots[:m]).nonzero().flatten().tolist()
                changed = (old_sums[:m] != sums[:m]).any(1).nonzero().flatten().tolist()
                if moved or changed:
                    events.append({"rid": rid, "row": i, "moved": moved[:8], "changed": changed[:8],
                                   "slots": [int(slots[p]) for p in (moved or changed)[:8]], "n": m})
            start = len(kv_seen[rid][0]) if rid in kv_seen else 0
            if n > start:  # what this step committed, per position: compared with plain's by analyze.py
                rec.setdefault("kv_new", {})[rid] = [start, [[round(x, 4) for x in r] for r in sums[start:n].tolist()]]
            kv_seen[rid] = (slots, sums)
        return events

    def run_batch(self, batch, *args, **kwargs):
        _VERIFY_ISSUES.clear()
        _LAYER_ROWS.clear()
        try:
            rec = before(self, batch)
        except Exception as e:  # noqa: BLE001
            note(f"before: {e!r}")
            rec = None
        result = original(self, batch, *args, **kwargs)
        if rec is not None:
            try:
                after(self, rec, result)
            except Exception as e:  # noqa: BLE001
                note(f"after: {e!r}")
        return result

    cls.run_batch = run_batch


class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches a module as soon as it has run (in whichever process imports it)."""

    def __init__(self, installers) -> None:
        self.installers = dict(installers)

    def find_spec(self, fullname, path, target=None):
        install = self.installers.pop(fullname, None)  # once: the find_spec below must not come back here
        if install is None:
            return None
        if not self.installers:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec


_chain_image_sitecustomize()
if _OUT:
    sys.meta_path.insert(0, _ImportHook({"sglang.srt.managers.scheduler": _install,
                                         "sglang.srt.model_executor.model_runner": _install_verify_checks}))
