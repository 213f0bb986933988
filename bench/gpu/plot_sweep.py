#!/usr/bin/env python3
"""Plot a DDTree budget-sweep result JSON as one PNG: accept length and tokens/s against tree budget.

Usage: python bench/gpu/plot_sweep.py SWEEP.json OUT.png   → writes OUT.png, prints its path

Needs matplotlib (not a project dependency; any venv will do, the script only reads the JSON).

Input schema:

    {
      "title": str,                      # optional, becomes the figure's suptitle
      "configs": [
        {"name": "plain" | "dflash" | "full_b64" | "full_b64_cap4" | "full_b64_kc" | "full_b64_cap4_kc" | ...,
         "mode": "plain" | "dflash" | "full",
         "budget": int | null,           # DDTree node budget (full mode); swept over 15, 32, 64, 128, 256
         "cap": int | null,              # depth cap, e.g. 4; null = no cap
         "keep_chain": bool,
         "results": {                    # by workload ("greedy", "t0.8"), then by batch ("bs1", "bs32")
           "greedy": {
             "bs1": {"accept": float | null,       # mean accept length: tokens per verify step, bonus included
                     "ms_per_step": float | null,  # not plotted
                     "tok_s": float | null},       # decode throughput, tokens/s
             "bs32": {...}},
           "t0.8": {...}}},
        ...
      ]
    }

Any config, workload, batch or field may be missing or null (a server that failed to start or serve):
that point is skipped. A config without "mode" / "budget" / "cap" / "keep_chain" gets them from its name
("full_b64_cap4_kc").

Figure: 2 x 4 panels. Columns are (greedy, bs1), (greedy, bs32), (t0.8, bs1), (t0.8, bs32); row 1 is
mean accept length, row 2 tokens/s, both against budget on a log2 axis. One line per DDTree variant
(depth cap x keep-chain); DFLASH is a dashed and plain decoding a dotted horizontal line. Plain's accept
length is 1 by definition, so it is drawn in the tokens/s row only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MISSING_MPL = "plot_sweep.py needs matplotlib: pip install matplotlib (in any venv; it only reads the JSON)"
PANELS = [("greedy", "bs1"), ("greedy", "bs32"), ("t0.8", "bs1"), ("t0.8", "bs32")]
ROWS = [("accept", "mean accept length (tokens / step)"), ("tok_s", "tokens/s")]
RELATIVE_ROW = ("tok_s_x_dflash", "tokens/s / DFLASH's (same call)")
DEFAULT_BUDGETS = [15, 32, 64, 128, 256]

# Variant key: (depth cap or None, keep_chain). The four expected variants get fixed styles so that a
# figure with a variant missing still colours the others as every other figure does.
VARIANT_STYLES: dict[tuple[int | None, bool], dict[str, Any]] = {
    (None, False): {"color": "tab:blue", "marker": "o", "linestyle": "-"},
    (None, True): {"color": "tab:green", "marker": "s", "linestyle": "-."},
    (4, False): {"color": "tab:red", "marker": "^", "linestyle": "-"},
    (4, True): {"color": "tab:purple", "marker": "D", "linestyle": "-."},
}
EXTRA_COLORS = ["tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
BASELINES = {
    "dflash": {"label": "DFLASH", "color": "black", "linestyle": "--", "linewidth": 1.5},
    "plain": {"label": "plain", "color": "tab:gray", "linestyle": ":", "linewidth": 2.0},
}


def number(v: Any) -> float | None:
    """A finite float, or None for anything else (null, a string, NaN, a bool)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def describe(cfg: dict[str, Any]) -> tuple[str | None, int | None, int | None, bool]:
    """(mode, budget, cap, keep_chain), falling back to the name where the field is absent.

    Only an absent key falls back: an explicit null cap means "no cap", not "look at the name".
    """
    name = str(cfg.get("name") or "")
    mode = cfg.get("mode")
    if "mode" not in cfg:
        mode = "full" if name.startswith("full") else name if name in ("plain", "dflash") else None

    def int_field(key: str, pattern: str) -> int | None:
        if key in cfg:
            v = number(cfg[key])
            return int(v) if v is not None else None
        m = re.search(pattern, name)
        return int(m.group(1)) if m else None

    budget = int_field("budget", r"_b(\d+)")
    cap = int_field("cap", r"_cap(\d+)")
    kc = bool(cfg["keep_chain"]) if "keep_chain" in cfg else bool(re.search(r"_kc(_|$)", name))
    return (mode if isinstance(mode, str) else None), budget, cap, kc


def value(cfg: dict[str, Any], workload: str, batch: str, field: str) -> float | None:
    node: Any = cfg.get("results")
    for key in (workload, batch, field):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return number(node)


def variant_label(key: tuple[int | None, bool]) -> str:
    cap, kc = key
    return f"DDTree, {'no cap' if cap is None else f'cap {cap}'}, keep-chain {'on' if kc else 'off'}"


