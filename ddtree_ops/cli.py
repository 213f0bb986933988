"""`ddtree-ops`: the Typer app. It owns the root (--version, --debug), `status` and `hosts`, and
mounts the other command modules (bundle_cli, release_cli, promote_cli), which take their shared
options and helpers from cli_common (conventions documented there) and never import this module.

Heavy libraries (fabric, paramiko, pydantic, rich, httpx, torch) are imported inside commands so
`--help` stays fast.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from ddtree_ops import __version__, bundle_cli, promote_cli, release_cli
from ddtree_ops.cli_common import (
    EXIT_HOST_FAILED,
    ConcurrencyOption,
    InventoryOption,
    JsonOption,
    LimitOption,
    Session,
    load_selection,
    reported_errors,
)
from ddtree_ops.fleet import DEFAULT_CONCURRENCY

# Sub-apps owned by other modules, mounted on first use so `--help` does not import them (and
# the rich console they pull in): name -> (module, attribute, one-line help for the listing).
LAZY_SUBAPPS = {
    "lab": ("ddtree_ops.lab.cli", "lab_app", "The local rehearsal fleet: lab up|down|status."),
}


class _LazyGroup(TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return names + [n for n in LAZY_SUBAPPS if n not in names and _importable(LAZY_SUBAPPS[n][0])]

    def get_command(self, ctx: Any, name: str) -> Any:
        if name in LAZY_SUBAPPS and name not in self.commands and _importable(LAZY_SUBAPPS[name][0]):
            import importlib

            module, attribute, short_help = LAZY_SUBAPPS[name]
            command = typer.main.get_command(getattr(importlib.import_module(module), attribute))
            command.name, command.short_help = name, short_help
            self.add_command(command, name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in LAZY_SUBAPPS and name not in self.commands:
                rows.append((name, LAZY_SUBAPPS[name][2]))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                # The whole first sentence, wrapped if need be: a description cut off by "..." reads as broken.
                rows.append((name, command.get_short_help_str(limit=150)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


app = typer.Typer(
    name="ddtree-ops",
    cls=_LazyGroup,
    help="Ship the DDTree speculative-decoding patch set to SGLang GPU fleets: safely, host by host.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich-formatted help costs ~100 ms of imports on every `--help`.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree-ops {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                          help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors (also DDTREE_DEBUG=1).")] = False,
) -> None:
    """Ship the DDTree speculative-decoding patch set to SGLang GPU fleets: safely, host by host."""
    Session.debug = Session.debug or debug



@app.command()
def status(
    inventory: InventoryOption = None,
    limit: LimitOption = None,
    json_output: JsonOption = False,
    concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
) -> None:
    """Per-host facts: OS, SGLang, service, release, lock, GPUs, disk.

    One row per selected host (or, with --json, a list of per-host results). Exit code 1 when
    any host failed or was unreachable; the others are still reported.
    """
    with reported_errors(json_output):
        inv, hosts = load_selection(inventory, limit)
        from ddtree_ops.facts import collect_facts
        from ddtree_ops.fleet import exit_code
        from ddtree_ops.output import (
            emit_json,
            print_failures,
            print_notices,
            print_status_table,
            progress_for,
        )

        progress = progress_for(hosts, "status", json_mode=json_output)
        with progress or nullcontext():
            results = collect_facts(inv, hosts, concurrency=concurrency, progress=progress)
        if json_output:
            emit_json([{"address": h.address, "port": h.port, **r.to_dict()} for h, r in zip(hosts, results, strict=True)])
        else:
            print_status_table(hosts, results)
        print_notices(results)
        print_failures(results, debug=Session.debug)
    raise typer.Exit(exit_code(results))


@app.command()
def hosts(
    inventory: InventoryOption = None,
    limit: LimitOption = None,
    json_output: JsonOption = False,
) -> None:
    """List the selected hosts with their layered settings (no SSH).

    Validates the inventory and shows what --limit selects, after all < group < host layering.
    """
    with reported_errors(json_output):
        _, selected = load_selection(inventory, limit)
        rows: list[dict[str, Any]] = [{"name": h.name, "groups": list(h.groups), **h.public_dict()} for h in selected]
        if json_output:
            from ddtree_ops.output import emit_json

            emit_json(rows)
            return
        from rich.table import Table

        from ddtree_ops.output import stdout_console

        table = Table()
        for column in ("host", "groups", "address", "user", "python", "service", "state dir", "jump"):
            table.add_column(column)
        for h in selected:
            table.add_row(h.name, ",".join(h.groups) or "-", f"{h.address}:{h.port}", h.user, h.python, h.service,
                          h.state_dir, h.jump_host or "-")
        stdout_console().print(table)


# build lives in bundle_cli.py; push, smoke, rollback, history, unlock in release_cli.py; promote in
# promote_cli.py. They import cli_common, never this module.
bundle_cli.register(app)
release_cli.register(app)
promote_cli.register(app)


def main() -> None:
    """Console entry point: unexpected exceptions print one line unless --debug asks for the traceback."""
    debug = Session.debug or "--debug" in sys.argv[1:]
    try:
        app(prog_name="ddtree-ops")
    except Exception as exc:
        if debug:
            raise
        sys.stderr.write(f"internal error: {type(exc).__name__}: {exc}\n"
                         "hint: this is a ddtree-ops bug; rerun with --debug for the traceback\n")
        sys.exit(EXIT_HOST_FAILED)
