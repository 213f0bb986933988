"""promote, control side: stages (off → shadow-linear → full), batches with a failure budget, the gates
of each host, and the automatic rollback of a host whose gate fails. Also the unit-aware rollback.

Per host, under the host lock (one SSH connection, the server reached through an SSH tunnel):

    unit_inspect (read-only: installed unit, service, release, record, lint; the whole --dry-run)
    lock → baseline (canary on the service as it runs now, or the recorded shadow-linear canary)
         → unit_apply (lint, back up, journal, write, daemon-reload, restart)
         → gates: ready, settings, canary, liveness, acceptance (full)
         → all pass: unit_commit          any fail: unit_restore (journal) → ready → canary again
    unlock (finally)

A host with no unit at all (`unit_kind: unit`) first gets the `off` stage (plain DFLASH) as its
baseline, gated like any stage, and says so. Fleet order: the canary group (or the first batch)
alone, then the `--batch` sizes with Ansible `serial` semantics; the rollout stops after a batch
once more hosts failed than `--max-fail` allows; hosts not reached are untouched and listed.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_ops import gates, service
from ddtree_ops.errors import ErrorInfo, OpsError, UsageError
from ddtree_ops.fleet import (
    DEFAULT_CONCURRENCY,
    FleetInterrupted,
    FleetProgress,
    HostContext,
    HostInterrupted,
    HostResult,
    run_on_hosts,
)
from ddtree_ops.release import _call, _host_lock, _session, operator_name

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig, Inventory
    from ddtree_ops.lease import HostLease
    from ddtree_ops.ssh import HostSession

DEFAULT_BATCH = "1,25%,100%"
# Test hook: the CLI SIGKILLs itself at this point of a promote (the crash tests' knife):
# after_install, during_gates, before_commit or after_commit.
KILL_ENV = "DDTREE_OPS_TEST_KILL_PROMOTE_AT"
HOLD_ENV = "DDTREE_OPS_TEST_HOLD_PROMOTE_AT"
# ...and the agent SIGKILLs itself inside unit_apply or unit_commit at this point (after_backup,
# after_journal, after_watchdog, after_write, after_reload, after_restart; after_evidence, after_state).
AGENT_KILL_ENV = "DDTREE_OPS_TEST_KILL_UNIT_AT"
DEFAULT_EVIDENCE_DIR = Path("evidence")
DEFAULT_PAUSE_S = 600.0
CONFIRM_SLACK_S = 120.0


class PromoteFailed(OpsError):
    """A host was refused, or failed a gate (and was rolled back); detail carries the evidence."""

    def __init__(self, message: str, *, code: str, hint: str | None = None, detail: dict | None = None) -> None:
        super().__init__(message, hint=hint, code=code)
        self.detail = detail or {}


# ----------------------------------------------------------------------------- fleet order


@dataclass(frozen=True)
class FailBudget:
    """--max-fail N or P%: the rollout stops once more hosts failed than this allows."""

    count: int | None = 0
    percent: float | None = None

    @classmethod
    def parse(cls, spec: str) -> FailBudget:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%?)\s*", spec or "")
        if not m or (not m.group(2) and "." in m.group(1)):
            raise UsageError(f"--max-fail {spec!r} is not N or P%", hint="e.g. --max-fail 0, 2 or 10%",
                             code="bad_max_fail")
        value = float(m.group(1))
        if m.group(2):
            if value > 100:
                raise UsageError("--max-fail percentage above 100", code="bad_max_fail")
            return cls(None, value)
        return cls(int(value), None)

    def allowed(self, total: int) -> int:
        return self.count if self.count is not None else math.floor(total * (self.percent or 0) / 100)

    def exceeded(self, failed: int, total: int) -> bool:
        return failed > self.allowed(total)


def parse_batches(spec: str) -> list[int | float]:
    """`1,25%,100%` → [1, 25.0%...]: ints are host counts, floats are percentages."""
    sizes: list[int | float] = []
    for part in (p.strip() for p in (spec or "").split(",")):
        m = re.fullmatch(r"(\d+)(%?)", part)
        if not m or int(m.group(1)) == 0 or (m.group(2) and int(m.group(1)) > 100):
            raise UsageError(f"--batch {spec!r}: {part!r} is not a host count or a percentage (1..100%)",
                             hint="e.g. --batch 1,25%,100%", code="bad_batch")
        sizes.append(float(m.group(1)) if m.group(2) else int(m.group(1)))
    return sizes


def serial_batches(hosts: Sequence[HostConfig], sizes: Sequence[int | float]) -> list[list[HostConfig]]:
    """Ansible `serial`: each size is a count or a percentage of all hosts (at least 1); the last
    size repeats until every host is in a batch."""
    batches, i, k = [], 0, 0
    while i < len(hosts):
        size = sizes[min(k, len(sizes) - 1)]
        n = max(1, int(len(hosts) * size / 100)) if isinstance(size, float) else size
        batches.append(list(hosts[i:i + n]))
        i, k = i + n, k + 1
    return batches


def plan_batches(hosts: Sequence[HostConfig], spec: str = DEFAULT_BATCH) -> list[list[HostConfig]]:
    """The canary first, alone: hosts of the `canary` group (or `canary: true`), else the first
    batch of --batch; then the rest in --batch batches."""
    sizes = parse_batches(spec)
    canary = [h for h in hosts if h.canary or "canary" in h.groups]
    if not canary:
        return serial_batches(hosts, sizes)
    rest = [h for h in hosts if h not in canary]
    return [canary, *serial_batches(rest, sizes)] if rest else [canary]


# ----------------------------------------------------------------------------- options, timing


@dataclass
class PromoteOptions:
    mode: str
    dry_run: bool = False
    force: bool = False
    on_inconclusive: str = "fail"  # or "pause": keep the host as it is and stop the rollout
    prompts: list[gates.CanaryPrompt] = field(default_factory=list)
    liveness_bound_s: float = gates.DEFAULT_LIVENESS_BOUND_S
    request_timeout_s: float = gates.DEFAULT_REQUEST_TIMEOUT_S
    evidence_dir: Path = DEFAULT_EVIDENCE_DIR
    run_id: str = ""
    operator: str = ""
    lock_wait_s: float = 0.0
    start_timeout_s: float | None = None  # default: the host's start_timeout_s
    gate_timeout_s: float = gates.DEFAULT_GATE_TIMEOUT_S  # wall-clock bound of each gate but ready and liveness
    pause_for_s: float = DEFAULT_PAUSE_S  # --on-inconclusive pause: how long the stage stays for inspection
    adopt: bool = False  # replace a unit changed by hand since ddtree-ops installed it (kept as found)

    def __post_init__(self) -> None:
        if self.mode not in service.DDTREE_MODES:
            raise UsageError(f"--mode {self.mode!r}: promote takes shadow-linear or full", code="bad_mode")
        if self.on_inconclusive not in ("fail", "pause"):
            raise UsageError("--on-inconclusive takes fail or pause", code="bad_option")
        self.run_id = self.run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.operator = self.operator or operator_name()


@dataclass
class Clock:
    """Wall time of one host, split into the tool's own time and time waiting for the service."""

    started: float = field(default_factory=time.monotonic)
    wait_s: float = 0.0

    def report(self, client: gates.ServerClient | None) -> dict[str, float]:
        total = time.monotonic() - self.started
        wait = self.wait_s + (client.wait_s if client else 0.0)
        return {"total_s": round(total, 2), "waiting_for_service_s": round(wait, 2),
                "tool_s": round(max(0.0, total - wait), 2)}


