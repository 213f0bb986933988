"""What the engine answers, endpoint by endpoint, with SGLang 0.5.13.post1's names and shapes.

Sources in the wheel: `srt/entrypoints/http_server.py` (routes, /health semantics, /server_info's
merge of server args, scheduler info and internal states), `srt/managers/tokenizer_manager.py`
(/generate's meta_info and its length checks), `srt/managers/scheduler.py` (`get_internal_state`,
`get_init_info`), `srt/observability/metrics_collector.py` (metric names and labels). The contract
test (tests/test_lab_engine_contract.py) holds these shapes against the wheel's own definitions.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import time
import uuid
from typing import Any

from sglang.srt.sampling.sampling_params import SamplingParams

from . import server_args as resolved_args
from .decoding import Decoder, Request
from .sampling import Choice
from .scheduler import Job, Scheduler

# As http_server.HEALTH_CHECK_TIMEOUT: how long /health_generate waits for the scheduler.
HEALTH_CHECK_TIMEOUT_S = float(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
# SamplingParams fields the lab engine does not implement; a request that sets one to anything but
# its default is refused with 400 rather than silently served differently from SGLang.
UNSUPPORTED_SAMPLING = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}


class BadRequest(ValueError):
    """Answered as SGLang's `_create_error_response`: 400 {"error": {"message": ...}}."""


class Unavailable(RuntimeError):
    """Answered 503: the server is starting or shutting down."""


@dataclasses.dataclass
class Status:
    starting: bool = True
    draining: bool = False
    never_healthy: bool = False

    @property
    def up(self) -> bool:
        return not (self.starting or self.draining or self.never_healthy)


