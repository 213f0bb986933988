"""What every CLI command module shares: the common options, error reporting, inventory loading and
the closing summary line. Command modules (cli.py, bundle_cli.py, release_cli.py, promote_cli.py)
import from here; nothing here imports a command module, so there is no import cycle back into the app.

Conventions every command follows:
  -i/--inventory PATH   the inventory (default: $DDTREE_INVENTORY)
  --limit PATTERNS      host names, group names or globs, comma-separated (default: all hosts)
  --json                one JSON document on stdout and nothing else there; humans read stderr
  --concurrency N       hosts worked on at once
  exit codes            0 every host ok, 1 some host failed or was unreachable, 2 usage/inventory error

Heavy libraries (fabric, paramiko, pydantic, rich, httpx) are imported inside functions so
`--help` stays fast.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ddtree_ops.errors import OpsError, UsageError

if TYPE_CHECKING:
    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig, Inventory

EXIT_OK, EXIT_HOST_FAILED, EXIT_USAGE = 0, 1, 2

InventoryOption = Annotated[
    Path | None,
    typer.Option("--inventory", "-i", envvar="DDTREE_INVENTORY", show_default=False,
                 help="Inventory YAML file (see inventory/example.yaml)."),
]


def complete_hosts(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of --limit: the host and group names of the inventory given so far (-i or $DDTREE_INVENTORY)."""
    path = ctx.params.get("inventory") or os.environ.get("DDTREE_INVENTORY")
    if not path:
        return []
    from ddtree_ops.inventory import load_inventory

    try:
        inv = load_inventory(path)
    except OpsError:  # a broken inventory completes nothing; the command itself will say why
        return []
    head, _, word = incomplete.rpartition(",")
    return [f"{head},{name}" if head else name for name in [*inv.hosts, *inv.groups] if name.startswith(word)]