def _kill_point(name: str) -> None:
    """The crash tests' knife (KILL_ENV), and their pause (HOLD_ENV=point:FILE: FILE.reached appears,
    then the run waits until FILE.go exists), so a test can act on the host while a run is mid-stage."""
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    point, _, path = os.environ.get(HOLD_ENV, "").partition(":")
    if point == name and path:
        Path(path + ".reached").touch()
        while not Path(path + ".go").exists():
            time.sleep(0.1)


# ----------------------------------------------------------------------------- per host


def expected_settings(host: HostConfig, mode: str) -> dict[str, Any]:
    expect: dict[str, Any] = {}
    if host.draft_model_path is not None:
        expect["speculative_algorithm"] = "DFLASH"
    if mode in service.DDTREE_MODES:
        expect["speculative_ddtree_mode"] = mode
        expect["speculative_ddtree_budget"] = host.ddtree_budget or host.draft_block_size - 1
        if host.ddtree_budget == "auto":
            expect["speculative_ddtree_budget_max"] = host.ddtree_budget_max or service.AUTO_MAX_BUDGET
        if host.ddtree_topk_cap is not None:
            expect["speculative_ddtree_topk_cap"] = host.ddtree_topk_cap
        if host.ddtree_keep_chain:
            expect["speculative_ddtree_keep_chain"] = True
    return expect


def gate_plan(host: HostConfig, mode: str, start_timeout_s: float) -> list[str]:
    plan = [f"ready: /health_generate 200 within {start_timeout_s:.0f}s while {host.service} stays active",
            "settings: /server_info (and /get_server_info) report " +
            ", ".join(f"{k}={v}" for k, v in expected_settings(host, mode).items()),
            "canary: greedy outputs token-identical to the baseline (concurrent, near-context, long, "
            "shared prefix twice)",
            "liveness: greedy + sampled requests at once all finish within the bound"]
    if mode == "full":
        plan.append(f"acceptance: mean spec_accept_length ≥ shadow-linear × (1 + {host.acceptance_margin:g}); "
                    "ddtree tree_steps > 0")
    return plan


def shadow_pass(info: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The host's recorded shadow-linear pass, when it was made on the release installed now (release id
    and bundle sha256); else (None, why it does not count)."""
    passed = (info["promotion"].get("passed") or {}).get("shadow-linear")
    if not passed:
        return None, "no shadow-linear pass is recorded on this host"
    release = info["release"]
    if passed.get("release") != release.get("current") or passed.get("bundle_sha256") != release.get("bundle_sha256"):
        return None, (f"the recorded shadow-linear pass ran on release {passed.get('release')} (bundle "
                      f"{str(passed.get('bundle_sha256'))[:12]}), the host now runs {release.get('current')} (bundle "
                      f"{str(release.get('bundle_sha256'))[:12]})")
    return passed, None


def _payload_verdict(check: dict[str, Any] | None, mode: str, ctx_notes: list[str], *, code: str,
                     hint: str) -> list[dict[str, str]]:
    """The installed payload's own verdict on serving `mode` for the target (agent units.*_mode_check)."""
    check = check or {}
    if not check.get("checked", True):
        ctx_notes.append(f"{mode} not checked against the target before the change ({check.get('reason')}); "
                         "the server's own refusal at start is the backstop")
    return [{"code": code, "message": check["refusal"], "hint": hint}] if check.get("refusal") else []


