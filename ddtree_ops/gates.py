"""Promote's gates: probes of the SGLang HTTP API (httpx) that return a GateVerdict — pass, fail or
inconclusive — with the evidence they judged.

Order (rollout.py runs them): ready → settings → lossless canary → liveness under mixed traffic →
acceptance (full only). `ready` is probed on the host by the agent (the unit's state and
/health_generate together, so a unit that dies fails at once); this module turns its answer into a
verdict. The others talk HTTP through the SSH tunnel (tunnel.py).

The canary is built to catch what short prompts miss: requests sent concurrently, one whose prompt
ends near the server's context length, long generations, and a shared prefix sent twice (the second
round is served from the radix cache). Its prompts are fixed when the baseline is recorded and
replayed unchanged, so "token-identical" compares like with like.

Nothing a server answers can make a gate pass by accident or raise: every request and every gate
has a wall-clock deadline (a server that drips its reply byte by byte is cut off at it), an answer
of the wrong shape is an error of that request, a gate that raises anyway is a failed verdict with
the exception as evidence, and a canary that compared fewer than MIN_CANARY_TOKENS tokens is
inconclusive, never a pass.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddtree_ops.errors import UsageError

Verdict = Literal["pass", "fail", "inconclusive"]
DEFAULT_REQUEST_TIMEOUT_S = 300.0
DEFAULT_LIVENESS_BOUND_S = 120.0

# The default canary; sizes stay small enough for the CPU lab engine and still exercise each path.
CONCURRENT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Write the next sentence of the story:",
    "List the first ten prime numbers, separated by commas:",
    "Explain in two sentences why the sky is blue.",
    "Translate to French: The weather is nice today and we are going to the beach.",
)
SHARED_PREFIX = ("You are a careful assistant. Read the following notes and answer the question at the end. "
                 "Notes: the warehouse opens at seven, deliveries arrive at nine, the inventory is counted "
                 "on Fridays, and the loading dock closes at five. ") * 4
SHARED_SUFFIXES = ("Question: when is the inventory counted?", "Question: when does the loading dock close?")
CONCURRENT_TOKENS, LONG_TOKENS, NEAR_CONTEXT_TOKENS, SHARED_TOKENS = 48, 192, 8, 32
LIVENESS_TOKENS = 48
DEFAULT_GATE_TIMEOUT_S = 600.0
# A canary that compared fewer greedy tokens than this judged nothing.
MIN_CANARY_TOKENS = 32


@dataclass
class GateVerdict:
    gate: str
    verdict: Verdict
    reason: str
    seconds: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3)}

    def summary(self) -> dict[str, Any]:
        return {"gate": self.gate, "verdict": self.verdict, "reason": self.reason, "seconds": round(self.seconds, 3)}


class Deadline:
    """A gate's wall-clock bound: what is left of it, for each request it sends."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        left = max(0.0, self.end - time.monotonic())
        return min(left, cap) if cap is not None else left


