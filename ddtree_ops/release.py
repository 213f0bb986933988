"""Releases on hosts, control side: push, rollback, history, unlock (library calls for the CLI).

Per host, push is a short conversation with the host's agent, one SSH exec per step:

    plan (preflight: version, per-file hashes, refusals)   -- read-only; also the whole --dry-run
    lock  -> stage_begin -> sftp put -> install(lock_id)    -- install re-verifies everything
    unlock                                                   -- in `finally`: on every exit path

A no-op re-push stops after `plan` (one round trip, no lock, no upload). The bundle is verified
locally before any host is contacted, so a tampered bundle never leaves the laptop; the agent
re-verifies it after upload (sha256 of the archive and of every file in it) before any change.
Every function returns one fleet.HostResult per host; a failing host never stops the others.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import secrets
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_ops.errors import OpsError, UsageError
from ddtree_ops.fleet import DEFAULT_CONCURRENCY, FleetProgress, HostContext, HostResult, run_on_hosts

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig, Inventory
    from ddtree_ops.lease import HostLease
    from ddtree_ops.signing import PublicKey, Signature
    from ddtree_ops.ssh import HostSession

# Agent steps that touch only small files; install/rollback hash and copy a few MB at most.
STEP_TIMEOUT_S = 120.0


class ReleaseError(OpsError):
    """A host refused or failed a release step; `detail` carries the agent's structured extras."""

    def __init__(self, message: str, *, code: str, hint: str | None = None, detail: dict | None = None) -> None:
        super().__init__(message, hint=hint, code=code)
        self.detail = detail or {}