def _refusals(host: HostConfig, opts: PromoteOptions, info: dict[str, Any],
              ctx_notes: list[str]) -> list[dict[str, str]]:
    """Why this host must not be promoted, found before any change (notes: what could not be checked)."""
    out = []
    stale = info["release"].get("stale")
    if stale:  # SGLang was changed under the release (agent stale.py): its files are another version's
        out.append({"code": "stale_base", "message": stale["message"], "hint": stale["hint"]})
    if not info["release"]["ddtree_payload"]:
        out.append({"code": "not_ddtree_payload",
                    "message": f"the installed release ({info['release']['current'] or 'pristine sglang'}) is not "
                               "a DDTree payload", "hint": "push the DDTree bundle first: ddtree-ops push"})
    if opts.mode == "full":
        passed, why = shadow_pass(info)
        if not passed and not opts.force:
            out.append({"code": "shadow_linear_not_passed",
                        "message": f"full needs a passed shadow-linear stage on this host's current release ({why})",
                        "hint": "run promote --mode shadow-linear first (or --force to take the baseline "
                                "from the service as it runs now)"})
        out += _payload_verdict(info.get("full_mode"), opts.mode, ctx_notes, code="full_mode_refused",
                                hint="use --mode shadow-linear on this target")
    if opts.mode == "shadow-linear":
        out += _payload_verdict(info.get("shadow_mode"), opts.mode, ctx_notes, code="shadow_linear_refused",
                                hint="add --disable-radix-cache to the host's extra_args in the inventory")
    if info.get("drift") and not opts.adopt:
        out.append({"code": "unit_drift", "message": "changed by hand since ddtree-ops installed it: "
                    + ", ".join(info["drift"]), "hint": "inspect the change; promote --adopt replaces it (and keeps "
                    "what it found)"})
    lint = info.get("lint") or {}
    if lint and not lint.get("ok"):
        out.append({"code": "unit_lint_failed", "message": "the rendered unit fails systemd-analyze verify: "
                    + " | ".join(lint.get("warnings", [])[:5]), "hint": "nothing was installed"})
    return out


@dataclass
class _HostRun:
    """What one host's promote carries between its steps."""

    ctx: HostContext
    session: HostSession
    opts: PromoteOptions
    secrets: tuple[str, ...]
    lease: HostLease | None = None
    clock: Clock = field(default_factory=Clock)
    client: gates.ServerClient | None = None

    @property
    def host(self) -> HostConfig:
        return self.ctx.host

    @property
    def lock_id(self) -> str:
        assert self.lease is not None
        return self.lease.lock_id

    def start_timeout(self) -> float:
        return float(self.opts.start_timeout_s or self.host.start_timeout_s)

    def confirm_hard_s(self) -> float:
        """A stage's whole life: the old process's stop, the new one's start, every gate's bound."""
        return (self.host.stop_timeout_s + self.start_timeout() + 3 * self.opts.gate_timeout_s
                + self.opts.liveness_bound_s + CONFIRM_SLACK_S)

    def deadline(self) -> gates.Deadline:
        return gates.Deadline(self.opts.gate_timeout_s)

    def check_held(self) -> None:
        """Between gates: stop when the run is interrupted (the stage is then undone at once), and when
        the host says this run's lock or stage is gone."""
        self.ctx.checkpoint()
        if self.lease is not None and self.lease.lost:
            raise PromoteFailed(f"{self.host.name}: {self.lease.lost}", code="lease_lost",
                                hint="see `ddtree-ops status`; re-run promote")

    def wait_ready(self, *, since: float | None = None, restart: dict[str, Any] | None = None,
                   start_if_inactive: bool = False) -> gates.GateVerdict:
        self.ctx.step("waiting for the service")
        answer = service.wait_ready(self.session, self.host, timeout_s=self.start_timeout(), since=since,
                                    after_invocation=(restart or {}).get("invocation_before"),
                                    start_if_inactive=start_if_inactive)
        self.clock.wait_s += float(answer.get("seconds") or 0)
        for note in answer.get("notes") or []:
            self.ctx.notice(note)
        return gates.ready_verdict(answer)

    def redact(self, value: Any) -> Any:
        return service.redact(value, self.secrets)


def _prompt_key(p: gates.CanaryPrompt) -> tuple[Any, ...]:
    return (p.text, tuple(p.input_ids or ()), p.max_new_tokens)


def _serving_as_is(run: _HostRun) -> None:
    """The service as it runs now answers (started as it is if it was stopped): nothing changed yet."""
    ready = run.wait_ready(start_if_inactive=True)
    if not ready.passed:
        raise PromoteFailed(f"{run.host.name}: baseline: {run.host.service} does not serve as it is now: "
                            f"{ready.reason}", code="baseline_not_ready",
                            hint="nothing was changed; fix the running service first",
                            detail=run.redact({"gate": ready.to_dict()}))