class ServerClient:
    """httpx against one server (through the tunnel); counts the seconds spent waiting on it.

    Every call has a wall-clock bound: httpx's timeouts count per read, so a server that sends a
    byte now and then would hold a call for ever; the call runs in a daemon thread and is abandoned
    at its bound (the tunnel's end closes its connection)."""

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 api_key: str | None = None) -> None:
        import httpx

        # No keep-alive: a restarted server must not be talked to over a connection to its predecessor.
        # With --api-key SGLang wants the key as a bearer token (never logged: httpx logs no headers).
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers,
                                    limits=httpx.Limits(max_keepalive_connections=0, max_connections=64))
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self.wait_s = 0.0  # wall time with at least one request in flight (concurrent ones count once)

    def close(self) -> None:
        self._client.close()

    def _bounded(self, fn: Callable[[], Any], bound_s: float) -> Any:
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1
        try:
            threading.Thread(target=run, daemon=True, name="ddtree-http").start()
            if not done.wait(bound_s):
                raise TimeoutError(f"no complete answer within {bound_s:.0f}s")
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.wait_s += time.monotonic() - self._busy_since
        if "error" in box:
            raise box["error"]
        return box["value"]

    def get(self, path: str, timeout_s: float | None = None) -> tuple[int | None, Any]:
        """(status, parsed JSON or text); status None when the server could not be reached in time."""
        import httpx

        bound = self.timeout_s if timeout_s is None else timeout_s
        if bound <= 0:
            return None, "not sent: the gate's deadline had passed"
        try:
            resp = self._bounded(lambda: self._client.get(path, timeout=bound), bound)
        except (httpx.HTTPError, TimeoutError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text[:2000]

    def generate(self, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST /generate → the answer object (a dict with a list of int `output_ids`); raises GenerateError
        with the status, the transport error, the missed deadline or what is wrong with the answer."""
        import httpx

        bound = self.timeout_s if timeout_s is None else timeout_s
        if bound <= 0:
            raise GenerateError("not sent: the gate's deadline had passed")
        try:
            resp = self._bounded(lambda: self._client.post("/generate", json=body, timeout=bound), bound)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise GenerateError(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise GenerateError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            data = resp.json()
        except ValueError:
            raise GenerateError(f"the answer is not JSON: {resp.text[:200]!r}") from None
        return generate_answer(data)


class GenerateError(Exception):
    pass


def generate_answer(data: Any) -> dict[str, Any]:
    """The one answer of a /generate call (SGLang answers a list for batched input), checked: a dict
    whose `output_ids` is a list of ints and whose `meta_info`, when present, is an object."""
    if isinstance(data, list):
        if len(data) != 1:
            raise GenerateError(f"expected one answer, got a list of {len(data)}")
        data = data[0]
    if not isinstance(data, dict):
        raise GenerateError(f"the answer is a JSON {type(data).__name__}, not an object")
    ids = data.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        what = "missing" if ids is None else f"a {type(ids).__name__}" if not isinstance(ids, list) else "not all ints"
        raise GenerateError(f"`output_ids` is {what}")
    meta = data.get("meta_info", {})
    if not isinstance(meta, dict):
        raise GenerateError(f"`meta_info` is a JSON {type(meta).__name__}, not an object")
    return {**data, "meta_info": meta}


def guarded(gate: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A gate that raises is a failed gate, with the exception as its evidence: never an exception
    that leaves the stage unjudged."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                verdict = GateVerdict(gate, "fail", f"the gate could not judge the server's answers: "
                                      f"{type(exc).__name__}: {exc}", time.monotonic() - started,
                                      {"exception": traceback.format_exc(limit=6)[-3000:]})
                return (verdict, None) if gate == "canary" else verdict

        return run

    return wrap


# ----------------------------------------------------------------------------- server facts


def server_info(client: ServerClient, deadline: Deadline | None = None) -> dict[str, Any]:
    """/server_info (0.5.x) and /get_server_info (older); both probed, both kept as evidence."""
    answers = {}
    for path in ("/server_info", "/get_server_info"):
        status, body = client.get(path, deadline.left(client.timeout_s) if deadline else None)
        answers[path] = {"status": status, "body": body if status == 200 else str(body)[:300]}
    chosen = next((a["body"] for a in answers.values() if a["status"] == 200 and isinstance(a["body"], dict)), None)
    return {"info": chosen, "probes": answers}


def first_internal_state(info: dict[str, Any] | None) -> dict[str, Any]:
    """internal_states[0] of /server_info when it is an object, else {}."""
    states = (info or {}).get("internal_states")
    return states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}


def ddtree_stats(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """The payload worker's `ddtree` stats dict from internal_states[0], or None."""
    stats = first_internal_state(info).get("ddtree")
    return stats if isinstance(stats, dict) else None


def context_limit(info: dict[str, Any] | None) -> int | None:
    for key in ("max_req_input_len", "context_length", "context_len", "max_context_length"):
        value = (info or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


# ----------------------------------------------------------------------------- canary


@dataclass
class CanaryPrompt:
    name: str
    phase: str  # requests of one phase are sent at once; phases run in order
    max_new_tokens: int
    text: str | None = None
    input_ids: list[int] | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"sampling_params": {"temperature": 0.0, "max_new_tokens": self.max_new_tokens}}
        if self.input_ids is not None:
            body["input_ids"] = self.input_ids
        else:
            body["text"] = self.text
        return body


def load_prompt_file(path: Path) -> list[CanaryPrompt]:
    """Operator prompts: JSON lines {"text": ..., "max_new_tokens": N} (or "input_ids")."""
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror}", code="prompts_unreadable") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            text, ids = item.get("text"), item.get("input_ids")
            if not (isinstance(text, str) or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))):
                raise ValueError("needs `text` or `input_ids`")
            prompts.append(CanaryPrompt(f"operator-{number}", "operator", int(item.get("max_new_tokens", 64)),
                                        text if isinstance(text, str) else None, ids))
        except (ValueError, TypeError, AttributeError) as exc:
            raise UsageError(f"{path}:{number}: {exc}", hint='one JSON object a line: {"text": "...", '
                             '"max_new_tokens": 64}', code="prompts_invalid") from None
    return prompts


