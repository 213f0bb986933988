"""Rendering for people (rich, on stderr for progress) and for machines (`--json` on stdout).

With --json, stdout carries exactly one JSON document and nothing else; all human text goes to
stderr. rich is imported only when something is actually drawn, to keep `--help` fast.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddtree_ops.errors import OpsError

if TYPE_CHECKING:
    from rich.console import Console

    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()


def document(command: str, exit_code: int, *, results: Sequence[dict[str, Any]] = (), summary: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None, warnings: Sequence[dict[str, Any]] = (), **extra: Any) -> dict[str, Any]:
    """The one shape of every --json document, whatever the command and however it ended:

        command    the command as run (`push`, `push --dry-run`, `lab status`, ...)
        ok         true exactly when exit_code is 0
        exit_code  what the process exits with (0, 1, 2, 130)
        error      null, or {code, message, hint, ...} when the command as a whole failed
        warnings   inventory warnings, [{path, line, message, hint}, ...]
        results    one entry per host: {host, status, data, error, elapsed_s, notices} ([] for build)
        summary    {hosts, ok, noop, failed, unreachable, interrupted} for commands that work on hosts, else null
    plus the command's own keys (build: bundle, manifest, ...; promote: batches, untouched, ...)."""
    return {"command": command, "ok": exit_code == 0, "exit_code": exit_code, "error": error,
            "warnings": list(warnings), "results": list(results), "summary": summary, **extra}


def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    from rich.console import Console

    # Piped into a file or CI log, rich would assume 80 columns and squash the table's cells
    # into unreadable slivers; give it room unless the caller set COLUMNS.
    piped_width = 200 if not sys.stdout.isatty() and "COLUMNS" not in os.environ else None
    return Console(highlight=False, width=piped_width)


def print_error(exc: OpsError) -> None:
    """`error: <message>` plus `hint:` on stderr; plain text so it also reads well in CI logs."""
    lines = [f"error: {exc.message}"]
    if exc.hint and exc.hint not in exc.message:
        lines.append(f"hint: {exc.hint}")
    sys.stderr.write("\n".join(lines) + "\n")


class RichProgress:
    """FleetProgress drawn with rich on stderr: one line per host with its current step."""

    def __init__(self, hosts: Sequence[HostConfig], title: str) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._lock = threading.Lock()
        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.fields[host]:<16}"), TextColumn("{task.description}"),
            TimeElapsedColumn(), console=stderr_console(), transient=True,
        )
        self._overall = self._progress.add_task(title, total=len(hosts), host="")
        self._tasks = {h.name: self._progress.add_task("waiting", host=h.name, total=1) for h in hosts}

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def host_started(self, host: str) -> None:
        with self._lock:
            self._progress.update(self._tasks[host], description="starting")

    def host_step(self, host: str, step: str) -> None:
        with self._lock:
            self._progress.update(self._tasks[host], description=step)

    def host_finished(self, result: HostResult) -> None:
        with self._lock:
            self._progress.update(self._tasks[result.host], description=result.status, completed=1)
            self._progress.advance(self._overall)


def progress_for(hosts: Sequence[HostConfig], title: str, *, json_mode: bool) -> RichProgress | None:
    """A live display only for a person at a terminal; never with --json or when piped."""
    if json_mode or not sys.stderr.isatty():
        return None
    return RichProgress(hosts, title)


def print_notices(results: Sequence[HostResult]) -> None:
    for r in results:
        for notice in r.notices:
            sys.stderr.write(f"note: {r.host}: {notice}\n")


def print_failures(results: Sequence[HostResult], *, debug: bool = False) -> None:
    """Every failed host with its reason and hint, on stderr, after the main output."""
    for r in results:
        if r.ok or r.error is None:
            continue
        sys.stderr.write(f"{r.status}: {r.error.message}\n")
        if r.error.hint:
            sys.stderr.write(f"  hint: {r.error.hint}\n")
        if debug and r.traceback:
            sys.stderr.write(r.traceback)


# --- status ------------------------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _gpus_cell(gpus: list[dict[str, Any]] | None) -> str:
    if gpus is None:
        return "-"
    if not gpus:
        return "none"
    names: dict[str, int] = {}
    for gpu in gpus:
        names[str(gpu.get("name"))] = names.get(str(gpu.get("name")), 0) + 1
    return ", ".join(f"{count}× {name}" for name, count in names.items())


# Failures that happen before a command could run on the host: SSH itself refused or failed.
_CONNECTION_CODES = {"host_key_unknown", "host_key_changed", "auth_failed", "known_hosts_missing",
                     "known_hosts_invalid", "identity_missing", "ssh_error"}


def _reachable_cell(result: HostResult) -> str:
    if result.status == "unreachable":
        return "no"
    if result.error is not None and result.error.code in _CONNECTION_CODES:
        return f"refused ({result.error.code})"
    return "yes"


def status_row(host: HostConfig, result: HostResult) -> dict[str, str]:
    """One flat row per host (the table's columns); every value is a display string."""
    facts = result.data or {}
    os_info = facts.get("os") or {}
    sglang = facts.get("sglang")
    service = facts.get("service")
    release = facts.get("release")
    lock = facts.get("lock")
    return {
        "host": host.name,
        "address": f"{host.address}:{host.port}" if host.port != 22 else host.address,
        "reachable": _reachable_cell(result),
        "os": " ".join(filter(None, [os_info.get("id"), os_info.get("version_id")])) or "-",
        "python": (facts.get("python") or {}).get("version", "-"),
        # The installed version as a payload base: "0.5.23 v2", "0.5.17 v2 (no payload)" (a --payload tree
        # without its descriptor), "0.5.14 (unknown base)".
        "sglang": ((facts.get("payload_base") or {}).get("label") or (sglang or {}).get("version")
                   or ("absent" if result.ok else "-")),
        "service": f"{service.get('active_state')}/{service.get('sub_state')}" if service else "-",
        # No state file: ddtree-ops never installed here. current null: everything rolled back.
        "release": "-" if not result.ok else ("none" if release is None else _release_cell(release)),
        "mode": (release or {}).get("mode") or "-",
        "last_promote": _promotion_cell((release or {}).get("promotion"), (release or {}).get("in_flight")),
        "lock": (str(lock.get("who") or lock.get("owner") or "held") if lock else ("free" if result.ok else "-")),
        "gpus": _gpus_cell(facts.get("gpus")),
        "free_disk": human_bytes((facts.get("disk") or {}).get("free_bytes")),
        "status": result.status,
    }