def operator_name() -> str:
    """Who is doing this, for lock owners and the audit log: user@machine (never a secret)."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class LocalBundle:
    """A bundle verified on this machine, with what the hosts need to re-verify it."""

    path: Path
    sha256: str
    size: int
    manifest: dict[str, Any]  # manifest.json as a plain dict (sent inline for plan / dry-run)
    signature: Signature | None = None  # None: loaded without a signature check (a caller's own bundle)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, signers: Mapping[str, PublicKey] | None = None,
             allow_unsigned: bool = False) -> LocalBundle:
        """Check a bundle's hashes and, given the inventory's `signers`, its signature (signing.check_signature);
        raises BundleError / SignatureError before any host is touched."""
        from ddtree_ops.bundle import sha256_file, verify_bundle
        from ddtree_ops.signing import check_signature

        p = Path(path)
        manifest = verify_bundle(p)  # tampered or unreadable: the more precise message comes first
        signature = None if signers is None else check_signature(p, signers, allow_unsigned=allow_unsigned)
        return cls(p, sha256_file(p), p.stat().st_size, manifest.model_dump(mode="json"), signature)

    @property
    def base_version(self) -> str:
        return str(self.manifest["base_version"])

    def describe(self) -> dict[str, Any]:
        """For --json and the operator: which bundle, its hash and who signed it."""
        return {"path": str(self.path), "sha256": self.sha256,
                "signature": self.signature.to_dict() if self.signature else None}


def default_bundle(dist: Path = Path("dist")) -> Path:
    """The newest dist/ddtree-payload-*.tar.gz (of any base)."""
    found = sorted(dist.glob("ddtree-payload-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no bundle given and none in {dist}/", hint="run `ddtree-ops build` or pass --bundle PATH",
                         code="bundle_missing")
    return found[-1]


@dataclass(frozen=True)
class BundleSet:
    """The bundles a push may install, at most one per SGLang base; each host gets the one whose
    `base_version` is its installed SGLang version (push_host)."""

    bundles: tuple[LocalBundle, ...]

    @classmethod
    def of(cls, bundles: Sequence[LocalBundle]) -> BundleSet:
        if not bundles:
            raise UsageError("no bundle to push", hint="run `ddtree-ops build` or pass --bundle PATH",
                             code="bundle_missing")
        seen: dict[str, LocalBundle] = {}
        for b in bundles:
            base = b.base_version
            if base in seen and seen[base].path != b.path:
                raise UsageError(f"two bundles for SGLang {base}: {seen[base].path} and {b.path}",
                                 hint="pass one bundle per base", code="bundle_base_twice")
            seen.setdefault(base, b)
        return cls(tuple(sorted(seen.values(), key=lambda b: b.base_version)))

    @property
    def bases(self) -> list[str]:
        return [b.base_version for b in self.bundles]

    def for_base(self, version: str | None) -> LocalBundle | None:
        return next((b for b in self.bundles if b.base_version == version), None)

    def refusal(self, host: str, version: str | None) -> dict[str, Any]:
        """The refusal of a host whose SGLang no bundle here is built for (plan-refusal shaped)."""
        from ddtree_ops.bases import find_base, known_versions
        from ddtree_ops.bundle import PAYLOAD_DIR

        base = find_base(version)
        if base is None:
            hint = (f"SGLang {version} is not a base ddtree-ops knows (known: {', '.join(known_versions())}); "
                    "upgrade or downgrade the host to one of them")
        elif not base.has_payload(PAYLOAD_DIR):
            hint = f"ddtree-ops has no payload for SGLang {version} yet ({base.pending})"
        else:
            hint = f"build it with `ddtree-ops build --base {version}` and push it with the others"
        return {"code": "wrong_version", "message": f"{host}: SGLang here is {version}; no bundle given for it "
                                                      f"(bundles given for: {', '.join(self.bases)})",
                "hint": hint, "host_version": version, "bases": self.bases}

    def describe(self) -> list[dict[str, Any]]:
        return [{**b.describe(), "base_version": b.base_version} for b in self.bundles]


def load_bundles(paths: Sequence[str | os.PathLike[str]] = (), *, signers: Mapping[str, PublicKey] | None = None,
                 allow_unsigned: bool = False, dist: Path = Path("dist")) -> BundleSet:
    """The bundles named on the command line: each a bundle file, or a directory whose newest
    ddtree-payload-*.tar.gz of each base is taken; none named: `dist` as such a directory. Every bundle is
    verified (and its signature checked, given `signers`) before any host is contacted."""
    from ddtree_ops.bundle import verify_bundle

    chosen: list[Path] = []
    for given in [Path(p) for p in paths] or [dist]:
        if not given.is_dir():
            chosen.append(given)  # LocalBundle.load says what is wrong with a missing or bad file
            continue
        found = sorted(given.glob("ddtree-payload-*.tar.gz"), key=lambda p: p.stat().st_mtime, reverse=True)
        if not found:
            raise UsageError(f"no bundle given and none in {given}/" if not paths else f"no bundle in {given}/",
                             hint="run `ddtree-ops build` or pass --bundle PATH", code="bundle_missing")
        newest: dict[str, Path] = {}
        for p in found:
            newest.setdefault(verify_bundle(p).base_version, p)
        chosen.extend(newest.values())
    return BundleSet.of([LocalBundle.load(p, signers=signers, allow_unsigned=allow_unsigned) for p in chosen])


# ----------------------------------------------------------------------------- per-host plumbing


def _call(session: HostSession, op: str, args: dict[str, Any], timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    from ddtree_ops.agent.client import AgentCallError, call_agent

    try:
        return call_agent(session, op, args, timeout=timeout)
    except AgentCallError as exc:
        raise ReleaseError(exc.message, code=exc.code, hint=exc.hint, detail=exc.detail) from None


@contextlib.contextmanager
def _session(ctx: HostContext, inventory: Inventory) -> Iterator[HostSession]:
    from ddtree_ops.ssh import HostSession

    ctx.step("connecting")
    with HostSession(ctx.host, jump_chain=inventory.jump_chain(ctx.host), notice=ctx.notice) as session:
        yield session


def _base_args(host: HostConfig, operator: str) -> dict[str, Any]:
    return {"state_dir": host.state_dir, "operator": operator}


@contextlib.contextmanager
def _host_lock(ctx: HostContext, session: HostSession, *, command: str, operator: str,
               wait_s: float) -> Iterator[HostLease]:
    """Hold the host lock across several agent calls, kept fresh by heartbeat while this run lives;
    released on every exit path. All of it is the host's change (fleet.HostContext.change): Ctrl-C
    waits for it to unwind and unlock."""
    from ddtree_ops.agent.remote import lock as agent_lock
    from ddtree_ops.lease import HostLease, beat_interval

    with ctx.change():
        ctx.step("waiting for lock" if wait_s else "locking")
        # host and pid are for people reading the lock; the run id is what tells two runs apart (a control
        # machine may share the target's host name, and its pid means nothing there). control_process lets
        # a later run on this same machine see that this one died.
        request = {
            **_base_args(ctx.host, operator), "who": operator, "command": command, "run_id": secrets.token_hex(8),
            "host": socket.gethostname(), "pid": os.getpid(), "ttl_s": ctx.host.lock_ttl_s, "wait_s": wait_s,
            "control_process": agent_lock.control_process(),
        }
        try:
            answer = _call(session, "lock", request, timeout=STEP_TIMEOUT_S + wait_s)
        except ReleaseError as exc:
            holder = (exc.detail or {}).get("holder") or {} if exc.code == "locked" else {}
            proc = holder.get("control_process")
            if not (isinstance(proc, dict) and holder.get("run_id") and agent_lock.died_here(proc)):
                raise
            _break_dead_run(ctx, session, holder, operator)
            answer = _call(session, "lock", request, timeout=STEP_TIMEOUT_S + wait_s)
        lease = HostLease(session, ctx.host, answer["lock_id"], beat_interval(ctx.host)).start()
        try:
            yield lease
        finally:
            lease.stop()
            # Best effort on the way out: if the connection is gone the lock's TTL (or `unlock`) frees it,
            # and a failure here must not mask the error that got us here.
            with contextlib.suppress(Exception):
                released = _call(session, "unlock", {"state_dir": ctx.host.state_dir, "lock_id": lease.lock_id})
                if released.get("busy"):
                    ctx.notice("the host lock stays until an agent step of this run still running there ends "
                               f"({', '.join(op.get('op', '?') for op in released['busy'])}), then expires with "
                               "its TTL")


def _break_dead_run(ctx: HostContext, session: HostSession, holder: dict[str, Any], operator: str) -> None:
    """The lock belongs to a run of this very machine that is gone (killed, crashed): break it by its
    run id (never a lock some other run took meanwhile), then do what `unlock` does after it: finish
    or undo an interrupted install or rollback, undo an interrupted promote stage."""
    ctx.notice(f"the host lock is held by {holder.get('who')} ({holder.get('command')}, run {holder['run_id']}), "
               "a run of this machine that is gone: breaking it and finishing what it left")
    _call(session, "unlock", {"state_dir": ctx.host.state_dir, "run_id": holder["run_id"]})
    _call(session, "recover", {**_base_args(ctx.host, operator), "repair": True})
    _call(session, "unit_recover", _base_args(ctx.host, operator))


def _upload(ctx: HostContext, session: HostSession, bundle: LocalBundle, operator: str) -> str:
    """Put the bundle into the host's staging dir; returns its staged name."""
    ctx.step("uploading")
    name = bundle.path.name
    target = _call(session, "stage_begin", {**_base_args(ctx.host, operator), "name": name, "size": bundle.size})["path"]
    assert session.conn is not None
    sftp = session.conn.sftp()
    try:
        if ctx.host.sudo:
            # The login user cannot write the root-owned state dir: land in its own tmp, and let the
            # agent (running under sudo) import it into staging and re-hash it there. The agent removes
            # the upload either way; a failed transfer is removed here.
            tmp = f"/tmp/.ddtree-upload-{secrets.token_hex(6)}"
            try:
                sftp.put(str(bundle.path), tmp)
            except BaseException:
                with contextlib.suppress(Exception):
                    sftp.remove(tmp)
                raise
            _call(session, "stage_verify", {**_base_args(ctx.host, operator), "bundle": name,
                                            "bundle_sha256": bundle.sha256, "import_from": tmp})
        else:
            sftp.put(str(bundle.path), target)
    except OSError as exc:
        raise ReleaseError(f"{ctx.host.name}: upload of {name} failed: {exc}", code="upload_failed",
                           hint="check free space in the state dir on the host; nothing was changed") from None
    finally:
        sftp.close()
    return name