def default_prompts() -> list[CanaryPrompt]:
    """The prompt set before it meets a server (the near-context prompt needs the server's limit)."""
    prompts = [CanaryPrompt(f"concurrent-{i}", "concurrent", CONCURRENT_TOKENS, text)
               for i, text in enumerate(CONCURRENT_PROMPTS)]
    prompts.append(CanaryPrompt("long-generation", "long", LONG_TOKENS, "Write a long, detailed story about a "
                                "lighthouse keeper who finds a message in a bottle."))
    for round_ in (1, 2):  # round 2 is served from the radix cache filled by round 1
        prompts += [CanaryPrompt(f"shared-prefix-{i}-round-{round_}", f"shared-{round_}", SHARED_TOKENS,
                                 SHARED_PREFIX + suffix) for i, suffix in enumerate(SHARED_SUFFIXES)]
    return prompts


def near_context_prompt(limit: int | None, token_ids: Sequence[int]) -> tuple[CanaryPrompt | None, str]:
    """A prompt that ends a few tokens before the server's context limit, made of token ids the
    server itself produced (so they exist in its vocabulary)."""
    if limit is None:
        return None, "context length not reported by /server_info: near-context prompt skipped"
    if not token_ids:
        return None, "no token ids to build the near-context prompt from"
    length = max(1, limit - NEAR_CONTEXT_TOKENS - 8)
    ids = [int(token_ids[i % len(token_ids)]) for i in range(length)]
    return CanaryPrompt("near-context", "near-context", NEAR_CONTEXT_TOKENS, input_ids=ids), f"prompt of {length} tokens"


@dataclass
class CanaryRun:
    outputs: dict[str, list[int]]
    meta: dict[str, dict[str, Any]]
    errors: dict[str, str]
    seconds: float

    def merge(self, other: CanaryRun) -> None:
        self.outputs.update(other.outputs)
        self.meta.update(other.meta)
        self.errors.update(other.errors)
        self.seconds += other.seconds

    def tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs.values())

    def accept_length(self) -> float | None:
        """Mean accepted tokens per verify step over the run (weighted by verify steps)."""
        num = den = 0.0
        plain = []
        for m in self.meta.values():
            length, steps = m.get("spec_accept_length"), m.get("spec_verify_ct")
            if isinstance(length, int | float) and not isinstance(length, bool):
                plain.append(float(length))
                if isinstance(steps, int | float) and steps > 0:
                    num += float(length) * steps
                    den += steps
        if den:
            return round(num / den, 4)
        return round(sum(plain) / len(plain), 4) if plain else None


def run_canary(client: ServerClient, prompts: Sequence[CanaryPrompt], *, timeout_s: float | None = None,
               deadline: Deadline | None = None) -> CanaryRun:
    """Phases in order, each phase's requests at once; each request bounded by timeout_s and by what
    is left of the gate's deadline (prompts not sent before it are errors)."""
    started = time.monotonic()
    outputs: dict[str, list[int]] = {}
    meta: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    phases: dict[str, list[CanaryPrompt]] = {}
    for p in prompts:
        phases.setdefault(p.phase, []).append(p)
    for phase in phases.values():
        cap = client.timeout_s if timeout_s is None else timeout_s
        bound = deadline.left(cap) if deadline else cap
        if bound <= 0:
            errors.update({p.name: "not sent: the gate's deadline had passed" for p in phase})
            continue
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(phase))) as pool:
            futures = {p.name: pool.submit(client.generate, p.body(), bound) for p in phase}
            for name, fut in futures.items():
                try:
                    answer = fut.result()
                    outputs[name] = list(answer["output_ids"])
                    m = answer["meta_info"]
                    meta[name] = {k: m.get(k) for k in ("spec_accept_length", "spec_verify_ct", "completion_tokens",
                                                        "prompt_tokens", "finish_reason")}
                except GenerateError as exc:
                    errors[name] = str(exc)
    return CanaryRun(outputs, meta, errors, time.monotonic() - started)