class EngineApi:
    def __init__(self, server_args: Any, version: str, status: Status, lie: str | None = None) -> None:
        self.server_args = server_args
        self.version = version
        self.status = status
        # faults.LIE, in full mode only (the lossy payload it stands for is a DDTree one).
        self.lie = lie if getattr(server_args, "speculative_ddtree_mode", None) == "full" else None
        self.model_config: dict = {}
        self.tokenizer: Any = None
        self.decoder: Decoder | None = None
        self.scheduler: Scheduler | None = None
        self.context_len = 0
        self.started = time.monotonic()

    def attach(self, *, model_config: dict, tokenizer: Any, decoder: Decoder, scheduler: Scheduler,
               context_len: int) -> None:
        self.model_config, self.tokenizer, self.decoder = model_config, tokenizer, decoder
        self.scheduler, self.context_len = scheduler, context_len

    # ------------------------------------------------------------------ /health, /health_generate
    def health(self, path: str) -> int:
        if not self.status.up:
            return 503
        if path == "/health":
            return 200
        # /health_generate: one greedy token through the scheduler, or any step it makes meanwhile
        tic = time.monotonic()
        job = Job([self._request([0], {"max_new_tokens": 1, "temperature": 0.0}, "HEALTH_CHECK")], counts=False)
        self.scheduler.submit(job)
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            if job.done.wait(0.05) or self.scheduler.last_step_time > tic:
                return 200
        return 503

    # ------------------------------------------------------------------ /model_info
    def model_info(self) -> dict[str, Any]:
        sa = self.server_args
        return {
            "model_path": sa.model_path,
            "tokenizer_path": sa.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": sa.preferred_sampling_params,
            "weight_version": sa.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.model_config.get("model_type"),
            "architectures": self.model_config.get("architectures"),
        }

    # ------------------------------------------------------------------ /server_info
    def internal_state(self) -> dict[str, Any]:
        sa = self.server_args
        state = resolved_args.state_dict(sa)
        state["last_gen_throughput"] = self._gen_throughput()
        state["memory_usage"] = {"weight": 0.0, "kvcache": 0.0, "token_capacity": self.max_total_num_tokens,
                                 "graph": 0.0}
        state["effective_max_running_requests_per_dp"] = self._max_running()
        decoder = self.decoder
        if decoder is not None and decoder.speculative and decoder.spec.forward_ct > 0:
            state["avg_spec_accept_length"] = decoder.spec.accept_length
        if decoder is not None and decoder.tree_stats is not None:
            state["ddtree"] = decoder.tree_stats.internal_state()
        return state

    def server_info(self) -> dict[str, Any]:
        sa = self.server_args
        return {
            **resolved_args.as_dict(sa),
            "status": "ready",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.context_len - 1,
            "internal_states": [self.internal_state()],
            "version": self.version,
            "kv_events": resolved_args.kv_events(sa),
        }

    @property
    def max_total_num_tokens(self) -> int:
        return self.context_len * self._max_running()

    def _max_running(self) -> int:
        return int(self.server_args.max_running_requests or 48)

    def _gen_throughput(self) -> float:
        sched = self.scheduler
        if sched is None:
            return 0.0
        return round(sched.generated_tokens / max(1e-9, time.monotonic() - self.started), 3)

    # ------------------------------------------------------------------ /generate
    def generate(self, body: Any) -> dict[str, Any] | list[dict[str, Any]]:
        if not self.status.up:
            raise Unavailable("The server is not ready" if not self.status.draining else "The server is shutting down")
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the lab engine")
        prompts, batched = self._prompts(body)
        params = body.get("sampling_params") or {}
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise BadRequest(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        requests = [self._request(ids, sp, rid) for ids, sp, rid in zip(prompts, params, rids, strict=True)]
        job = Job(requests)
        started = time.monotonic()
        self.scheduler.submit(job)
        job.done.wait()
        latency = time.monotonic() - started
        outs = [self._lie(self._output(r, latency)) for r in requests]
        return outs if batched else outs[0]

    def _lie(self, out: dict[str, Any]) -> dict[str, Any]:
        if self.lie == "meta-list":
            return {**out, "meta_info": list(out["meta_info"].items())}
        if self.lie == "empty-output":
            return {**out, "output_ids": [], "text": ""}
        if self.lie == "no-output-ids":
            return {k: v for k, v in out.items() if k != "output_ids"}
        return out

    def authorized(self, path: str, authorization: str | None) -> bool:
        """SGLang's api-key middleware for its normal endpoints (srt/utils/auth.py): with --api-key
        every path but /health* and /metrics* needs `Authorization: Bearer <key>`."""
        key = getattr(self.server_args, "api_key", None)
        if not key or path.startswith(("/health", "/metrics")):
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token, key)

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("Either text or input_ids should be provided.")
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings")
            return [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts], isinstance(text, list)
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        rows = input_ids if batched else [input_ids]
        vocab = int(self.model_config["vocab_size"])
        for row in rows:
            if not isinstance(row, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in row):
                raise BadRequest(f"input_ids must be lists of token ids in [0, {vocab})")
        return [list(r) for r in rows], batched

    def _request(self, input_ids: list[int], params: dict, rid: str | None) -> Request:
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        try:
            sp = SamplingParams(**params)
            sp.normalize(None)
            sp.verify(int(self.model_config["vocab_size"]))
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        for name, default in UNSUPPORTED_SAMPLING.items():
            if getattr(sp, name) != default:
                raise BadRequest(f"sampling_params.{name} is not supported by the lab engine")
        if sp.stop_strs or sp.stop_regex_strs:
            raise BadRequest("stop strings and stop regexes are not supported by the lab engine; use stop_token_ids")
        n = len(input_ids)
        if n == 0:
            raise BadRequest("The input is empty")
        if n >= self.context_len:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens).")
        if sp.max_new_tokens is not None and sp.max_new_tokens + n > self.context_len:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {sp.max_new_tokens + n} tokens: {n} tokens from the input messages and "
                f"{sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        max_new = sp.max_new_tokens if sp.max_new_tokens is not None else self.context_len - n
        seed = sp.sampling_seed if sp.sampling_seed is not None else uuid.uuid4().int & 0xFFFFFFFF
        choice = Choice(greedy=sp.top_k == 1, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                        min_p=sp.min_p, seed=int(seed))
        return Request(
            rid=rid or uuid.uuid4().hex,
            input_ids=input_ids,
            choice=choice,
            max_new_tokens=int(max_new),
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            ignore_eos=bool(sp.ignore_eos),
            eos_token_id=int(self.model_config["eos_token_id"]),
        )

    def _output(self, r: Request, latency: float) -> dict[str, Any]:
        ids = r.output_ids
        matched = (r.finish_reason or {}).get("matched")
        shown = ids[:-1] if isinstance(matched, int) and ids else ids  # detokenizer's trim_matched_stop
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "weight_version": self.server_args.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
        }
        if self.server_args.speculative_algorithm and r.spec_verify_ct > 0:
            proposed = r.spec_verify_ct * (int(self.server_args.speculative_num_draft_tokens) - 1)
            meta.update({
                "spec_accept_rate": r.spec_num_correct_drafts / proposed,
                "spec_accept_length": len(ids) / r.spec_verify_ct,
                "spec_num_correct_drafts": r.spec_num_correct_drafts,
                "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": r.spec_verify_ct,
                "spec_accepted_drafts": r.spec_num_correct_drafts,
                "spec_proposed_drafts": proposed,
            })
        return {"text": self.tokenizer.decode(shown, skip_special_tokens=True), "output_ids": list(ids),
                "meta_info": meta}

    # ------------------------------------------------------------------ /metrics
    def metrics(self) -> str:
        sa = self.server_args
        labels = {"model_name": sa.served_model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                  "moe_ep_rank": "0"}
        label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        sched, decoder = self.scheduler, self.decoder
        gauges = [
            ("sglang:num_running_reqs", "The number of running requests.", sched.num_running if sched else 0),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched.num_waiting if sched else 0),
            ("sglang:gen_throughput", "The generation throughput (token/s).", self._gen_throughput()),
        ]
        if decoder is not None and decoder.speculative:
            gauges += [
                ("sglang:spec_accept_length",
                 "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
                 decoder.spec.accept_length or 0.0),
                ("sglang:spec_accept_rate",
                 "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
                 decoder.spec.accept_rate or 0.0),
            ]
        lines = []
        for name, doc, value in gauges:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{label_text}}} {float(value)}"]
        counters = [
            ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", sched.prompt_tokens if sched else 0),
            ("sglang:generation_tokens_total", "Number of generation tokens processed.",
             sched.generated_tokens if sched else 0),
        ]
        for name, doc, value in counters:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name}{{{label_text}}} {float(value)}"]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