def _refusal(host: HostConfig, plan: dict[str, Any]) -> ReleaseError:
    refusals = plan["refusals"]
    first = refusals[0]
    return ReleaseError(f"{host.name}: " + "; ".join(r["message"] for r in refusals), code=first["code"],
                        hint=first.get("hint"), detail={"refusals": refusals})


# ----------------------------------------------------------------------------- push


def _bundle_choice(bundle: LocalBundle, host_version: str | None) -> dict[str, Any]:
    return {"host_version": host_version, "base_version": bundle.base_version, "path": str(bundle.path),
            "sha256": bundle.sha256}


def push_host(ctx: HostContext, inventory: Inventory, bundle: LocalBundle | BundleSet, *, dry_run: bool = False,
              adopt: bool = False, lock_wait_s: float = 0.0, operator: str | None = None,
              test_kill_after_files: int | None = None) -> dict[str, Any]:
    """Push to one host the bundle whose base is its installed SGLang: the first plan (with the first bundle)
    tells the host's version; another bundle's plan follows only when that one is not the match. A host no
    bundle matches is refused (`wrong_version`, naming its version and the bases given)."""
    operator = operator or operator_name()
    bundles = bundle if isinstance(bundle, BundleSet) else BundleSet.of([bundle])
    with _session(ctx, inventory) as session:
        ctx.step("preflight")
        chosen = bundles.bundles[0]
        plan = _call(session, "plan", {**_base_args(ctx.host, operator), "manifest": chosen.manifest, "adopt": adopt})
        host_version = plan.get("base_version")
        match = bundles.for_base(host_version)
        stale = next((r for r in plan.get("refusals") or [] if r.get("code") == "stale_base"), None)
        if match is None:
            # SGLang changed under the installed release: that is what the operator must hear first.
            refusal = {**stale, "message": f"{ctx.host.name}: {stale['message']}"} if stale else \
                bundles.refusal(ctx.host.name, host_version)
            if dry_run:
                return {"dry_run": True, "bundle": None, "base_version": host_version, "release": None,
                        "site_packages": plan.get("site_packages"), "current": plan.get("current"), "files": [],
                        "changes": 0, "noop": False, "refusals": [refusal], "interrupted": plan.get("interrupted")}
            raise ReleaseError(refusal["message"], code=refusal["code"], hint=refusal["hint"],
                               detail={"refusals": [refusal]})
        if match is not chosen:
            chosen = match
            plan = _call(session, "plan", {**_base_args(ctx.host, operator), "manifest": chosen.manifest,
                                           "adopt": adopt})
        choice = _bundle_choice(chosen, host_version)
        if dry_run:
            return {"dry_run": True, **plan, "bundle": choice}
        if plan["refusals"]:
            raise _refusal(ctx.host, plan)
        if plan["noop"]:
            return {"release": plan["release"], "noop": True, "bundle": choice,
                    "message": f"{plan['release']} is already current; nothing to do", "files": plan["files"]}
        with _host_lock(ctx, session, command="push", operator=operator, wait_s=lock_wait_s) as lease:
            ctx.checkpoint()  # Ctrl-C while locking: stop here, the lock is released on the way out
            name = _upload(ctx, session, chosen, operator)
            ctx.checkpoint()  # nothing but the staging dir has changed yet
            ctx.step("installing")
            args = {**_base_args(ctx.host, operator), "lock_id": lease.lock_id, "bundle": name,
                    "bundle_sha256": chosen.sha256, "adopt": adopt}
            if chosen.signature is not None:
                args["signer"] = chosen.signature.describe()  # the host's audit log says who signed what it runs
            if test_kill_after_files is not None:
                args["test_kill_after_files"] = test_kill_after_files
            return {**_call(session, "install", args), "bundle": choice}