def _release_cell(release: dict[str, Any]) -> str:
    """The current release; a stale one (made for another SGLang than the installed one) says so, with the bases."""
    now = release.get("current") or "pristine"
    stale = release.get("stale")
    if not stale:
        return now
    bases = ", ".join(sorted(set((stale.get("release_bases") or {}).values())))
    return f"STALE {now} (for SGLang {bases}, host has {stale.get('installed_version')}; see --json repair)"


def _promotion_cell(promotion: dict[str, Any] | None, in_flight: dict[str, Any] | None = None) -> str:
    """The last promote on a host: mode, result, gate verdicts, accept length; first, a stage in flight."""
    if in_flight:
        left = in_flight.get("restores_in_s")
        return (f"{in_flight.get('mode')} UNCONFIRMED" + (f" (restores itself in {left:.0f}s unless confirmed)"
                                                          if isinstance(left, int | float) else ""))
    if not promotion or not promotion.get("last_mode"):
        return "-"
    marks = {"pass": "✓", "fail": "✗", "inconclusive": "?"}
    gates = " ".join(f"{g.get('gate')}{marks.get(g.get('verdict'), '?')}" for g in promotion.get("gates") or [])
    accept = promotion.get("accept_length")
    return (f"{promotion['last_mode']} {promotion.get('last_result')}"
            + (f" ({gates})" if gates else "") + (f" accept {accept:.2f}" if isinstance(accept, int | float) else ""))


# (key, title); the first STATUS_ESSENTIAL are always shown, the rest in this order while they fit.
STATUS_COLUMNS = {
    "host": "Host", "reachable": "Reachable", "service": "Service", "release": "Release", "mode": "Mode",
    "lock": "Lock", "sglang": "SGLang base", "address": "Address", "last_promote": "Last promote", "free_disk": "Free disk",
    "gpus": "GPUs", "python": "Python", "os": "OS",
}
STATUS_ESSENTIAL = 6


def fit_columns(columns: dict[str, str], rows: Sequence[dict[str, str]], essential: int, width: int) -> list[str]:
    """The columns to draw so that a table of `rows` fits `width` terminal cells without squashing cells into
    slivers: the first `essential` always, then the others in order while each fits whole."""
    from rich.cells import cell_len

    def need(key: str) -> int:  # the widest cell, plus rich's padding and border
        return max([cell_len(columns[key])] + [cell_len(r[key]) for r in rows]) + 3

    keys = list(columns)
    kept = keys[:essential]
    used = sum(need(k) for k in kept) + 1
    for key in keys[essential:]:
        if used + need(key) <= width:
            kept.append(key)
            used += need(key)
    return [k for k in keys if k in kept]


def print_table(columns: dict[str, str], rows: Sequence[dict[str, str]], *, essential: int,
                styles: Sequence[str] | None = None) -> None:
    """A table on stdout with the columns that fit the terminal; the ones left out are named on stderr."""
    from rich.table import Table

    console = stdout_console()
    shown = fit_columns(columns, rows, essential, console.width)
    table = Table(title=None, show_lines=False)
    for key in shown:
        table.add_column(columns[key], no_wrap=key in ("host", "address"))
    for i, row in enumerate(rows):
        table.add_row(*(row[k] for k in shown), style=styles[i] if styles else "")
    console.print(table)
    left_out = [columns[k] for k in columns if k not in shown]
    if left_out:
        sys.stderr.write(f"not shown at {console.width} columns: {', '.join(left_out)} (--json has every field)\n")


def print_status_table(hosts: Sequence[HostConfig], results: Sequence[HostResult]) -> None:
    style = {"ok": "", "failed": "yellow", "unreachable": "red", "interrupted": "yellow"}
    rows = [status_row(h, r) for h, r in zip(hosts, results, strict=True)]
    stale = [((r.data or {}).get("release") or {}).get("stale") if r.ok else None for r in results]
    print_table(STATUS_COLUMNS, rows, essential=STATUS_ESSENTIAL,
                styles=["red" if s else style[r.status] for s, r in zip(stale, results, strict=True)])
    for h, s in zip(hosts, stale, strict=True):
        if s:
            sys.stderr.write(f"{h.name}: STALE release: {s['message']}\n  repair: {s['repair']}\n")


HOSTS_COLUMNS = {"host": "Host", "address": "Address", "user": "User", "jump": "Jump", "groups": "Groups",
                 "service": "Service", "state_dir": "State dir", "python": "Python"}


def print_hosts_table(hosts: Sequence[HostConfig], results: Sequence[HostResult]) -> None:
    rows = [{"host": h.name, "address": f"{h.address}:{h.port}", "user": h.user + (" (sudo)" if h.sudo else ""),
             "jump": h.jump_host or "-", "groups": ",".join(h.groups) or "-", "service": h.service,
             "state_dir": h.state_dir, "python": h.python} for h in hosts]
    print_table(HOSTS_COLUMNS, rows, essential=3)