def _baseline(run: _HostRun, info: dict[str, Any]) -> dict[str, Any]:
    """The outputs the new stage must reproduce: full → the shadow-linear canary recorded on this release,
    plus the operator's prompts it does not hold, run on the service as it runs now; otherwise (or full
    with --force and no such record) the canary on the service as it runs now."""
    assert run.client is not None
    record = info.get("shadow_linear_canary") if run.opts.mode == "full" and shadow_pass(info)[0] else None
    if isinstance(record, dict) and record.get("outputs"):
        prompts = gates.prompts_from_json(record["prompts"])
        canary = gates.CanaryRun(dict(record["outputs"]), {}, {}, 0.0)
        recorded = {_prompt_key(p) for p in prompts}
        extra = [replace(p, name=f"{p.name}-now") for p in run.opts.prompts if _prompt_key(p) not in recorded]
        source = "recorded shadow-linear canary"
        if extra:
            _serving_as_is(run)
            run.ctx.step("baseline: operator prompts")
            canary.merge(gates.run_canary(run.client, extra, timeout_s=run.opts.request_timeout_s,
                                          deadline=run.deadline()))
            prompts += extra
            source += f" + {len(extra)} operator prompt(s) on the service as it runs now"
        base = {"source": source, "prompts": prompts, "outputs": canary.outputs,
                "accept_length": record.get("accept_length"), "notes": {}}
    else:
        _serving_as_is(run)
        run.ctx.step("baseline canary")
        prompts, canary, notes = gates.build_baseline(run.client, run.opts.prompts, deadline=run.deadline())
        base = {"source": f"service as it ran ({info.get('mode') or 'not promoted'})", "prompts": prompts,
                "outputs": canary.outputs, "accept_length": canary.accept_length(), "notes": notes}
    if canary.errors:
        raise PromoteFailed(f"{run.host.name}: baseline canary failed on the running service: "
                            f"{next(iter(canary.errors.values()))}", code="baseline_failed",
                            hint="nothing was changed", detail=run.redact({"errors": canary.errors}))
    if canary.tokens() < gates.MIN_CANARY_TOKENS:
        raise PromoteFailed(f"{run.host.name}: the baseline canary produced only {canary.tokens()} tokens (minimum "
                            f"{gates.MIN_CANARY_TOKENS}): a comparison with it would judge nothing",
                            code="baseline_too_short", hint="nothing was changed; check the running service, or add "
                            "--prompts with longer generations")
    return base


def _run_gates(run: _HostRun, mode: str, baseline: dict[str, Any] | None, restart: dict[str, Any],
               shadow_accept: float | None) -> tuple[list[gates.GateVerdict], gates.CanaryRun | None]:
    """Gates in order; stops at the first that does not pass. baseline None: the off stage on a host
    that had no unit; it *is* the baseline, so only ready and settings apply to it."""
    assert run.client is not None
    verdicts = [run.wait_ready(since=restart.get("since"), restart=restart)]
    if not verdicts[-1].passed:
        return verdicts, None
    _kill_point("during_gates")
    run.check_held()
    run.ctx.step("gate: settings")
    verdicts.append(gates.settings_gate(run.client, expected_settings(run.host, mode), deadline=run.deadline()))
    if not verdicts[-1].passed or baseline is None:
        return verdicts, None
    run.check_held()
    run.ctx.step("gate: canary")
    verdict, canary = gates.canary_gate(run.client, baseline["prompts"], baseline["outputs"],
                                        timeout_s=run.opts.request_timeout_s, deadline=run.deadline())
    verdicts.append(verdict)
    if not verdict.passed:
        return verdicts, canary
    run.check_held()
    run.ctx.step("gate: liveness")
    verdicts.append(gates.liveness_gate(run.client, bound_s=run.opts.liveness_bound_s))
    if not verdicts[-1].passed or mode != "full":
        return verdicts, canary
    run.check_held()
    run.ctx.step("gate: acceptance")
    assert canary is not None
    verdicts.append(gates.acceptance_gate(run.client, canary, shadow_accept, run.host.acceptance_margin,
                                          deadline=run.deadline()))
    return verdicts, canary


def _write_local_evidence(opts: PromoteOptions, host: str, evidence: dict[str, Any]) -> str:
    path = opts.evidence_dir / opts.run_id / f"{host}-{evidence.get('mode')}.json"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(evidence, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return str(path)


def check_evidence_dir(opts: PromoteOptions) -> Path:
    """Before any host: the run's evidence dir can be written (0700), so that no stage confirms and is
    then reported failed for want of a place to put its evidence."""
    folder = opts.evidence_dir / opts.run_id
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = folder / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write evidence to {folder}: {exc.strerror or exc}",
                         hint="pass --evidence-dir DIR (a directory you can write)", code="evidence_dir_unwritable") \
            from None
    return folder


def _abandon(run: _HostRun, exc: BaseException) -> str:
    """Something other than a gate verdict ended this stage (an error, a lost lease, an interrupt): put
    the previous unit back now if the host still answers; else its watchdog does at the deadline."""
    assert run.lease is not None
    run.lease.follow(None)  # from here the deadline runs out by itself
    try:
        undone = service.restore(run.session, run.host, lock_id=run.lock_id, operator=run.opts.operator,
                                 to="journal", reason=f"promote stopped: {type(exc).__name__}", timeout=60)
        if undone.get("committed"):
            return "the host had confirmed the stage"
        if undone.get("noop"):
            return "nothing of the stage stays installed"
        return "the previous unit was put back"
    except Exception as restore_exc:  # noqa: BLE001 - the watchdog is the backstop, say so
        return (f"putting the previous unit back failed ({type(restore_exc).__name__}: {restore_exc}); the host "
                f"does it by itself within {run.host.confirm_timeout_s}s (its confirm deadline)")


