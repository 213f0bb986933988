"""The H200 step audit's own checks (bench/gpu/state_audit/), on the CPU: each inconsistency it exists to find
is planted in an otherwise consistent batch and must be named, and a consistent batch must raise nothing.
The audit decides what a GPU call concludes, so a check that cannot fail would hide a fault there."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

AUDIT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "state_audit"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, AUDIT / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("state_audit_hooks", "sitecustomize.py")
analyze = _load("state_audit_analyze", "analyze.py")


def _verify_batch(rng: random.Random, width: int = 4):
    """A linear verify as SGLang builds it: lengths, slots written into req_to_token, positions, causal mask."""
    bs = rng.randint(1, 6)
    rows = rng.sample(range(8), bs)
    seq = [rng.randint(1, 30) for _ in range(bs)]
    r2t = torch.zeros(8, 64, dtype=torch.int32)
    slots = iter(rng.sample(range(1, 2000), sum(seq) + bs * width))
    for r, n in zip(rows, seq, strict=True):
        for p in range(n + width):
            r2t[r, p] = next(slots)
    loc = torch.cat([r2t[r, n:n + width] for r, n in zip(rows, seq, strict=True)])
    pos = torch.cat([torch.arange(n, n + width) for n in seq])
    mask = torch.cat([(torch.arange(n + width)[None, :] <= n + torch.arange(width)[:, None]).flatten() for n in seq])
    used = set(r2t.flatten().tolist())
    free = torch.tensor([s for s in range(1, 2100) if s not in used][:50])
    runner = NS(req_to_token_pool=NS(req_to_token=r2t),
                token_to_kv_pool_allocator=NS(free_pages=free, release_pages=torch.empty(0, dtype=torch.int64)))
    fb = NS(batch_size=bs, spec_info=NS(draft_token_num=width, custom_mask=mask), seq_lens=torch.tensor(seq),
            seq_lens_cpu=torch.tensor(seq), seq_lens_sum=sum(seq), req_pool_indices=torch.tensor(rows),
            out_cache_loc=loc, positions=pos)
    return runner, fb


@pytest.mark.parametrize("seed", range(6))
def test_verify_input_checks_name_each_planted_fault_and_nothing_else(seed):
    rng = random.Random(seed)
    runner, fb = _verify_batch(rng)
    assert hooks._check_verify_input(runner, fb) == []
    row = rng.randrange(fb.batch_size)
    width = fb.spec_info.draft_token_num

    def found(**change) -> set[str]:
        return {i["what"] for i in hooks._check_verify_input(runner, NS(**{**vars(fb), **change}))}

    pos = fb.positions.clone()
    pos[row * width] += 1
    assert found(positions=pos) == {"positions"}
    cpu = fb.seq_lens_cpu.clone()
    cpu[row] += 1
    assert found(seq_lens_cpu=cpu) == {"seq_lens_cpu"}
    assert found(seq_lens_sum=fb.seq_lens_sum - 1) == {"seq_lens_sum"}
    mask = fb.spec_info.custom_mask.clone()
    start = sum(width * (int(n) + width) for n in fb.seq_lens[:row])
    mask[start + rng.randrange(width * (int(fb.seq_lens[row]) + width))] ^= True
    assert found(spec_info=NS(draft_token_num=width, custom_mask=mask)) == {"custom_mask"}
    # a new slot that a row already holds: written into its KV over a committed position
    loc = fb.out_cache_loc.clone()
    held = int(runner.req_to_token_pool.req_to_token[int(fb.req_pool_indices[row]), 0])
    loc[row * width + width - 1] = held
    assert {"new slots held", "out_cache_loc"} <= found(out_cache_loc=loc)
    # a held slot back on the free list (freed while in use)
    alloc = runner.token_to_kv_pool_allocator
    alloc.release_pages = torch.tensor([held])
    assert found() == {"held slots free"}


def _attention_metadata(runner, fb):
    """The triton backend's verify metadata for that batch: KV ranges from req_to_token, 16-wide query blocks,
    mask ranges of prefix + block per query row."""
    width, seq = fb.spec_info.draft_token_num, fb.seq_lens.tolist()
    r2t = runner.req_to_token_pool.req_to_token
    indices = torch.cat([r2t[int(r), :n].to(torch.int64) for r, n in zip(fb.req_pool_indices, seq, strict=True)])
    indptr = torch.tensor([0] + list(torch.tensor(seq).cumsum(0)))
    masks = torch.tensor([0] + list(torch.tensor([width * (n + width) for n in seq]).cumsum(0)))
    md = NS(kv_indptr=indptr, kv_indices=indices, qo_indptr=torch.arange(len(seq) + 1) * width, mask_indptr=masks)
    return NS(**vars(runner), attn_backend=NS(full_attn_backend=NS(forward_metadata=md))), md


@pytest.mark.parametrize("seed", range(4))
def test_attention_metadata_check_names_each_planted_fault_and_nothing_else(seed):
    rng = random.Random(seed)
    runner, fb = _verify_batch(rng)
    runner, md = _attention_metadata(runner, fb)
    assert hooks._check_attention_metadata(runner, fb) == []
    row = rng.randrange(fb.batch_size)

    def found(**change) -> list[dict]:
        backend = NS(forward_metadata=NS(**{**vars(md), **change}))
        return hooks._check_attention_metadata(NS(**{**vars(runner), "attn_backend": NS(full_attn_backend=backend)}), fb)

    idx = md.kv_indices.clone()
    at = int(md.kv_indptr[row]) + rng.randrange(int(fb.seq_lens[row]))
    idx[at] = 99999  # one committed position read from a slot that is not the request's
    (issue,) = found(kv_indices=idx)
    assert issue["what"] == "kv_indices" and [r["row"] for r in issue["rows"]] == [row]
    short = md.kv_indptr.clone()
    short[row + 1:] -= 1  # the row's range one position short: the kernel would not see its last token
    assert "kv_indices" in {i["what"] for i in found(kv_indptr=short)}
    qo = md.qo_indptr.clone()
    qo[-1] -= 1
    assert [i["what"] for i in found(qo_indptr=qo)] == ["qo_indptr"]
    mi = md.mask_indptr.clone()
    mi[-1] += 1
    assert [i["what"] for i in found(mask_indptr=mi)] == ["mask_indptr"]


def test_slot_integrity_sees_a_slot_handed_out_twice_in_one_step():
    runner, fb = _verify_batch(random.Random(7))
    new = fb.out_cache_loc.clone()
    new[-1] = new[0]
    issues = hooks._slot_integrity(runner, fb.req_pool_indices, fb.seq_lens.tolist(), new, fb.spec_info.draft_token_num)
    assert [i["what"] for i in issues] == ["new slots repeated"]


def _record(ct, mode, rows, seq, pre, post, correct=None, clear=None):
    """One audit line: rows are prompts (hashed as the server does), slots the row index."""
    return {"ct": ct, "mode": mode, "rids": [f"r{i}" for i in range(len(rows))],
            "phash": [hash(tuple(p)) & 0xFFFFFFFF for p in rows], "slots": list(range(len(rows))),
            "seq": seq, "clear": clear, "graph": False, "correct": correct,
            "pre": [[v, abs(v) + 1, v, abs(v) + 1] for v in pre], "post": [[v, abs(v) + 1, v, abs(v) + 1] for v in post]}


def test_analyzer_reports_lost_commits_clobbers_stale_clears_and_states_off_plain(tmp_path):
    a, b = [5, 6, 7], [9]
    (tmp_path / "workload_h.json").write_text(json.dumps(
        {"round1": [{"id": "a", "prompt": a}, {"id": "b", "prompt": b}], "round2": []}))
    names = analyze.ids_by_hash(str(tmp_path / "workload_h.json"))
    # plain: a decode step per token; a slot's fingerprint is the number of tokens its state holds
    plain = [_record(1, "EXTEND", [a, b], [3, 1], [0, 0, 0], [3, 1, 0])]
    plain += [_record(k + 1, "DECODE", [a, b], [3 + k, 1 + k], [2 + k, k, 0], [3 + k, 1 + k, 0]) for k in range(1, 6)]
    # a verify committing 2 tokens each; the second step leaves b's slot as it was, writes the free slot 2,
    # and carries the prefill's clear indices
    cand = [_record(1, "EXTEND", [a, b], [3, 1], [0, 0, 0], [3, 1, 0]),
            _record(2, "DECODE", [a, b], [3, 1], [3, 1, 0], [5, 3, 0], correct=[1, 1]),
            _record(3, "DECODE", [a, b], [5, 3], [5, 3, 0], [7, 3, 9], correct=[1, 1], clear=[0])]
    events = analyze.self_checks(cand, names)
    assert any("slot 2 changed, owned by no row" in e for e in events)
    assert any("b slot 1 unchanged" in e for e in events)
    assert any("stale clear indices [0]" in e for e in events)
    assert analyze.self_checks(plain, names) == []
    ref, got = analyze.states(plain, names), analyze.states(cand, names)
    off = [n for n in sorted(set(got["b"]) & set(ref["b"])) if analyze.rel(got["b"][n][0], ref["b"][n][0]) > 0.05]
    assert off == [5]  # b's state after the lost commit holds 3 tokens' worth, plain's at 5 holds 5
    assert all(analyze.rel(got["a"][n][0], ref["a"][n][0]) == 0 for n in set(got["a"]) & set(ref["a"]))
    assert analyze.same_tokens_until([1, 2, 3, 4], [1, 2, 9, 4]) == 2