LimitOption = Annotated[
    str | None,
    typer.Option("--limit", "-l", metavar="PATTERNS", autocompletion=complete_hosts,
                 help="Only these hosts: host names, group names or globs, comma-separated."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (nothing else on stdout).")]
ConcurrencyOption = Annotated[int, typer.Option("--concurrency", "-c", min=1, max=512, help="Hosts worked on at once.")]
AllowUnsignedOption = Annotated[bool, typer.Option(
    "--allow-unsigned", help="Accept a bundle without a trusted signature (unsigned, or signed by a key the inventory's "
                             "`signers:` do not name); it is reported as such. A signature that does not match the "
                             "bundle is refused even so.")]
LockWaitOption = Annotated[float, typer.Option("--lock-wait", min=0, metavar="SECONDS",
                                               help="Wait this long for another run's host lock, then fail naming its holder.")]


def _set_debug(value: bool) -> bool:
    Session.debug = Session.debug or value
    return value


# On every command as well as the root, since every error hint says "rerun with --debug" and people
# add it at the end of the line they just ran.
DebugOption = Annotated[bool, typer.Option("--debug", callback=_set_debug, is_eager=True,
                                           help="Show tracebacks on errors (also DDTREE_DEBUG=1).")]


class Session:
    """Process-wide CLI state: `--debug` (root or any command), and the inventory warnings of this run
    (printed on stderr as the inventory loads, carried in the --json document)."""

    debug = os.environ.get("DDTREE_DEBUG", "") not in ("", "0")
    warnings: list[dict[str, Any]] = []


def emit_document(command: str, exit_code: int, **fields: Any) -> None:
    """Print the --json document (output.document's shape) with this run's inventory warnings."""
    from ddtree_ops.output import document, emit_json

    emit_json(document(command, exit_code, warnings=Session.warnings, **fields))


@contextmanager
def reported_errors(json_mode: bool, command: str) -> Iterator[None]:
    """Expected failures become a message + hint (and the --json document with its `error`), never a
    traceback; Ctrl-C becomes exit 130 with what it interrupted (and the hosts' results so far)."""
    from ddtree_ops.fleet import EXIT_INTERRUPTED, FleetInterrupted

    try:
        yield
    except FleetInterrupted as exc:
        _interrupted(command, json_mode, exc.results)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except KeyboardInterrupt:
        _interrupted(command, json_mode, [])
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OpsError as exc:
        from ddtree_ops.output import print_error

        code = EXIT_USAGE if isinstance(exc, UsageError) else EXIT_HOST_FAILED
        if json_mode:
            to_dict = getattr(exc, "to_dict", None)
            emit_document(command, code, error=to_dict() if callable(to_dict) else exc.info().to_dict())
        print_error(exc)
        if Session.debug:
            import traceback

            traceback.print_exc()
        raise typer.Exit(code) from None


def _interrupted(command: str, json_mode: bool, results: Sequence[HostResult]) -> None:
    from ddtree_ops.fleet import EXIT_INTERRUPTED
    from ddtree_ops.output import print_failures
    from ddtree_ops.release import summary

    done = [r.host for r in results if r.status != "interrupted"]
    message = f"interrupted (Ctrl-C) during {command}" + (
        f"; finished before it: {', '.join(done)}" if done else "; no host had finished")
    hint = "nothing is left half-done; run the command again for the hosts that did not finish" if results else None
    if json_mode:
        emit_document(command, EXIT_INTERRUPTED, results=[r.to_dict() for r in results],
                      summary=summary(results) if results else None,
                      error={"code": "interrupted", "message": message, "hint": hint})
    print_failures(results, debug=Session.debug)
    sys.stderr.write(message + "\n")


def load_selection(inventory: Path | None, limit: str | None, host: str | None = None, *,
                   ssh: bool = True) -> tuple[Inventory, list[HostConfig]]:
    """The inventory and the hosts `--limit` selects; `host` (history's and unlock's argument) narrows them
    further. With `ssh` (every command but `hosts`), the sudo passwords they need are at hand before any
    host is contacted (asked for once on a terminal), or this fails naming the hosts and the variable."""
    if inventory is None:
        raise UsageError("no inventory given", hint="pass -i PATH or set DDTREE_INVENTORY (start from inventory/example.yaml)",
                         code="inventory_missing")
    from ddtree_ops.inventory import load_inventory

    inv = load_inventory(inventory)
    for warning in inv.warnings:
        sys.stderr.write(f"warning: {warning.render(inv.path)}\n")
    Session.warnings = [w.to_dict() for w in inv.warnings]
    selected = inv.select(limit)
    if host is not None:
        named = {h.name for h in inv.select(host)}
        selected = [h for h in selected if h.name in named]
        if not selected:
            raise UsageError(f"`{host}` and --limit `{limit}` have no host in common", code="limit_no_match",
                             hint="drop one of them, or name a host that --limit selects")
    if ssh:
        from ddtree_ops.sudo import ask_passwords

        ask_passwords(selected)
    return inv, selected


def finish(command: str, hosts: Sequence[HostConfig], results: Sequence[HostResult], json_output: bool,
           render: Any = None, extra: dict[str, Any] | None = None) -> None:
    """Render (table or --json), notices and failures, the one-line summary on stderr; exit 0/1.

    `extra` adds keys to the --json document (e.g. promote's batches and untouched hosts)."""
    from ddtree_ops.fleet import exit_code
    from ddtree_ops.output import print_failures, print_notices
    from ddtree_ops.release import summary

    summ = summary(results)
    code = exit_code(results)
    if json_output:
        by_name = {h.name: h for h in hosts}
        rows = [{**r.to_dict(), **({"address": by_name[r.host].address, "port": by_name[r.host].port}
                                   if r.host in by_name else {})} for r in results]
        emit_document(command, code, results=rows, summary=summ, **(extra or {}))
    elif render is not None:
        render(hosts, results)
    print_notices(results)
    print_failures(results, debug=Session.debug)
    line = f"{command}: {summ['ok']}/{summ['hosts']} ok"
    if summ["noop"]:
        line += f", {len(summ['noop'])} no-op (nothing to do)"
    if summ["failed"]:
        line += f"; failed: {', '.join(summ['failed'])}"
    if summ["unreachable"]:
        line += f"; unreachable: {', '.join(summ['unreachable'])}"
    untouched = (extra or {}).get("untouched")
    if untouched:
        line += f"; not reached (untouched): {', '.join(untouched)}"
    sys.stderr.write(line + "\n")
    raise typer.Exit(code)


@contextmanager
def terminate_like_ctrl_c() -> Iterator[None]:
    """SIGTERM (systemd, CI cancel) unwinds like Ctrl-C: hosts in flight finish their step and
    release their lock in `finally` instead of leaving it to expire by TTL."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def table(columns: list[str]) -> Any:
    from rich.table import Table

    t = Table()
    for c in columns:
        t.add_column(c)
    return t
