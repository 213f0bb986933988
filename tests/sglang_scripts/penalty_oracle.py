"""The oracle for penalties on a verify step (CPU, inside an unpacked SGLang v2 tree): plain greedy decoding of a
made-up target driven through SGLang's own penalizers, and the random settings the cases draw. Shared by the tree
step's case script (v2_worker_cases.py) and upstream's linear step's (v2_linear_penalty_cases.py)."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import torch
from sglang.srt.speculative import ddtree_penalties as dp

VOCAB = 11

# the tokenizer's eos and additional stop id; a request's own stop_token_ids; the model's eos (a request's
# `eos_token_ids`, which 0.5.23's min_new_tokens holds back too, 0.5.17's not)
EOS, EXTRA_STOP, STOP, MODEL_EOS = 9, 8, 7, 10
TOKENIZER = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids={EXTRA_STOP})


@functools.cache
def penalty_target(position: int, token: int) -> torch.Tensor:
    """A made-up target whose choices penalties change often: float32 logits of both signs with small gaps (randn
    * 1.5 over 11 tokens), the stop tokens lifted so min_new_tokens has something to ban. Read-only: cached."""
    gen = torch.Generator().manual_seed(7919 * position + 104729 * token + 13)
    logits = torch.randn(VOCAB, generator=gen) * 1.5
    logits[EOS] += 1.2
    logits[EXTRA_STOP] += 0.6
    logits[MODEL_EOS] += 0.9
    return logits


PENALIZER_CLASSES = ("BatchedFrequencyPenalizer", "BatchedMinNewTokensPenalizer", "BatchedPresencePenalizer",
                     "BatchedRepetitionPenalizer")


class _Batch(SimpleNamespace):
    """What a penalizer orchestrator reads of its ScheduleBatch (held by weak reference)."""


def orchestrator(reqs: list):
    """A real `BatchedPenalizerOrchestrator` over `reqs`, its classes displayed as `from_schedule_batch` does."""
    from sglang.srt.sampling import penaltylib

    holder = _Batch(reqs=reqs, device="cpu")
    orch = penaltylib.BatchedPenalizerOrchestrator(vocab_size=VOCAB, batch=holder, penalizers={
        penaltylib.BatchedFrequencyPenalizer,
        penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer,
        penaltylib.BatchedRepetitionPenalizer,
    })
    return holder, orch


def sampling_info(reqs: list, bias: torch.Tensor | None):
    """A real greedy `SamplingBatchInfo` with a real orchestrator (what `from_schedule_batch` builds)."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    bs = len(reqs)
    holder, orch = orchestrator(reqs)
    info = SamplingBatchInfo(
        temperatures=torch.ones((bs, 1)), top_ps=torch.ones(bs), top_ks=torch.ones(bs, dtype=torch.int32),
        min_ps=torch.zeros(bs), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=VOCAB, penalizer_orchestrator=orch,
        logit_bias=None if bias is None else bias.clone(), device="cpu")
    holder.sampling_info = info
    return holder, info


def request(settings: dict, first: int, prompt_len: int) -> SimpleNamespace:
    sp = SimpleNamespace(top_k=1, top_p=1.0, min_p=0.0, temperature=1.0, stop_token_ids=settings["stop_ids"],
                         frequency_penalty=settings["frequency"], presence_penalty=settings["presence"],
                         repetition_penalty=settings["repetition"], min_new_tokens=settings["min_new_tokens"])
    return SimpleNamespace(sampling_params=sp, tokenizer=TOKENIZER, eos_token_ids={MODEL_EOS}, output_ids=[first],
                           origin_input_ids=[0] * prompt_len)


def plain_greedy(settings: list, firsts: list, prompt_lens: list, bias, length: int) -> dict:
    """The oracle: plain greedy decoding of `penalty_target` without the overlap scheduler, driven through SGLang's
    own code: per step `ScheduleBatch.cumulate_penalty_output_tokens` (prepare_for_decode), then the target's logits
    through `SamplingBatchInfo.update_regex_vocab_mask` / `apply_logits_bias` (model_runner._preprocess_logits: the
    scheduler's own sampling info, its orchestrator applied in its dict order, then the bias), argmax, append.
    Returns each request's output and its penalised logits per output index, and how often the penalties (the bias
    apart) and min_new_tokens changed the argmax."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    reqs = [request(s, f, p) for s, f, p in zip(settings, firsts, prompt_lens, strict=True)]
    holder, info = sampling_info(reqs, bias)
    orch = info.penalizer_orchestrator
    logits_at: list[dict] = [{} for _ in reqs]
    changed = banned = model_eos_banned = bias_changed = penalised_tokens = 0
    for _ in range(length):
        if orch.is_required:
            ScheduleBatch.cumulate_penalty_output_tokens(holder)
        raw = torch.stack([penalty_target(p + len(r.output_ids) - 1, r.output_ids[-1]) for p, r in
                           zip(prompt_lens, reqs, strict=True)])
        logits = raw.clone()
        info.update_regex_vocab_mask()
        info.apply_logits_bias(logits)
        unbiased = raw.clone()  # the penalties alone
        if orch.is_required:
            orch.apply(unbiased)
        for b, r in enumerate(reqs):
            logits_at[b][len(r.output_ids)] = logits[b].clone()
            if dp.request_penalties(r).active:
                penalised_tokens += 1
                changed += int(unbiased[b].argmax()) != int(raw[b].argmax())
                held = len(r.output_ids) < settings[b]["min_new_tokens"]
                banned += bool(int(raw[b].argmax()) in (EOS, EXTRA_STOP, *settings[b]["stop_ids"]) and held)
                # plain's own penalizer decides whether the model's eos is held back (0.5.23) or not (0.5.17)
                model_eos_banned += bool(int(raw[b].argmax()) == MODEL_EOS and held
                                         and unbiased[b, MODEL_EOS] == float("-inf"))
            bias_changed += int(logits[b].argmax()) != int(unbiased[b].argmax())
        for b, r in enumerate(reqs):
            r.output_ids.append(int(logits[b].argmax()))
    return {"outputs": [list(r.output_ids) for r in reqs], "logits_at": logits_at, "order": tuple(
        type(p).__name__ for p in orch.penalizers.values()), "changed": changed, "banned": banned,
        "model_eos_banned": model_eos_banned, "bias_changed": bias_changed, "penalised_tokens": penalised_tokens}


def random_settings(rng: random.Random, bs: int, neutral: bool) -> tuple[list, torch.Tensor | None]:
    """Per request random penalty settings (request 0 always unpenalised), and a logit bias on some rows."""
    settings = []
    for b in range(bs):
        plain = neutral or b == 0 or rng.random() < 0.15
        settings.append({
            "frequency": 0.0 if plain else rng.choice([0.0, 0.25, 0.6, 1.1]),
            "presence": 0.0 if plain else rng.choice([0.0, 0.0, 0.4, 0.9]),
            "repetition": 1.0 if plain else rng.choice([1.0, 1.25, 1.6, 0.85]),
            "min_new_tokens": 0 if plain else rng.choice([0, 4, 12, 40]),
            "stop_ids": {STOP} if rng.random() < 0.5 else set(),
        })
    bias = None
    if neutral or rng.random() < 0.7:
        bias = torch.zeros((bs, VOCAB))
        for b in range(bs):
            if rng.random() < 0.6:
                bias[b, rng.randrange(VOCAB)] = rng.choice([0.7, -0.9, 1.5])
    return settings, bias