def build_baseline(client: ServerClient, extra: Sequence[CanaryPrompt] = (), *,
                   deadline: Deadline | None = None) -> tuple[list[CanaryPrompt], CanaryRun, dict]:
    """Fix the prompt set against the running server and record its greedy outputs."""
    prompts = default_prompts() + list(extra)
    info = server_info(client, deadline)["info"]
    first = run_canary(client, prompts, deadline=deadline)
    seed_ids = next((ids for ids in first.outputs.values() if ids), [])
    near, note = near_context_prompt(context_limit(info), seed_ids)
    notes = {"near_context": note}
    if near is not None:
        prompts.append(near)
        first.merge(run_canary(client, [near], deadline=deadline))
    return prompts, first, notes


def prompts_to_json(prompts: Sequence[CanaryPrompt]) -> list[dict[str, Any]]:
    return [asdict(p) for p in prompts]


def prompts_from_json(items: Sequence[dict[str, Any]]) -> list[CanaryPrompt]:
    return [CanaryPrompt(**item) for item in items]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- gates


def ready_verdict(answer: dict[str, Any]) -> GateVerdict:
    """The agent's unit_wait answer as a verdict."""
    evidence = {k: answer.get(k) for k in ("polls", "unit", "notes", "last_http", "last_error", "journal")
                if answer.get(k) is not None}
    if answer.get("ready"):
        return GateVerdict("ready", "pass", "/health_generate answered 200 while the unit stayed active",
                           float(answer.get("seconds") or 0), evidence)
    return GateVerdict("ready", "fail", str(answer.get("reason")), float(answer.get("seconds") or 0), evidence)


@guarded("settings")
def settings_gate(client: ServerClient, expect: dict[str, Any], *, deadline: Deadline | None = None) -> GateVerdict:
    """/server_info reports what the unit asked for: DFLASH, the DDTree mode, budget, cap and keep-chain
    (the last also from the DDTree worker's own stats)."""
    started = time.monotonic()
    probed = server_info(client, deadline)
    info = probed["info"]
    evidence: dict[str, Any] = {"expected": expect, "probes": {p: a["status"] for p, a in probed["probes"].items()}}
    if info is None:
        return GateVerdict("settings", "inconclusive", "neither /server_info nor /get_server_info answered",
                           time.monotonic() - started, {**evidence, "answers": probed["probes"]})
    reported = {k: info.get(k) for k in expect}
    stats = ddtree_stats(info)
    evidence.update(reported=reported, ddtree=stats)
    wrong = [f"{k}={reported[k]!r} (want {v!r})" for k, v in expect.items() if reported[k] != v]
    if wrong:
        return GateVerdict("settings", "fail", "server reports " + ", ".join(wrong), time.monotonic() - started,
                           evidence)
    mode = expect.get("speculative_ddtree_mode")
    if mode in ("shadow-linear", "full"):
        if stats is None:
            return GateVerdict("settings", "inconclusive", "internal_states[0] has no `ddtree` stats: cannot tell "
                               "that the DDTree worker runs", time.monotonic() - started, evidence)
        if stats.get("mode") != mode:
            return GateVerdict("settings", "fail", f"the DDTree worker runs mode {stats.get('mode')!r}, not {mode!r}",
                               time.monotonic() - started, evidence)
        if expect.get("speculative_ddtree_keep_chain") and stats.get("keep_chain") is not True:
            return GateVerdict("settings", "fail", f"the DDTree worker reports keep_chain={stats.get('keep_chain')!r}, "
                               "not True", time.monotonic() - started, evidence)
    return GateVerdict("settings", "pass", "server reports " + ", ".join(f"{k}={v!r}" for k, v in expect.items()),
                       time.monotonic() - started, evidence)


