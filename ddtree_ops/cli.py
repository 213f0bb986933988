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
    DebugOption,
    InventoryOption,
    JsonOption,
    LimitOption,
    Session,
    emit_document,
    finish,
    load_selection,
    reported_errors,
)
from ddtree_ops.fleet import DEFAULT_CONCURRENCY, EXIT_INTERRUPTED

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
    # --install-completion / --show-completion, and completion of commands, options and inventory hosts.
    add_completion=True,
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
    debug: DebugOption = False,
) -> None:
    """Ship the DDTree speculative-decoding patch set to SGLang GPU fleets: safely, host by host."""


@app.command()
def status(
    inventory: InventoryOption = None,
    limit: LimitOption = None,
    json_output: JsonOption = False,
    debug: DebugOption = False,
    concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
) -> None:
    """Per-host facts: OS, SGLang, service, release, lock, GPUs, disk.

    One row per selected host (columns that do not fit the terminal are left out and named; --json
    has them all). Exit code 1 when any host failed or was unreachable; the others are still reported.
    A host whose release was made for another SGLang than the one installed (upgraded under it) is shown
    STALE in red with its repair; its facts were read, so it does not change the exit code (scripts: the
    --json field results[].data.release.stale), and push, rollback, promote and smoke refuse it.
    """
    with reported_errors(json_output, "status"):
        inv, hosts = load_selection(inventory, limit)
        from ddtree_ops.facts import collect_facts
        from ddtree_ops.output import print_status_table, progress_for

        progress = progress_for(hosts, "status", json_mode=json_output)
        with progress or nullcontext():
            results = collect_facts(inv, hosts, concurrency=concurrency, progress=progress)
    finish("status", hosts, results, json_output, print_status_table)


@app.command()
def hosts(
    inventory: InventoryOption = None,
    limit: LimitOption = None,
    json_output: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """List the selected hosts with their layered settings (no SSH).

    Validates the inventory and shows what --limit selects, after all < group < host layering.
    """
    with reported_errors(json_output, "hosts"):
        _, selected = load_selection(inventory, limit, ssh=False)
        from ddtree_ops.fleet import HostResult
        from ddtree_ops.output import print_hosts_table

        results = [HostResult(h.name, "ok", data={"groups": list(h.groups), **h.public_dict()}) for h in selected]
    finish("hosts", selected, results, json_output, print_hosts_table)


# build lives in bundle_cli.py; push, smoke, rollback, history, unlock in release_cli.py; promote in
# promote_cli.py. They import cli_common, never this module.
bundle_cli.register(app)
release_cli.register(app)
promote_cli.register(app)


def _command_of(argv: list[str]) -> str:
    """The command a command line names (`status`, `lab up`), for the --json document of a usage error."""
    words = [a for a in argv if not a.startswith("-")]
    return " ".join(words[:2]) if words[:1] == ["lab"] else (words[0] if words else "ddtree-ops")


def main() -> None:
    """Console entry point. Usage errors print click's message (and, with --json, the error document);
    unexpected exceptions print one line unless --debug asks for the traceback."""
    argv = sys.argv[1:]
    debug = Session.debug or "--debug" in argv
    json_mode = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    try:
        code = app(prog_name="ddtree-ops", standalone_mode=False)
    except typer.TyperException as exc:  # a bad option or value: click's usage errors
        show = getattr(exc, "show", None)
        show() if callable(show) else sys.stderr.write(f"error: {exc.format_message()}\n")
        if json_mode:
            emit_document(_command_of(argv), exc.exit_code, error={
                "code": "usage", "message": exc.format_message(), "hint": "see `ddtree-ops COMMAND --help`"})
        sys.exit(exc.exit_code)
    except typer.Abort:  # a confirmation prompt answered with Ctrl-C or end of input
        sys.stderr.write("aborted: nothing was done\n")
        if json_mode:
            emit_document(_command_of(argv), EXIT_INTERRUPTED, error={"code": "aborted", "message": "aborted at the prompt"})
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:
        if debug:
            raise
        message = f"internal error: {type(exc).__name__}: {exc}"
        hint = "this is a ddtree-ops bug; rerun with --debug for the traceback"
        if json_mode:
            emit_document(_command_of(argv), EXIT_HOST_FAILED, error={"code": "internal", "message": message, "hint": hint})
        sys.stderr.write(f"{message}\nhint: {hint}\n")
        sys.exit(EXIT_HOST_FAILED)
    sys.exit(code or 0)