def _settle_lost_commit(run: _HostRun, exc: OpsError, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The commit's answer never came (or came as an error): ask the host how the stage stands. Its
    commit point is one file rename, so it is either confirmed (then this host passed) or not (then
    it is undone here and now, or by its watchdog)."""
    assert run.lease is not None
    run.lease.follow(None)
    try:
        settled = service.restore(run.session, run.host, lock_id=run.lock_id, operator=run.opts.operator,
                                  to="journal", reason="its commit did not answer", timeout=60)
    except OpsError as again:
        raise PromoteFailed(f"{run.host.name}: every gate passed, but the stage could not be confirmed: {exc.message}; "
                            f"and the host could not be asked how it stands ({again.message}): it puts its previous "
                            f"unit back by itself within {run.host.confirm_timeout_s}s unless the commit landed",
                            code="commit_failed", hint="see `ddtree-ops status` once it answers",
                            detail={"gates": summaries}) from None
    if settled.get("committed"):
        run.ctx.notice(f"the commit's answer was lost ({exc.message}), but the host had confirmed the stage")
        return {"evidence": None}
    restart = settled.get("restart") or {}
    back = run.wait_ready(since=restart.get("since"), restart=restart) if restart.get("action") == "restart" else None
    again = "serving its previous unit again" if back is None or back.passed else \
        f"NOT serving after the rollback: {back.reason}"
    raise PromoteFailed(f"{run.host.name}: every gate passed, but the stage could not be confirmed: {exc.message}; "
                        f"rolled back, {again}", code="commit_failed", hint=exc.hint,
                        detail={"gates": summaries, "serving_again": back is None or back.passed})


def _stage(run: _HostRun, info: dict[str, Any], mode: str, baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Install one stage, commit-confirmed; gate it; confirm it, or roll it back. Returns the host's result
    data. Whatever ends this function early, the host ends on its previous unit or the confirmed new one."""
    host, opts = run.host, run.opts
    assert run.client is not None and run.lease is not None
    unit = service.render_unit(host, mode)
    run.ctx.step(f"installing the {mode} unit")
    try:
        applied = service.install(run.session, host, unit, lock_id=run.lock_id, operator=opts.operator,
                                  confirm_hard_s=run.confirm_hard_s(), adopt=opts.adopt,
                                  test_kill=os.environ.get(AGENT_KILL_ENV))
    except OpsError as exc:  # an install that died half-way (a lost connection) goes back at once
        raise PromoteFailed(f"{host.name}: installing the {mode} unit failed: {exc.message}; {_abandon(run, exc)}",
                            code=exc.code, hint=exc.hint, detail=getattr(exc, "detail", None)) from None
    run.lease.follow(applied["unit_id"])
    try:
        return _gate_stage(run, info, mode, baseline, unit, applied)
    except PromoteFailed as exc:
        if exc.code == "lease_lost":
            exc.detail["host_side"] = _abandon(run, exc)
        raise
    except BaseException as exc:
        outcome = _abandon(run, exc)
        if isinstance(exc, HostInterrupted) or not isinstance(exc, Exception):  # the CLI reports interrupts
            run.ctx.notice(f"interrupted during the {mode} stage: {outcome}")
            raise
        raise PromoteFailed(f"{host.name}: the {mode} stage stopped: {type(exc).__name__}: {run.redact(str(exc))}; "
                            f"{outcome}", code="stage_error", hint="rerun with --debug for the traceback",
                            detail={"host_side": outcome}) from exc


def _gate_stage(run: _HostRun, info: dict[str, Any], mode: str, baseline: dict[str, Any] | None,
                unit: service.RenderedUnit, applied: dict[str, Any]) -> dict[str, Any]:
    host, opts = run.host, run.opts
    assert run.lease is not None
    _kill_point("after_install")
    restart = applied["restart"]
    shadow = ((info["promotion"].get("passed") or {}).get("shadow-linear") or {}).get("accept_length")
    verdicts, canary = _run_gates(run, mode, baseline, restart, shadow)
    failed = next((v for v in verdicts if not v.passed), None)
    lint = applied.get("lint") or {}
    accept = canary.accept_length() if canary else None
    summaries = [v.summary() for v in verdicts]
    evidence: dict[str, Any] = {
        "host": host.name, "mode": mode, "run_id": opts.run_id, "operator": opts.operator,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "unit": {"path": unit.paths.unit_path, "kind": unit.paths.kind, "argv": unit.argv,
                 "diff": service.unit_diff(info.get("installed_text"), unit.text, unit.paths.unit_path),
                 "lint_warnings": lint.get("warnings"), "exposure": lint.get("exposure"),
                 "exposure_level": lint.get("exposure_level"), "unit_id": applied["unit_id"],
                 "confirm": applied.get("confirm")},
        "baseline": {k: v for k, v in (baseline or {}).items() if k in ("source", "accept_length", "notes")},
        "gates": [v.to_dict() for v in verdicts], "accept_length": accept,
    }
    pause = failed is not None and failed.verdict == "inconclusive" and opts.on_inconclusive == "pause"
    if failed is None:
        run.check_held()
        evidence.update(result="passed", timing=run.clock.report(run.client))
        evidence = run.redact(evidence)
        canary_record = None
        if mode == "shadow-linear" and canary is not None and baseline is not None:
            # full's baseline later: the same prompts, and what this stage served for them.
            canary_record = {"mode": mode, "prompts": gates.prompts_to_json(baseline["prompts"]),
                             "outputs": canary.outputs, "accept_length": accept}
        run.ctx.step("recording")
        local = _write_local_evidence(opts, host.name, evidence)  # before the commit: a stage never
        _kill_point("before_commit")                               # confirms without its evidence
        try:
            committed = service.commit(run.session, host, lock_id=run.lock_id, operator=opts.operator,
                                       unit_id=applied["unit_id"], mode=mode,
                                       record={"gates": summaries, "accept_length": accept},
                                       evidence=evidence, canary=canary_record,
                                       test_kill=os.environ.get(AGENT_KILL_ENV))
        except OpsError as exc:
            committed = _settle_lost_commit(run, exc, summaries)
        run.lease.follow(None)
        if run.lease.failures:
            run.ctx.notice(f"{len(run.lease.failures)} heartbeat(s) to the host failed during the stage (last: "
                           f"{run.lease.failures[-1]}); the stage was confirmed in time")
        _kill_point("after_commit")
        try:  # the stage is confirmed: a late evidence problem is a notice, never a failed host
            local = _write_local_evidence(opts, host.name, {**evidence, "host_evidence": committed.get("evidence")})
        except OSError as exc:
            run.ctx.notice(f"stage confirmed; the local evidence {local} was not updated: {exc}")
        return {"mode": mode, "result": "passed", "gates": summaries, "accept_length": accept,
                "exposure": lint.get("exposure"), "evidence": {"host": committed.get("evidence"), "local": local},
                "timing": evidence["timing"], "unit_diff": evidence["unit"]["diff"],
                "confirm": {"window_s": host.confirm_timeout_s, "heartbeats": run.lease.beats,
                            "missed_heartbeats": len(run.lease.failures)}}
    if pause:
        # The stage stays for inspection until a deadline pushed out once, then the host puts the
        # previous unit back by itself: pausing never leaves an unconfirmed unit serving for good.
        answer = run.lease.beat(extend_s=opts.pause_for_s, pause=True)
        run.lease.follow(None)
        evidence.update(result="paused", timing=run.clock.report(run.client))
        local = _write_local_evidence(opts, host.name, run.redact(evidence))
        raise PromoteFailed(f"{host.name}: paused at gate {failed.gate} (inconclusive: {failed.reason}); the "
                            f"{mode} unit stays installed, unconfirmed, for {answer.get('remaining_s')}s, then the host "
                            "puts its previous unit back by itself", code="gate_inconclusive_paused",
                            hint="inspect it now; re-run promote to try again (it undoes this stage first), or "
                                 "rollback to undo it at once",
                            detail={"gate": failed.gate, "evidence": local, "gates": summaries})
    # A gate failed: the host goes back to the unit it had before this stage, and must serve again.
    run.ctx.step(f"gate {failed.gate} failed: rolling back")
    run.lease.follow(None)
    evidence.update(result="rolled-back", failed_gate=failed.gate, reason=failed.reason,
                    summary={"gates": summaries, "failed_gate": failed.gate, "reason": failed.reason})
    restored = service.restore(run.session, host, lock_id=run.lock_id, operator=opts.operator, to="journal",
                               evidence=run.redact(evidence), since=restart.get("since"),
                               reason=f"gate {failed.gate} {failed.verdict}")
    evidence["journal"] = restored.get("journal")
    check: dict[str, Any]
    back_restart = restored.get("restart") or {}
    if back_restart.get("action") == "stop":
        # Nothing ran before this stage (the host had no unit): back to that, nothing to serve.
        check, serving_again = {"stopped": "no unit before this stage: removed again, nothing runs"}, True
        again = "back to no unit, as before"
    else:
        back = run.wait_ready(since=restored.get("since"), restart=back_restart or None)
        check = {"ready": back.to_dict()}
        if back.passed and baseline is not None:
            verdict, _ = gates.canary_gate(run.client, baseline["prompts"], baseline["outputs"],
                                           timeout_s=opts.request_timeout_s, deadline=run.deadline())
            check["canary"] = verdict.to_dict()
        serving_again = back.passed and check.get("canary", {}).get("verdict", "pass") == "pass"
        again = "serving its previous unit again" if serving_again else "NOT serving correctly after the rollback"
    evidence.update(rollback=check, serving_again=serving_again, timing=run.clock.report(run.client))
    try:
        local = _write_local_evidence(opts, host.name, run.redact(evidence))
    except OSError as exc:
        local = f"(not written: {exc})"
    raise PromoteFailed(
        f"{host.name}: gate {failed.gate} {failed.verdict}: {run.redact(failed.reason)}; rolled back, {again}",
        code=f"gate_{failed.gate}_failed",
        hint=f"evidence: {local}" + ("" if serving_again else "; inspect the host now"),
        detail={"gate": failed.gate, "verdict": failed.verdict, "reason": run.redact(failed.reason),
                "evidence": local, "host_evidence": restored.get("evidence"), "serving_again": serving_again,
                "gates": summaries})


def promote_host(ctx: HostContext, inventory: Inventory, opts: PromoteOptions) -> dict[str, Any]:
    from ddtree_ops import tunnel

    host = ctx.host
    unit = service.render_unit(host, opts.mode)
    with _session(ctx, inventory) as session:
        run = _HostRun(ctx, session, opts, unit.secret_values)
        ctx.step("inspect")
        info = service.inspect(session, host, unit, mode=opts.mode, check_mode=True)
        refusals = _refusals(host, opts, info, ctx.notices)
        if opts.dry_run:
            diff = service.unit_diff(info.get("installed_text"), unit.text, unit.paths.unit_path)
            plan = run.redact({
                "dry_run": True, "mode": opts.mode, "unit_path": unit.paths.unit_path, "unit_diff": diff,
                "service": {k: info["service"].get(k) for k in ("LoadState", "ActiveState", "SubState")},
                "current_mode": info.get("mode"), "lint": {k: (info.get("lint") or {}).get(k)
                                                             for k in ("ok", "warnings", "exposure")},
                "gate_plan": gate_plan(host, opts.mode, run.start_timeout()), "refusals": refusals,
                "interrupted": info.get("journal"), "drift": info.get("drift"),
                "first_installs_off_stage": info["service"].get("LoadState") != "loaded"})
            if refusals:  # what a real run would do, with its exit code
                raise PromoteFailed(f"{host.name}: would be refused: " + "; ".join(r["message"] for r in refusals),
                                    code=refusals[0]["code"], hint=refusals[0].get("hint"), detail=plan)
            return plan
        if refusals:
            first = refusals[0]
            raise PromoteFailed(f"{host.name}: " + "; ".join(r["message"] for r in refusals), code=first["code"],
                                hint=first.get("hint"), detail={"refusals": refusals})
        with _host_lock(ctx, session, command=f"promote --mode {opts.mode}", operator=opts.operator,
                        wait_s=opts.lock_wait_s) as lease:
            run.lease = lease
            if info.get("journal"):
                ctx.step("settling an interrupted promote")
                undone = _call(session, "unit_recover", {"state_dir": host.state_dir, "lock_id": lease.lock_id,
                                                         "operator": opts.operator, "adopt": opts.adopt})
                settled = undone.get("recovered") or {}
                ctx.notice(f"{'confirmed' if settled.get('committed') else 'undid'} an interrupted promote "
                           f"({settled.get('mode')})")
                info = service.inspect(session, host, None, mode=opts.mode)
            with tunnel.forward(session, host.serve_host, host.serve_port) as port:
                run.client = gates.ServerClient(f"http://127.0.0.1:{port}", timeout_s=opts.request_timeout_s,
                                                api_key=service.api_key(host))
                try:
                    stages = []
                    if info["service"].get("LoadState") != "loaded":
                        if host.unit_kind == "drop-in":
                            raise PromoteFailed(f"{host.name}: {host.service} does not exist to put a drop-in over",
                                                code="unit_missing", hint="install the service, or set "
                                                "`unit_kind: unit` so promote installs its own")
                        ctx.notice(f"{host.service} did not exist: installed and gated the off stage (plain "
                                   "DFLASH) first, as the baseline")
                        stages.append(_stage(run, info, "off", None))
                        info = service.inspect(session, host, None, mode=opts.mode)
                    baseline = _baseline(run, info)
                    result = _stage(run, info, opts.mode, baseline)
                    result["baseline"] = {k: baseline[k] for k in ("source", "accept_length", "notes")}
                    if stages:
                        result["first_stage"] = stages[0]
                    return run.redact(result)
                finally:
                    run.client.close()


@dataclass
class PromoteReport:
    results: list[HostResult]
    batches: list[list[str]]
    untouched: list[str]
    stopped: str | None

    def extra(self) -> dict[str, Any]:
        return {"batches": self.batches, "untouched": self.untouched, "stopped": self.stopped}


def promote(inventory: Inventory, hosts: Sequence[HostConfig], opts: PromoteOptions, *,
            batch: str = DEFAULT_BATCH, max_fail: str = "0", concurrency: int = DEFAULT_CONCURRENCY,
            progress: FleetProgress | None = None) -> PromoteReport:
    """Promote hosts batch by batch; stop once the failure budget is exceeded (dry runs see all)."""
    if opts.mode == "full" and any(h.allow_hybrid_unsafe for h in hosts):
        raise UsageError("allow_hybrid_unsafe is set in the inventory, but the payload refuses "
                         "--speculative-ddtree-allow-hybrid-unsafe at argument parsing: there is no unsafe "
                         "override; full mode runs on a hybrid target only where its layer type is proven",
                         hint="remove allow_hybrid_unsafe; `promote --mode full --dry-run` shows which hybrid "
                              "targets the payload refuses (promote those to shadow-linear)",
                         code="hybrid_unsafe_unsupported")
    for h in hosts:  # inventory-level mistakes stop the whole run before any host is touched
        service.render_unit(h, opts.mode)
    if not opts.dry_run:
        check_evidence_dir(opts)
    budget = FailBudget.parse(max_fail)
    batches = plan_batches(hosts, batch)
    results: list[HostResult] = []
    failed = 0
    stopped = None
    done: set[str] = set()
    for i, group in enumerate(batches):
        try:
            results += run_on_hosts(group, lambda ctx: promote_host(ctx, inventory, opts), concurrency=concurrency,
                                    progress=progress)
        except FleetInterrupted as exc:  # Ctrl-C: report the batches before too, and the ones never reached
            later = [HostResult(h.name, "interrupted", error=ErrorInfo("interrupted", f"{h.name}: not reached "
                                                                       "(interrupted before its batch)"))
                     for b in batches[i + 1:] for h in b]
            raise FleetInterrupted(results + exc.results + later) from None
        done.update(h.name for h in group)
        failed = sum(not r.ok for r in results)
        if not opts.dry_run and budget.exceeded(failed, len(hosts)) and i + 1 < len(batches):
            stopped = (f"{failed} host(s) failed, more than --max-fail allows ({budget.allowed(len(hosts))}); "
                       f"stopped after batch {i + 1} of {len(batches)}")
            break
    untouched = [h.name for h in hosts if h.name not in done]
    return PromoteReport(results, [[h.name for h in b] for b in batches], untouched, stopped)


# ----------------------------------------------------------------------------- rollback with units


def rollback_host(ctx: HostContext, inventory: Inventory, *, to: str = "previous", adopt: bool = False,
                  lock_wait_s: float = 0.0, operator: str | None = None, forget_stale: bool = False) -> dict[str, Any]:
    """Units first, then release files. previous: undo the last promote stage if there is one (else the
    last release); pristine: every stage (the unit as before ddtree-ops) and every release; then the
    service restarts on what was restored and must answer /health_generate again. forget_stale: the repair
    of a host whose SGLang was changed under its releases (agent forget.py); the unit is not touched."""
    operator = operator or operator_name()
    host = ctx.host
    if forget_stale:
        with _session(ctx, inventory) as session, \
                _host_lock(ctx, session, command="rollback --forget-stale", operator=operator,
                           wait_s=lock_wait_s) as lease:
            ctx.step("forgetting stale releases")
            return _call(session, "forget_stale", {"state_dir": host.state_dir, "operator": operator,
                                                   "lock_id": lease.lock_id})
    with _session(ctx, inventory) as session, \
            _host_lock(ctx, session, command=f"rollback --to {to}", operator=operator, wait_s=lock_wait_s) as lease:
        base = {"state_dir": host.state_dir, "operator": operator, "lock_id": lease.lock_id}
        out: dict[str, Any] = {}
        ctx.step("checking the release base")
        # SGLang changed under the release: refused before the unit or any file is touched (agent stale.py).
        _call(session, "stale_check", base)  # the agent client names the host
        ctx.step("restoring the unit")
        # previous/pristine restore promoted units; a release id only undoes a stage left in flight
        # (and says whether ddtree-ops manages the service). pristine restarts once, after the files.
        unit = service.restore(session, host, lock_id=lease.lock_id, operator=operator, adopt=adopt,
                               to=to if to in ("previous", "pristine") else "journal", restart=to == "previous",
                               reason=f"rollback --to {to}")
        out["unit"] = unit
        managed = not unit.get("noop") or unit.get("mode") is not None
        if to == "previous" and not unit.get("noop"):
            out["message"] = f"unit back to {unit.get('mode') or 'pristine'} (release unchanged)"
            out["current_mode"] = unit.get("mode")
        else:
            ctx.step("rolling back files")
            rel = _call(session, "rollback", {**base, "to": to, "adopt": adopt})
            out.update(rel)
            run = unit.get("should_run", True) if to == "pristine" else True
            if managed and (not rel.get("noop") or to == "pristine"):
                ctx.step("restarting")
                out["restart"] = _call(session, "unit_service", {**base, "service": host.service, "run": run})
            if to == "pristine" and not unit.get("noop"):
                out["message"] = f"{rel.get('message')}; unit restored to as it was before ddtree-ops"
        restart = out.get("restart") or unit.get("restart")
        if restart and restart.get("action") == "restart":
            ctx.step("waiting for the service")
            answer = service.wait_ready(session, host, timeout_s=float(host.start_timeout_s),
                                        since=restart.get("since"), after_invocation=restart.get("invocation_before"))
            verdict = gates.ready_verdict(answer)
            out["ready"] = verdict.summary()
            if not verdict.passed:
                raise PromoteFailed(f"{host.name}: rolled back, but {host.service} is not ready: {verdict.reason}",
                                    code="rollback_not_ready", hint="inspect the host: journalctl -u "
                                    f"{host.service}", detail={"ready": verdict.to_dict(), **out})
        return out


def rollback(inventory: Inventory, hosts: Sequence[HostConfig], *, to: str = "previous", adopt: bool = False,
             lock_wait_s: float = 0.0, operator: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
             progress: FleetProgress | None = None, forget_stale: bool = False) -> list[HostResult]:
    if not to:
        raise UsageError("--to needs previous, pristine or a release id", code="bad_rollback_target")
    if forget_stale and (to != "previous" or adopt):
        raise UsageError("--forget-stale takes neither --to nor --adopt", code="bad_rollback_target",
                         hint="it forgets every release made for another SGLang than the installed one")
    who = operator or operator_name()
    return run_on_hosts(hosts, lambda ctx: rollback_host(ctx, inventory, to=to, adopt=adopt,
                                                         lock_wait_s=lock_wait_s, operator=who,
                                                         forget_stale=forget_stale),
                        concurrency=concurrency, progress=progress)