def compare_canary(baseline: dict[str, list[int]], run: CanaryRun) -> tuple[list[dict[str, Any]], list[str]]:
    """Per prompt: identical or the first differing position; plus prompts that failed to run."""
    rows, failed = [], sorted(run.errors)
    for name, want in baseline.items():
        got = run.outputs.get(name)
        if got is None:
            rows.append({"prompt": name, "identical": False, "first_difference": None,
                         "error": run.errors.get(name, "no answer")})
            continue
        diff = first_difference(want, got)
        row: dict[str, Any] = {"prompt": name, "identical": diff is None, "tokens": len(got)}
        if diff is not None:
            row.update(first_difference=diff, want=want[diff:diff + 4], got=got[diff:diff + 4])
        rows.append(row)
    return rows, failed


@guarded("canary")
def canary_gate(client: ServerClient, prompts: Sequence[CanaryPrompt], baseline: dict[str, list[int]],
                *, timeout_s: float | None = None,
                deadline: Deadline | None = None) -> tuple[GateVerdict, CanaryRun | None]:
    """Greedy outputs token-identical to the baseline, prompt by prompt, over at least
    MIN_CANARY_TOKENS compared tokens."""
    run = run_canary(client, prompts, timeout_s=timeout_s, deadline=deadline)
    rows, failed = compare_canary(baseline, run)
    differing = [r for r in rows if not r["identical"]]
    compared = sum(r.get("tokens", 0) for r in rows if r["identical"])
    evidence = {"prompts": len(prompts), "compared_tokens": compared, "comparison": rows, "errors": run.errors,
                "accept_length": run.accept_length()}
    if differing:
        names = ", ".join(f"{r['prompt']}@{r.get('first_difference')}" for r in differing[:6])
        reason = (f"{len(differing)} of {len(rows)} prompts differ from the baseline (first differing position: "
                  f"{names})") if not failed else f"{len(failed)} canary requests failed: {run.errors[failed[0]]}"
        return GateVerdict("canary", "fail", reason, run.seconds, evidence), run
    if compared < MIN_CANARY_TOKENS:
        return GateVerdict("canary", "inconclusive", f"only {compared} tokens compared over {len(rows)} prompts "
                           f"(minimum {MIN_CANARY_TOKENS}): too little to judge", run.seconds, evidence), run
    return GateVerdict("canary", "pass", f"{len(rows)} prompts token-identical to the baseline ({compared} tokens)",
                       run.seconds, evidence), run


@guarded("liveness")
def liveness_gate(client: ServerClient, *, bound_s: float = DEFAULT_LIVENESS_BOUND_S, requests: int = 3) -> GateVerdict:
    """Greedy and sampled requests at once must all finish within bound_s (upstream DFLASH
    0.5.13.post1 was seen to stall on exactly this mix)."""
    bodies = []
    for i in range(requests):
        text = f"Count from {i * 10} upwards, one number a line:"
        bodies.append(("greedy", {"text": text, "sampling_params": {"temperature": 0.0,
                                                                     "max_new_tokens": LIVENESS_TOKENS}}))
        bodies.append(("sampled", {"text": text, "sampling_params": {"temperature": 0.8, "top_p": 0.95,
                                                                      "max_new_tokens": LIVENESS_TOKENS}}))
    started = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(bodies))
    futures = [pool.submit(client.generate, body, bound_s) for _, body in bodies]
    done, not_done = concurrent.futures.wait(futures, timeout=bound_s)
    pool.shutdown(wait=False, cancel_futures=True)
    seconds = time.monotonic() - started
    errors = []
    for (kind, _), fut in zip(bodies, futures, strict=True):
        if fut in done and fut.exception() is not None:
            errors.append(f"{kind}: {fut.exception()}")
    evidence = {"requests": len(bodies), "mix": "greedy + sampled (temperature 0.8)", "bound_s": bound_s,
                "finished": len(done) - len(errors), "unfinished": len(not_done), "errors": errors[:6]}
    if not_done or errors:
        what = f"{len(not_done)} of {len(bodies)} requests did not finish within {bound_s:.0f}s" if not_done \
            else f"{len(errors)} requests failed: {errors[0]}"
        return GateVerdict("liveness", "fail", what, seconds, evidence)
    return GateVerdict("liveness", "pass", f"{len(bodies)} mixed greedy/sampled requests finished in {seconds:.1f}s",
                       seconds, evidence)