def push(inventory: Inventory, hosts: Sequence[HostConfig],
         bundle: str | os.PathLike[str] | LocalBundle | BundleSet, *,
         dry_run: bool = False, adopt: bool = False, lock_wait_s: float = 0.0, operator: str | None = None,
         concurrency: int = DEFAULT_CONCURRENCY, progress: FleetProgress | None = None) -> list[HostResult]:
    """Push bundles to hosts (or, with dry_run, say per host which bundle and what would change): each host
    gets the bundle built for its installed SGLang (a BundleSet holds one per base; a single bundle is a set
    of one), and a host none matches is refused on its own while the others proceed. A bundle given as a path
    must be signed by one of the inventory's `signers`; a LocalBundle / BundleSet is pushed as its caller
    loaded it (the CLI loads with --allow-unsigned included). Raises BundleError / SignatureError before
    contacting any host when a bundle is bad."""
    if isinstance(bundle, BundleSet | LocalBundle):
        local: LocalBundle | BundleSet = bundle
    else:
        local = LocalBundle.load(bundle, signers=inventory.signers)
    who = operator or operator_name()
    return run_on_hosts(hosts, lambda ctx: push_host(ctx, inventory, local, dry_run=dry_run, adopt=adopt,
                                                     lock_wait_s=lock_wait_s, operator=who),
                        concurrency=concurrency, progress=progress)


# ----------------------------------------------------------------------------- rollback


def rollback_host(ctx: HostContext, inventory: Inventory, *, to: str = "previous", adopt: bool = False,
                  lock_wait_s: float = 0.0, operator: str | None = None) -> dict[str, Any]:
    operator = operator or operator_name()
    with _session(ctx, inventory) as session, \
            _host_lock(ctx, session, command=f"rollback --to {to}", operator=operator, wait_s=lock_wait_s) as lease:
        ctx.step("rolling back")
        return _call(session, "rollback", {**_base_args(ctx.host, operator), "lock_id": lease.lock_id, "to": to,
                                           "adopt": adopt})


