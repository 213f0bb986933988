"""CLI commands push, smoke, rollback, history, unlock: thin wrappers over release.py / smoke.py
(and rollout.py, which restores promoted units on rollback).

Registered on the main app by `register(app)` (called from cli.py). Same conventions as every
command (cli_common): -i/--inventory, --limit, --json (one document on stdout), exit 0 all ok /
1 some host failed or was unreachable / 2 usage or inventory error. Heavy imports happen inside commands.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_ops.cli_common import (
    AllowUnsignedOption,
    ConcurrencyOption,
    DebugOption,
    InventoryOption,
    JsonOption,
    LimitOption,
    LockWaitOption,
    complete_hosts,
    finish,
    load_selection,
    reported_errors,
    table,
    terminate_like_ctrl_c,
)
from ddtree_ops.errors import UsageError
from ddtree_ops.fleet import DEFAULT_CONCURRENCY
from ddtree_ops.smoke import DEFAULT_STEP_TIMEOUT_S

if TYPE_CHECKING:
    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig

AdoptOption = Annotated[bool, typer.Option("--adopt", help="Take over files that hash to neither pristine nor patched "
                                                           "(they are backed up first) instead of refusing the host.")]


def _short(h: str | None) -> str:
    return "absent" if h is None else h[:12]


def _render_push(hosts: list[HostConfig], results: list[HostResult]) -> None:
    from ddtree_ops.output import stdout_console

    t = table(["host", "status", "sglang", "release", "result", "files", "time"])
    for r in results:
        d = r.data or {}
        if not r.ok:
            refused = ((r.error.detail or {}).get("refusals") or [{}])[0] if r.error else {}
            t.add_row(r.host, r.status, str(refused.get("host_version") or "-"), "-",
                      r.error.code if r.error else "-", "-", f"{r.elapsed_s:.1f}s", style="red")
            continue
        base = (d.get("bundle") or {}).get("base_version") or d.get("base_version") or "-"
        if d.get("dry_run"):
            result = "would refuse" if d.get("refusals") else ("no change" if d.get("noop") else "would install")
            t.add_row(r.host, "dry-run", base, d.get("release") or "-", result, str(d.get("changes", 0)),
                      f"{r.elapsed_s:.1f}s")
            continue
        changed = "0" if d.get("noop") else str(len(d.get("changed", [])))
        t.add_row(r.host, r.status, base, d.get("release", "-"), "already current" if d.get("noop") else "installed",
                      changed, f"{r.elapsed_s:.1f}s")
    console = stdout_console()
    console.print(t)
    for r in results:
        d = r.data or {}
        if r.ok and d.get("dry_run"):
            chosen = d.get("bundle")
            which = (f"SGLang {chosen['host_version']} → {Path(chosen['path']).name}" if chosen
                     else f"SGLang {d.get('base_version')}: no bundle")
            console.print(f"[bold]{r.host}[/bold] ({d.get('site_packages')}; {which}):", highlight=False)
            for f in d.get("files", []):
                console.print(f"  {f['action']:<9} {f['path']}  {_short(f['now'])} → {_short(f['target'])}")
            for ref in d.get("refusals", []):
                console.print(f"  [red]refused[/red] {ref['message']}")
            if d.get("interrupted"):
                i = d["interrupted"]
                console.print(f"  [yellow]interrupted[/yellow] {i['action']} of {i['release']} (started {i['started']}) "
                              "is completed first by the next push or rollback")


def register(app: typer.Typer) -> None:
    @app.command()
    def push(
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        bundle: Annotated[list[Path] | None, typer.Option(
            "--bundle", "-b", metavar="BUNDLE|DIR",
            help="Bundle to push, or a directory (its newest bundle of each SGLang base); repeat it for a fleet of "
                 "several SGLang versions: each host gets the bundle built for its version (default: dist/).")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Show per host which files would change "
                                                                  "(hash now → hash after); change nothing.")] = False,
        adopt: AdoptOption = False,
        allow_unsigned: AllowUnsignedOption = False,
        lock_wait: LockWaitOption = 0.0,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        """Install a payload bundle on hosts: preflight, lock, upload, verify, back up, install, record.

        The bundle must be signed (BUNDLE.sig, `build --sign-key`) by one of the inventory's `signers:`
        unless --allow-unsigned; it is checked before any host is contacted, and each host's audit log
        records who signed it. Each host gets the bundle whose base is its installed SGLang version; a host
        no bundle matches is refused (the others go on), as is one whose files hash to neither pristine nor
        patched (unless --adopt). Re-pushing the current bundle is a
        no-op. An interrupted install is completed by the next push or rollback.
        """
        command = "push --dry-run" if dry_run else "push"
        with reported_errors(json_output, command):
            inv, hosts = load_selection(inventory, limit)
            from ddtree_ops.output import progress_for
            from ddtree_ops.release import load_bundles
            from ddtree_ops.release import push as do_push

            local = load_bundles(bundle or (), signers=inv.signers, allow_unsigned=allow_unsigned)
            for one in local.bundles:
                signature = one.signature
                assert signature is not None  # checked: the inventory's signers were given
                sys.stderr.write(f"bundle {one.path.name} (sha256 {one.sha256[:16]}…): {signature.describe()}"
                                 + ("" if signature.trusted else ", accepted because of --allow-unsigned")
                                 + f"; for SGLang {one.base_version}\n")
            progress = progress_for(hosts, "dry run" if dry_run else "push", json_mode=json_output)
            with terminate_like_ctrl_c(), progress or nullcontext():
                results = do_push(inv, hosts, local, dry_run=dry_run, adopt=adopt,
                                  lock_wait_s=lock_wait, concurrency=concurrency, progress=progress)
        extra = {"bundles": local.describe()}
        if len(local.bundles) == 1:
            extra["bundle"] = local.bundles[0].describe()  # the single-bundle document, as before bases
        finish(command, hosts, results, json_output, _render_push, extra)

    @app.command()
    def smoke(
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        step_timeout: Annotated[float, typer.Option("--step-timeout", min=1, metavar="SECONDS",
                                                    help="Timeout of each smoke step on a host.")] = DEFAULT_STEP_TIMEOUT_S,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        """Check the installed payload with each host's own SGLang Python.

        Steps: import the DDTree and patched modules; parse server args with valid DDTree flags
        and check each bad combination is refused; a CPU tree-builder self-test with a known answer.
        """
        with reported_errors(json_output, "smoke"):
            inv, hosts = load_selection(inventory, limit)
            from ddtree_ops.output import progress_for, stdout_console
            from ddtree_ops.smoke import smoke as do_smoke

            progress = progress_for(hosts, "smoke", json_mode=json_output)
            with progress or nullcontext():
                results = do_smoke(inv, hosts, step_timeout_s=step_timeout, concurrency=concurrency, progress=progress)

        def render(hosts: list[HostConfig], results: list[HostResult]) -> None:
            t = table(["host", "status", "import", "server_args", "tree", "time"])
            for r in results:
                steps = {s["name"]: s for s in (r.data or {}).get("steps", [])}
                cells = [("pass" if steps[n]["passed"] else "FAIL") + f" {steps[n]['seconds']:.0f}s" if n in steps
                         else "-" for n in ("import", "server_args", "tree")]
                t.add_row(r.host, r.status, *cells, f"{r.elapsed_s:.1f}s", style="" if r.ok else "red")
            stdout_console().print(t)

        finish("smoke", hosts, results, json_output, render)

    @app.command()
    def rollback(
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        to: Annotated[str, typer.Option("--to", metavar="previous|pristine|RELEASE",
                                        help="previous: undo the current release; pristine: undo all; "
                                             "RELEASE: a release id from `history`.")] = "previous",
        adopt: Annotated[bool, typer.Option("--adopt", help="Overwrite files changed by someone since the push "
                                                            "(their bytes are kept in the state dir).")] = False,
        forget_stale: Annotated[bool, typer.Option(
            "--forget-stale", help="Repair a host whose SGLang was upgraded or downgraded under its releases "
                                   "(status: STALE): after `pip install --force-reinstall --no-deps sglang==VERSION`, "
                                   "check every file is the wheel's, remove the DDTree modules the old release "
                                   "added and set its state aside.")] = False,
        lock_wait: LockWaitOption = 0.0,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        """Undo the last promote stage or release: units first, then files, then restart and health-check.

        previous: the unit of the stage before the last promote (the release stays), or, with no
        promote stage left, the release before the current one. pristine: every stage (the unit as
        it was before ddtree-ops touched it: removed if there was none) and every release. RELEASE:
        files of that release. Files are restored byte for byte (sha256-verified); a promoted
        service is restarted and must answer /health_generate again. Nothing to roll back is a
        no-op that says so; an interrupted push or promote is completed or undone first.
        """
        with reported_errors(json_output, "rollback"):
            inv, hosts = load_selection(inventory, limit)
            from ddtree_ops.output import progress_for, stdout_console
            from ddtree_ops.rollout import rollback as do_rollback

            progress = progress_for(hosts, "rollback", json_mode=json_output)
            with terminate_like_ctrl_c(), progress or nullcontext():
                results = do_rollback(inv, hosts, to=to, adopt=adopt, lock_wait_s=lock_wait,
                                      concurrency=concurrency, progress=progress, forget_stale=forget_stale)

        def render(hosts: list[HostConfig], results: list[HostResult]) -> None:
            t = table(["host", "status", "now", "result", "time"])
            for r in results:
                d = r.data or {}
                now = d.get("current", d.get("release")) or "pristine"
                if "current_mode" in d:
                    now = f"unit: {d['current_mode'] or 'pristine'}"
                t.add_row(r.host, r.status, now if r.ok else "-",
                              d.get("message", "") if r.ok else (r.error.code if r.error else "-"),
                              f"{r.elapsed_s:.1f}s", style="" if r.ok else "red")
            stdout_console().print(t)

        finish("rollback", hosts, results, json_output, render)

    @app.command()
    def history(
        host: Annotated[str | None, typer.Argument(help="Host (or group/glob); with --limit, the hosts both select.",
                                                   autocompletion=complete_hosts, show_default=False)] = None,
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        entries: Annotated[int, typer.Option("--entries", "-n", min=1, help="Audit entries per host.")] = 20,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        """Per host: current and previous release, installed stack, mode, promote stages, and the audit log's latest entries."""
        with reported_errors(json_output, "history"):
            inv, hosts = load_selection(inventory, limit, host)
            from ddtree_ops.output import stdout_console
            from ddtree_ops.release import history as do_history

            results = do_history(inv, hosts, limit=entries, concurrency=concurrency)

        def render(hosts: list[HostConfig], results: list[HostResult]) -> None:
            console = stdout_console()
            for r in results:
                if not r.ok:
                    continue
                st = r.data["state"]
                console.print(f"[bold]{r.host}[/bold]: current {st.get('current') or 'pristine'}, "
                              f"previous {st.get('previous') or '-'}, stack {' > '.join(st.get('stack') or []) or '-'}, "
                              f"mode {st.get('mode') or '-'}")
                for h in r.data.get("history") or []:
                    if str(h.get("action", "")).startswith(("promote", "unit rollback")):
                        console.print(f"  {h.get('time')}  {h.get('operator')}  {h.get('action')}  "
                                      f"(from {h.get('from') or '-'}): {h.get('result')}")
                for a in r.data["audit"]:
                    console.print(f"  {a.get('time')}  {a.get('operator')}  {a.get('command')}  "
                                  f"{a.get('release') or '-'}  {a.get('result')}")

        finish("history", hosts, results, json_output, render)

    @app.command()
    def unlock(
        host: Annotated[str | None, typer.Argument(help="Host (or group/glob) to unlock; with --limit, the hosts "
                                                        "both select.",
                                                   autocompletion=complete_hosts, show_default=False)] = None,
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (for scripts).")] = False,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        """Break the host lock left by a dead run (shows the holder and asks first; --yes for scripts).

        Also completes an install or rollback the dead run left half done.
        """
        with reported_errors(json_output, "unlock"):
            inv, hosts = load_selection(inventory, limit, host)
            from ddtree_ops.fleet import HostResult
            from ddtree_ops.release import lock_holders
            from ddtree_ops.release import unlock as do_unlock

            holders = lock_holders(inv, hosts, concurrency=concurrency)
            # First what could not be checked: a lock there may be what the operator is after.
            for r in holders:
                if not r.ok and r.error is not None:
                    sys.stderr.write(f"{r.host}: {r.status}, its lock was not checked: {r.error.message}\n")
            locked = [h for h, r in zip(hosts, holders, strict=True)
                      if r.ok and (r.data.get("holder") or r.data.get("problems"))]
            for h, r in zip(hosts, holders, strict=True):
                if r.ok and r.data.get("holder"):
                    o = r.data["holder"]
                    stale = f" (stale: {o['stale_reason']})" if o.get("stale") else " (NOT stale: it may still be running)"
                    who = f"damaged lock: {o['damaged']}" if o.get("damaged") else \
                        f"locked by {o.get('who')} running {o.get('command')!r} from {o.get('host')} since {o.get('start')}"
                    sys.stderr.write(f"{h.name}: {who}{stale}\n")
                for p in (r.data.get("problems") or []) if r.ok else []:
                    sys.stderr.write(f"{h.name}: found {p['path']}: {p['problem']}\n")
            unlocked: dict[str, HostResult] = {}
            if not locked:
                sys.stderr.write("no reachable host is locked or damaged\n")
            else:
                if not yes:
                    if not sys.stdin.isatty():
                        raise UsageError("refusing to unlock without confirmation (no terminal to ask)",
                                         hint="pass --yes", code="confirmation_needed")
                    typer.confirm(f"Break the lock on {', '.join(h.name for h in locked)}?", abort=True, err=True)
                with terminate_like_ctrl_c():
                    unlocked = {r.host: r for r in do_unlock(inv, locked, concurrency=concurrency)}
            # One result per selected host: unlocked ones, the unreachable ones as they were, the rest "not locked".
            results = [unlocked.get(r.host) or (r if not r.ok else HostResult(
                r.host, "ok", data={"message": "not locked", "noop": True}, elapsed_s=r.elapsed_s)) for r in holders]
        finish("unlock", hosts, results, json_output)