def collect(
    configs: list[Any],
) -> tuple[dict[tuple[int | None, bool], dict[int, dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Sort configs into DDTree variants (by budget) and baselines; warn on what gets dropped."""
    variants: dict[tuple[int | None, bool], dict[int, dict[str, Any]]] = {}
    baselines: dict[str, dict[str, Any]] = {}
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, dict):
            print(f"warning: configs[{i}] is not an object, skipped", file=sys.stderr)
            continue
        mode, budget, cap, kc = describe(cfg)
        name = cfg.get("name", f"configs[{i}]")
        if mode in BASELINES:
            # A second DFLASH/plain run would need its own line; the first is kept so the plot stays
            # readable, and the warning says the JSON had more.
            if mode in baselines:
                print(f"warning: second {mode} config {name!r} ignored", file=sys.stderr)
            else:
                baselines[mode] = cfg
        elif mode == "full":
            if budget is None or budget <= 0:
                print(f"warning: full config {name!r} has no usable budget, skipped", file=sys.stderr)
                continue
            by_budget = variants.setdefault((cap, kc), {})
            if budget in by_budget:
                print(
                    f"warning: duplicate {variant_label((cap, kc))} b{budget} ({name!r}) ignored",
                    file=sys.stderr,
                )
            else:
                by_budget[budget] = cfg
        else:
            print(f"warning: config {name!r} has unknown mode {mode!r}, skipped", file=sys.stderr)
    return variants, baselines


def styles_for(keys: list[tuple[int | None, bool]]) -> dict[tuple[int | None, bool], dict[str, Any]]:
    out: dict[tuple[int | None, bool], dict[str, Any]] = {}
    extra = 0
    for key in keys:
        if key in VARIANT_STYLES:
            out[key] = VARIANT_STYLES[key]
        else:
            out[key] = {
                "color": EXTRA_COLORS[extra % len(EXTRA_COLORS)],
                "marker": "v",
                "linestyle": "-." if key[1] else "-",
            }
            extra += 1
    return out


def batch_label(batch: str) -> str:
    m = re.fullmatch(r"bs(\d+)", batch)
    return f"batch {m.group(1)}" if m else batch


def draw_panel(
    ax: Axes,
    workload: str,
    batch: str,
    field: str,
    variants: dict[tuple[int | None, bool], dict[int, dict[str, Any]]],
    baselines: dict[str, dict[str, Any]],
    styles: dict[tuple[int | None, bool], dict[str, Any]],
    ticks: list[int],
) -> None:
    drew = False
    for key in sorted(variants, key=lambda k: (k[0] is not None, k[0] or 0, k[1])):
        # NaN at a budget without a result breaks the line there, so a failed server shows as a gap
        # instead of a straight segment that looks like a measurement.
        ys = [value(variants[key][b], workload, batch, field) if b in variants[key] else None for b in ticks]
        if any(y is not None for y in ys):
            ax.plot(
                ticks, [math.nan if y is None else y for y in ys], markersize=6, linewidth=1.8, **styles[key]
            )
            drew = True
    for mode, style in BASELINES.items():
        # Plain decoding accepts exactly one token per step; a line at 1 only squashes the DDTree curves.
        if mode not in baselines or (mode == "plain" and field == "accept"):
            continue
        v = value(baselines[mode], workload, batch, field)
        if v is not None:
            ax.axhline(v, **{k: s for k, s in style.items() if k != "label"})
            drew = True
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    # A little room either side so the end markers are not clipped at the axes edge.
    ax.set_xlim(ticks[0] / 1.25, ticks[-1] * 1.25)
    ax.grid(True, alpha=0.3)
    if not drew:
        # Matplotlib's default 0..1 scale would read as measured values.
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="tab:gray")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a DDTree budget-sweep JSON to a PNG.")
    parser.add_argument("sweep", type=Path, help="sweep result JSON")
    parser.add_argument("out", type=Path, help="output PNG path")
    parser.add_argument("--relative", action="store_true",
                        help="tokens/s over the same call's DFLASH (tok_s_x_dflash, pair_sweep.py merge)")
    args = parser.parse_args(argv)
    rows = [ROWS[0], RELATIVE_ROW] if args.relative else ROWS

    # Imported here, not at the top, so the missing-dependency message replaces a traceback.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print(MISSING_MPL, file=sys.stderr)
        return 2

    try:
        data = json.loads(args.sweep.read_text())
    except (OSError, ValueError) as e:
        print(f"plot_sweep.py: cannot read {args.sweep}: {e}", file=sys.stderr)
        return 1
    if not isinstance(data, dict):
        data = {}
    configs = data.get("configs")
    if not isinstance(configs, list):
        print(f"warning: {args.sweep} has no 'configs' list; plotting empty panels", file=sys.stderr)
        configs = []

    variants, baselines = collect(configs)
    # Budgets whose every run failed stay off the axis: an empty tick only widens the plot.
    ticks = (
        sorted(
            {
                b
                for by_budget in variants.values()
                for b, cfg in by_budget.items()
                if any(value(cfg, w, bs, f) is not None for w, bs in PANELS for f, _ in rows)
            }
        )
        or DEFAULT_BUDGETS
    )
    styles = styles_for(list(variants))

    fig, axes = plt.subplots(len(rows), len(PANELS), figsize=(18, 8), squeeze=False)
    for r, (field, ylabel) in enumerate(rows):
        for c, (workload, batch) in enumerate(PANELS):
            ax = axes[r][c]
            draw_panel(ax, workload, batch, field, variants, baselines, styles, ticks)
            if r == 0:
                ax.set_title(f"{workload}, {batch_label(batch)}")
            if c == 0:
                ax.set_ylabel(ylabel)
            if r == len(rows) - 1:
                ax.set_xlabel("tree budget (nodes)")

    # One legend for the figure, built from proxies: a variant may be absent from the first panel (or
    # from all of one row), so harvesting one axes' handles would drop entries.
    handles: list[Line2D] = []
    for key in sorted(variants, key=lambda k: (k[0] is not None, k[0] or 0, k[1])):
        handles.append(Line2D([], [], markersize=6, linewidth=1.8, label=variant_label(key), **styles[key]))
    for mode, style in BASELINES.items():
        if mode in baselines:
            handles.append(Line2D([], [], **style))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=10)
    title = data.get("title")
    if isinstance(title, str) and title:
        fig.suptitle(title, fontsize=14)
    # Leave a strip at the bottom for the legend and, with a suptitle, one at the top.
    fig.tight_layout(rect=(0, 0.05 if handles else 0, 1, 0.96 if title else 1))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