def rollback(inventory: Inventory, hosts: Sequence[HostConfig], *, to: str = "previous", adopt: bool = False,
             lock_wait_s: float = 0.0, operator: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
             progress: FleetProgress | None = None) -> list[HostResult]:
    """Restore `previous`, `pristine` or a named release on each host, byte for byte."""
    if not to:
        raise UsageError("--to needs previous, pristine or a release id", code="bad_rollback_target")
    who = operator or operator_name()
    return run_on_hosts(hosts, lambda ctx: rollback_host(ctx, inventory, to=to, adopt=adopt,
                                                         lock_wait_s=lock_wait_s, operator=who),
                        concurrency=concurrency, progress=progress)


# ----------------------------------------------------------------------------- history, lock


def history(inventory: Inventory, hosts: Sequence[HostConfig], *, limit: int = 50,
            concurrency: int = DEFAULT_CONCURRENCY, progress: FleetProgress | None = None) -> list[HostResult]:
    """Per host: current/previous/stack, release history and the audit-log tail (read-only)."""

    def one(ctx: HostContext) -> dict[str, Any]:
        with _session(ctx, inventory) as session:
            ctx.step("history")
            return _call(session, "history", {"state_dir": ctx.host.state_dir, "limit": limit})

    return run_on_hosts(hosts, one, concurrency=concurrency, progress=progress)


def lock_holders(inventory: Inventory, hosts: Sequence[HostConfig], *, concurrency: int = DEFAULT_CONCURRENCY,
                 progress: FleetProgress | None = None) -> list[HostResult]:
    """Per host: {"holder": owner record with stale/stale_reason, or None, "problems": [{path, problem,
    repair}] for damaged or planted state files}. For unlock's confirmation."""

    def one(ctx: HostContext) -> dict[str, Any]:
        with _session(ctx, inventory) as session:
            return _call(session, "lock_status", {"state_dir": ctx.host.state_dir})

    return run_on_hosts(hosts, one, concurrency=concurrency, progress=progress)


def unlock(inventory: Inventory, hosts: Sequence[HostConfig], *, operator: str | None = None,
           concurrency: int = DEFAULT_CONCURRENCY, progress: FleetProgress | None = None) -> list[HostResult]:
    """Break a dead run's host lock (the CLI confirms first), removing links planted in the state dir.
    A lock whose heartbeat is fresh belongs to a live run and is refused, unless that run is one of
    this machine that is gone. Also finishes an interrupted install or rollback left by the dead
    holder, or clears its journal when that is damaged and no file is mixed, and settles an
    interrupted promote stage, so the host is consistent when the lock goes."""
    from ddtree_ops.agent.remote import lock as agent_lock

    who = operator or operator_name()

    def one(ctx: HostContext) -> dict[str, Any]:
        with _session(ctx, inventory) as session, ctx.change():
            ctx.step("unlocking")
            holder = _call(session, "lock_status", {"state_dir": ctx.host.state_dir}).get("holder") or {}
            proc = holder.get("control_process")
            dead = holder.get("run_id") if isinstance(proc, dict) and agent_lock.died_here(proc) else None
            released = _call(session, "unlock", {"state_dir": ctx.host.state_dir, "force": True,
                                                 "dead_run_id": dead})
            recovered = _call(session, "recover", {**_base_args(ctx.host, who), "repair": True})
            # A promote killed mid-stage left its unit journal: undo it (its gates never passed).
            units = _call(session, "unit_recover", {**_base_args(ctx.host, who)})
            return {**released, **recovered, "unit_recovered": units.get("recovered")}

    return run_on_hosts(hosts, one, concurrency=concurrency, progress=progress)


def summary(results: Sequence[HostResult]) -> dict[str, Any]:
    """Counts and the names of failed / unreachable hosts, for the CLI's last line and --json."""
    failed = [r.host for r in results if r.status == "failed"]
    unreachable = [r.host for r in results if r.status == "unreachable"]
    interrupted = [r.host for r in results if r.status == "interrupted"]
    noop = [r.host for r in results if r.ok and isinstance(r.data, dict) and r.data.get("noop")]
    return {"hosts": len(results), "ok": sum(r.ok for r in results), "noop": noop, "failed": failed,
            "unreachable": unreachable, "interrupted": interrupted}
