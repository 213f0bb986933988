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
LimitOption = Annotated[
    str | None,
    typer.Option("--limit", "-l", metavar="PATTERNS",
                 help="Only these hosts: host names, group names or globs, comma-separated."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (nothing else on stdout).")]
ConcurrencyOption = Annotated[int, typer.Option("--concurrency", "-c", min=1, max=512, help="Hosts worked on at once.")]
LockWaitOption = Annotated[float, typer.Option("--lock-wait", min=0, metavar="SECONDS",
                                               help="Wait this long for another run's host lock, then fail naming its holder.")]


class Session:
    """Process-wide CLI settings set by the root callback (`--debug`)."""

    debug = os.environ.get("DDTREE_DEBUG", "") not in ("", "0")


@contextmanager
def reported_errors(json_mode: bool) -> Iterator[None]:
    """Expected failures become a message + hint (and a JSON error with --json), never a traceback."""
    try:
        yield
    except OpsError as exc:
        from ddtree_ops.output import emit_json, print_error

        if json_mode:
            to_dict = getattr(exc, "to_dict", None)
            emit_json({"ok": False, "error": to_dict() if callable(to_dict) else exc.info().to_dict()})
        print_error(exc)
        if Session.debug:
            import traceback

            traceback.print_exc()
        raise typer.Exit(EXIT_USAGE if isinstance(exc, UsageError) else EXIT_HOST_FAILED) from None


def load_selection(inventory: Path | None, limit: str | None) -> tuple[Inventory, list[HostConfig]]:
    if inventory is None:
        raise UsageError("no inventory given", hint="pass -i PATH or set DDTREE_INVENTORY (start from inventory/example.yaml)",
                         code="inventory_missing")
    from ddtree_ops.inventory import load_inventory

    inv = load_inventory(inventory)
    return inv, inv.select(limit)


def finish(command: str, hosts: Sequence[HostConfig], results: Sequence[HostResult], json_output: bool,
           render: Any = None, extra: dict[str, Any] | None = None) -> None:
    """Render (table or --json), notices and failures, the one-line summary on stderr; exit 0/1.

    `extra` adds keys to the --json document (e.g. promote's batches and untouched hosts)."""
    from ddtree_ops.fleet import exit_code
    from ddtree_ops.output import emit_json, print_failures, print_notices
    from ddtree_ops.release import summary

    summ = summary(results)
    if json_output:
        emit_json({"command": command, "results": [r.to_dict() for r in results], "summary": summ, **(extra or {})})
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
    raise typer.Exit(exit_code(results))


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
