"""A request's penalty settings as the payload reads them (`ddtree_penalties`, torch only): the per-step check
`is_penalised`, which the v2 linear verify runs on every request of every DFLASH step, against the full
`request_penalties(...).active` it stands for, on random settings (None, neutral and penalised values, outputs
shorter and longer than min_new_tokens); and the model's eos ids among the stop ids only where the base's
penalizer bans them (`req_eos`)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from ddtree_oracle import load_payload_module

dp = load_payload_module("ddtree_penalties")
TOKENIZER = SimpleNamespace(eos_token_id=2, additional_stop_token_ids={3})


def _request(rng: random.Random) -> SimpleNamespace:
    sp = SimpleNamespace(frequency_penalty=rng.choice([None, 0.0, 0.5, -0.25]),
                         presence_penalty=rng.choice([None, 0.0, 0.7]),
                         repetition_penalty=rng.choice([None, 1.0, 1.3, 0.8]),
                         min_new_tokens=rng.choice([None, 0, 4, 64]), stop_token_ids=rng.choice([None, {7}]))
    return SimpleNamespace(sampling_params=sp, tokenizer=TOKENIZER, output_ids=list(range(rng.randint(0, 80))),
                           eos_token_ids=rng.choice([None, {11, 12}]))


def test_is_penalised_is_request_penalties_active() -> None:
    rng = random.Random(26)
    requests = [_request(rng) for _ in range(4000)]
    verdicts = [dp.request_penalties(r).active for r in requests]
    assert [dp.is_penalised(r) for r in requests] == verdicts
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.98  # both answers well represented


def test_model_eos_ids_are_stops_only_where_the_base_bans_them() -> None:
    req = SimpleNamespace(sampling_params=SimpleNamespace(min_new_tokens=5, stop_token_ids={7}), tokenizer=TOKENIZER,
                          output_ids=[1], eos_token_ids={11, 12})
    assert dp.request_penalties(req).stop_ids == (2, 3, 7)  # 0.5.13.post1 / 0.5.17
    assert dp.request_penalties(req, req_eos=True).stop_ids == (2, 3, 7, 11, 12)  # 0.5.23
