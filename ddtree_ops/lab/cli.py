"""`ddtree-ops lab up|down|status`: the local rehearsal fleet.

Mounted by the main CLI with `app.add_typer(lab_app, name="lab")`. Only typer and rich are
imported here; the lab's modules load inside the commands.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ddtree_ops.cli_common import DebugOption

if TYPE_CHECKING:
    from ddtree_ops.lab.fleet import LabStatus

lab_app = typer.Typer(
    name="lab",
    help="The local rehearsal fleet: systemd-nspawn hosts with sshd and SGLang on a private bridge "
    "(10.200.0.0/24). Needs root.",
    no_args_is_help=True,
    add_completion=False,
)

RepoRoot = Annotated[
    Path,
    typer.Option(
        "--repo-root", help="Checkout whose inventory/ receives lab.yaml.", show_default="current directory"
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]


def _progress(console: Console, as_json: bool) -> Callable[[str], None]:
    """Progress lines with elapsed time, on stderr so that --json stdout stays a single object."""
    started = time.monotonic()

    def report(message: str) -> None:
        if as_json:
            print(f"[{time.monotonic() - started:5.0f}s] {message}", file=sys.stderr, flush=True)
        else:
            console.log(f"[dim]{time.monotonic() - started:5.0f}s[/] {message}")

    return report


def _fail(console: Console, exc: Exception, as_json: bool = False, command: str = "lab") -> typer.Exit:
    console.print(f"[bold red]lab:[/] {exc}", highlight=False)
    if as_json:
        from ddtree_ops.output import document

        print(json.dumps(document(command, 1, error={"code": "lab", "message": str(exc), "hint": None}), indent=2))
    return typer.Exit(1)


@lab_app.command("up")
def up(
    hosts: Annotated[int, typer.Option("--hosts", "-n", min=1, help="Number of hosts: lab-1 … lab-N.")] = 3,
    sglang: Annotated[
        list[str] | None,
        typer.Option("--sglang", metavar="HOST=VERSION",
                     help="Run this host on another SGLang the image carries (0.5.23), for a mixed-version fleet; "
                          "repeatable. Hosts not named run 0.5.13.post1; a host that changes version is recreated."),
    ] = None,
    repo_root: RepoRoot = Path("."),
    as_json: JsonFlag = False,
    debug: DebugOption = False,
) -> None:
    """Boot lab-1 … lab-N (building the cached base image first if needed) and write inventory/lab.yaml.

    Idempotent: hosts already running stay; missing ones are created; hosts above N are removed. The first run builds the base image (debootstrap + SGLang venv, about 5 minutes, cached under /var/cache/ddtree-ops-lab); later runs boot in seconds. Writes inventory/lab.yaml with inventory/lab/id_ed25519 and inventory/lab/known_hosts.
    """
    from ddtree_ops.lab.fleet import lab_up
    from ddtree_ops.lab.steps import LabError

    console = Console(stderr=True, log_path=False)
    report = _progress(console, as_json)
    try:
        versions = _parse_versions(sglang or [])
        if as_json:
            status = lab_up(hosts, repo_root.resolve(), report, sglang=versions)
        else:
            with console.status("lab up …") as spinner:

                def report_and_spin(message: str) -> None:
                    report(message)
                    spinner.update(f"lab up: {message}")

                status = lab_up(hosts, repo_root.resolve(), report_and_spin, sglang=versions)
    except LabError as exc:
        raise _fail(console, exc, as_json, "lab up") from exc
    _render(status, as_json, "lab up")


def _parse_versions(pairs: list[str]) -> dict[str, str]:
    from ddtree_ops.lab.steps import LabError

    out: dict[str, str] = {}
    for pair in pairs:
        host, sep, version = pair.partition("=")
        if not sep or not host or not version:
            raise LabError(f"--sglang {pair!r}: expected HOST=VERSION, e.g. lab-3=0.5.23")
        if out.get(host, version) != version:
            raise LabError(f"--sglang names {host} twice ({out[host]} and {version})")
        out[host] = version
    return out


@lab_app.command("down")
def down(repo_root: RepoRoot = Path("."), debug: DebugOption = False) -> None:
    """Stop every lab host and remove overlays, bridge and inventory/lab.yaml (the base image stays)."""
    from ddtree_ops.lab.fleet import lab_down
    from ddtree_ops.lab.steps import LabError

    console = Console(stderr=True, log_path=False)
    try:
        lab_down(repo_root.resolve(), _progress(console, False))
    except LabError as exc:
        raise _fail(console, exc) from exc


@lab_app.command("status")
def status(repo_root: RepoRoot = Path("."), as_json: JsonFlag = False, debug: DebugOption = False) -> None:
    """Show each lab host: address, whether it runs, whether its ssh port answers. Exit 1 if any is down."""
    from ddtree_ops.lab.fleet import lab_status

    result = lab_status(repo_root.resolve())
    _render(result, as_json, "lab status")
    if not result.all_up:
        raise typer.Exit(1)


def _render(status: LabStatus, as_json: bool, command: str) -> None:
    if as_json:
        from ddtree_ops.fleet import HostResult
        from ddtree_ops.output import document
        from ddtree_ops.release import summary

        # The one --json shape of every command (output.document), the lab's own keys kept beside it.
        results = [HostResult(h.name, "ok" if h.running and h.ssh else "unreachable", data=asdict(h))
                   for h in status.hosts]
        print(json.dumps(document(command, 0 if status.all_up else 1, results=[r.to_dict() for r in results],
                                  summary=summary(results), **status.to_json()), indent=2))
        return
    console = Console()
    if not status.hosts:
        console.print("no lab hosts; run [bold]ddtree-ops lab up[/]")
        return
    table = Table("host", "address", "sglang", "running", "ssh", "pid")
    for h in status.hosts:
        table.add_row(h.name, h.address, h.sglang or "-", _mark(h.running), _mark(h.ssh), str(h.pid or "-"))
    console.print(table)
    if status.inventory_path:
        console.print(f"inventory: {status.inventory_path}")


def _mark(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[red]no[/]"