def _auto_acceptance(stats: dict[str, Any], accept: float, shadow_accept: float, need: float, margin: float,
                     seconds: float, evidence: dict[str, Any]) -> GateVerdict:
    """`--speculative-ddtree-budget auto` trades acceptance for speed by the batch, so the canary's own accept
    length may sit at the chain's where a tree does not pay. What must hold: its largest tree accepts more
    than linear DFLASH (the server's acceptance-by-budget curve, 1 + accepted draft tokens per step), and the
    canary accepts no less than shadow-linear beyond the margin (auto never picks a candidate that accepts
    less for the same cost)."""
    auto = stats.get("auto") if isinstance(stats.get("auto"), dict) else {}
    curve = auto.get("accepted_by_budget") if isinstance(auto.get("accepted_by_budget"), dict) else {}
    trees = {k: v for k, v in curve.items() if k != "chain" and isinstance(v, int | float) and not isinstance(v, bool)}
    if not trees:
        return GateVerdict("acceptance", "inconclusive", "auto reports no acceptance by budget "
                           "(internal_states[0].ddtree.auto.accepted_by_budget)", seconds, evidence)
    largest = max(trees, key=lambda k: int(k))
    tree_accept = 1.0 + float(trees[largest])
    floor = shadow_accept * (1 - margin)
    if tree_accept < need:
        return GateVerdict("acceptance", "fail", f"auto's largest tree (budget {largest}) accepts {tree_accept:.3f} < "
                           f"shadow-linear {shadow_accept:.3f} × (1 + {margin:g}) = {need:.3f}", seconds, evidence)
    if accept < floor:
        return GateVerdict("acceptance", "fail", f"accept length {accept:.3f} < shadow-linear {shadow_accept:.3f} × "
                           f"(1 - {margin:g}) = {floor:.3f}: auto chose candidates that accept less", seconds, evidence)
    return GateVerdict("acceptance", "pass", f"auto: budget {largest} accepts {tree_accept:.3f} ≥ {need:.3f}; the "
                       f"canary {accept:.3f} ≥ {floor:.3f} (steps by budget {auto.get('verified')})", seconds, evidence)


@guarded("acceptance")
def acceptance_gate(client: ServerClient, run: CanaryRun, shadow_accept: float | None, margin: float, *,
                    deadline: Deadline | None = None) -> GateVerdict:
    """Full mode pays off: mean spec_accept_length over the canary ≥ shadow-linear's × (1 + margin),
    and the payload's stats show tree steps (tree verify really ran)."""
    started = time.monotonic()
    info = server_info(client, deadline)["info"]
    stats = ddtree_stats(info)
    accept = run.accept_length()
    evidence = {"accept_length": accept, "shadow_linear_accept_length": shadow_accept, "margin": margin,
                "ddtree": stats, "avg_spec_accept_length": first_internal_state(info).get("avg_spec_accept_length")}
    seconds = time.monotonic() - started
    if accept is None or shadow_accept is None:
        missing = "this run's spec_accept_length" if accept is None else "the recorded shadow-linear accept length"
        return GateVerdict("acceptance", "inconclusive", f"{missing} is missing", seconds, evidence)
    if stats is None or not isinstance(stats.get("tree_steps"), int) or isinstance(stats.get("tree_steps"), bool):
        return GateVerdict("acceptance", "inconclusive", "no `ddtree` tree_steps in internal_states[0]", seconds,
                           evidence)
    if stats["tree_steps"] <= 0:
        return GateVerdict("acceptance", "fail", f"tree verify never ran (tree_steps 0, fallback_steps "
                           f"{stats.get('fallback_steps')})", seconds, evidence)
    need = shadow_accept * (1 + margin)
    if stats.get("budget") == "auto":
        return _auto_acceptance(stats, accept, shadow_accept, need, margin, seconds, evidence)
    if accept < need:
        return GateVerdict("acceptance", "fail", f"accept length {accept:.3f} < shadow-linear {shadow_accept:.3f} × "
                           f"(1 + {margin:g}) = {need:.3f}", seconds, evidence)
    return GateVerdict("acceptance", "pass", f"accept length {accept:.3f} ≥ {need:.3f} (shadow-linear "
                       f"{shadow_accept:.3f} × (1 + {margin:g})); {stats['tree_steps']} tree steps", seconds, evidence)
