"""CLI command `promote`: a thin wrapper over rollout.py.

Registered on the main app by `register(app)` (called from cli.py); options from cli_common.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_ops.cli_common import (
    ConcurrencyOption,
    DebugOption,
    InventoryOption,
    JsonOption,
    LimitOption,
    LockWaitOption,
    finish,
    load_selection,
    reported_errors,
    table,
    terminate_like_ctrl_c,
)
from ddtree_ops.errors import UsageError
from ddtree_ops.fleet import DEFAULT_CONCURRENCY

if TYPE_CHECKING:
    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig

HELP = """Promote hosts to a DDTree mode, behind gates, with automatic rollback.

Per host, under the host lock: record a baseline (the canary's greedy outputs on the service as it
runs now; full mode uses the host's recorded shadow-linear canary), back up the unit, install the
unit rendered from the templates (linted with systemd-analyze verify first), daemon-reload, restart,
then the gates in order: ready (/health_generate within the start timeout while the unit stays
active) → settings (/server_info reports DFLASH, the mode, budget, cap) → canary (greedy outputs
token-identical to the baseline: concurrent requests, a prompt near the context limit, long
generations, a shared prefix twice) → liveness (greedy and sampled requests at once finish in a
bound) → acceptance (full only: accept length ≥ shadow-linear × (1 + acceptance_margin), tree
steps seen). A gate that fails rolls the host back to its previous unit, restarts it and checks it
serves the baseline again; the host is reported failed with the gate, the reason and the evidence
(JSON under the host's state dir and in --evidence-dir).

Every stage is commit-confirmed: the host installs it with a confirm deadline (confirm_timeout_s,
renewed by this run's heartbeat while its gates run) and puts the previous unit back by itself
unless promote confirms the stage in time. If promote is killed, hangs or loses the network, each
host ends on its previous unit or on a confirmed new one, never on an unconfirmed one.

Fleet order: the `canary` group (or the first --batch) alone, then the --batch sizes (Ansible
serial: counts or percentages, the last repeats). The rollout stops after a batch once more hosts
failed than --max-fail allows; hosts not reached are untouched and listed.

Stage order: full needs a passed shadow-linear on that host (unless --force); full on a hybrid
target is refused before any change unless the installed payload has proven its layer type on its
architecture (Gated DeltaNet on Qwen3-Next and Qwen3.5, dense and MoE, today; `--mode full
--dry-run` shows each host's verdict). A host whose release is not a DDTree payload is refused
(push first), and so is a unit changed by hand since ddtree-ops installed it (unless --adopt).
--dry-run reports the refusals a real run would make, and exits as it would.
"""


def _gate_cells(gates: list[dict]) -> str:
    mark = {"pass": "✓", "fail": "✗", "inconclusive": "?"}
    return " ".join(f"{g['gate']}{mark.get(g['verdict'], '?')}" for g in gates) or "-"


def _render(hosts: list[HostConfig], results: list[HostResult]) -> None:
    from ddtree_ops.output import stdout_console

    console = stdout_console()
    if any((r.data or {}).get("dry_run") for r in results):
        for r in results:
            d = r.data or {}
            if not r.ok:
                console.print(f"[red]{r.host}[/red]: {r.error.message if r.error else r.status}")
                continue
            console.print(f"[bold]{r.host}[/bold]: {d['current_mode'] or 'not promoted'} → {d['mode']} "
                          f"({d['unit_path']}; service {d['service'].get('ActiveState')}; lint "
                          f"{'ok' if d['lint'].get('ok') else 'FAILS'}, exposure {d['lint'].get('exposure')})")
            if d.get("first_installs_off_stage"):
                console.print("  no unit yet: the off stage (plain DFLASH) is installed and gated first, as the baseline")
            for ref in d.get("refusals", []):
                console.print(f"  [red]refused[/red] {ref['message']}")
            if d.get("interrupted"):
                console.print(f"  [yellow]interrupted[/yellow] promote {d['interrupted'].get('mode')} in flight: "
                              "undone first")
            console.print("  gates: " + "\n         ".join(d["gate_plan"]))
            console.print(d["unit_diff"] or "  (unit unchanged)", markup=False, highlight=False)
        return
    t = table(["host", "status", "mode", "gates", "accept", "exposure", "tool / waiting", "result"])
    for r in results:
        d = r.data or {}
        if r.ok:
            timing = d.get("timing") or {}
            t.add_row(r.host, r.status, d.get("mode", "-"), _gate_cells(d.get("gates") or []),
                      f"{d['accept_length']:.2f}" if d.get("accept_length") is not None else "-",
                      str(d.get("exposure") or "-"),
                      f"{timing.get('tool_s', 0):.1f}s / {timing.get('waiting_for_service_s', 0):.1f}s", "passed")
        else:
            detail = (r.error.detail if r.error else None) or {}
            t.add_row(r.host, r.status, "-", _gate_cells(detail.get("gates") or []), "-", "-",
                      f"{r.elapsed_s:.1f}s", r.error.code if r.error else "-", style="red")
    console.print(t)


def register(app: typer.Typer) -> None:
    @app.command(help=HELP)
    def promote(
        mode: Annotated[str, typer.Option("--mode", "-m", metavar="shadow-linear|full",
                                          help="Stage to promote to.")],
        inventory: InventoryOption = None,
        limit: LimitOption = None,
        batch: Annotated[str, typer.Option("--batch", metavar="SIZES",
                                           help="Batch sizes after the canary: counts or percentages, comma-"
                                                "separated; the last repeats (Ansible serial).")] = "1,25%,100%",
        max_fail: Annotated[str, typer.Option("--max-fail", metavar="N|P%",
                                              help="Failed hosts tolerated before the rollout stops.")] = "0",
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Per host: the unit diff against what is "
                                                                  "installed, lint, the gate plan; change nothing.")] = False,
        force: Annotated[bool, typer.Option("--force", help="full without a recorded shadow-linear pass "
                                                              "(the baseline is then the service as it runs now).")] = False,
        on_inconclusive: Annotated[str, typer.Option("--on-inconclusive", metavar="fail|pause",
                                                     help="An inconclusive gate fails the host (default), or "
                                                          "pauses: the host stays as it is and the rollout stops.")] = "fail",
        allow_hybrid_unsafe: Annotated[bool, typer.Option("--allow-hybrid-unsafe",
                                                          help="Refused: there is no unsafe override. Full mode "
                                                               "on a hybrid target runs where the payload has "
                                                               "proven its layer type and architecture.")] = False,
        prompts: Annotated[Path | None, typer.Option("--prompts", metavar="FILE",
                                                     help='More canary prompts, JSON lines {"text": ..., '
                                                          '"max_new_tokens": N}.')] = None,
        liveness_bound: Annotated[float, typer.Option("--liveness-bound", min=1, metavar="SECONDS",
                                                      help="Mixed greedy/sampled requests must finish within this.")] = 120.0,
        gate_timeout: Annotated[float, typer.Option("--gate-timeout", min=1, metavar="SECONDS",
                                                    help="Wall-clock bound of the settings, canary and acceptance "
                                                         "gates each (a server that drips its answers fails it).")] = 600.0,
        pause_for: Annotated[float, typer.Option("--pause-for", min=1, metavar="SECONDS",
                                                 help="With --on-inconclusive pause: how long the paused stage stays "
                                                      "installed for inspection before the host puts its previous "
                                                      "unit back by itself.")] = 600.0,
        adopt: Annotated[bool, typer.Option("--adopt", help="Replace a unit or env file changed by hand since "
                                                              "ddtree-ops installed it (what was found is kept).")] = False,
        start_timeout: Annotated[float | None, typer.Option("--start-timeout", min=1, metavar="SECONDS",
                                                            help="Ready gate timeout (default: the host's "
                                                                 "start_timeout_s).")] = None,
        evidence_dir: Annotated[Path, typer.Option("--evidence-dir", help="Local copy of each host's evidence "
                                                                           "(RUN_ID/HOST-MODE.json).")] = Path("evidence"),
        lock_wait: LockWaitOption = 0.0,
        json_output: JsonOption = False,
        debug: DebugOption = False,
        concurrency: ConcurrencyOption = DEFAULT_CONCURRENCY,
    ) -> None:
        with reported_errors(json_output, f"promote --mode {mode}" + (" --dry-run" if dry_run else "")):
            if allow_hybrid_unsafe:
                raise UsageError("--allow-hybrid-unsafe is refused: the payload refuses "
                                 "--speculative-ddtree-allow-hybrid-unsafe at argument parsing (there is no unsafe "
                                 "override; full mode runs on a hybrid target only where its layer type is proven)",
                                 hint="promote hybrid targets to --mode shadow-linear", code="hybrid_unsafe_unsupported")
            inv, hosts = load_selection(inventory, limit)
            from ddtree_ops import gates, rollout
            from ddtree_ops.output import progress_for

            opts = rollout.PromoteOptions(mode=mode, dry_run=dry_run, force=force, on_inconclusive=on_inconclusive,
                                          prompts=gates.load_prompt_file(prompts) if prompts else [],
                                          liveness_bound_s=liveness_bound, start_timeout_s=start_timeout,
                                          evidence_dir=evidence_dir, lock_wait_s=lock_wait, gate_timeout_s=gate_timeout,
                                          pause_for_s=pause_for, adopt=adopt)
            title = f"promote {mode}" + (" (dry run)" if dry_run else "")
            progress = progress_for(hosts, title, json_mode=json_output)
            with terminate_like_ctrl_c(), progress or nullcontext():
                report = rollout.promote(inv, hosts, opts, batch=batch, max_fail=max_fail, concurrency=concurrency,
                                         progress=progress)
            if report.stopped:
                sys.stderr.write(f"stopped: {report.stopped}\n")
        by_name = {h.name: h for h in hosts}
        finish(f"promote --mode {mode}" + (" --dry-run" if dry_run else ""),
               [by_name[r.host] for r in report.results], report.results, json_output, _render, report.extra())
