"""Running the lab's external commands: every long step logs to a file, and a failure names the step."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Called with a short human message ("building base image: debootstrap bookworm"), so the CLI
# can show which step of a minutes-long build it is on.
Progress = Callable[[str], None]


def no_progress(_message: str) -> None:
    pass


class LabError(RuntimeError):
    """A lab step failed; the message names the step and carries the tail of its log."""


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def run_step(step: str, argv: Sequence[str | Path], log: Path, *, timeout: float | None = None) -> None:
    """Run argv with its output appended to `log`; raise LabError naming `step` on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [str(a) for a in argv]
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S')} {step}: {args}\n")
        out.flush()
        try:
            proc = subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except FileNotFoundError as exc:
            raise LabError(
                f"{step}: {args[0]} is not installed ({exc}); "
                "install the lab's apt packages (ddtree_ops.lab.image.required_apt_packages())"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise LabError(
                f"{step} did not finish within {timeout:.0f} s; log: {log}\n{log_tail(log)}"
            ) from exc
        out.write(f"### {step}: exit {proc.returncode} after {time.monotonic() - started:.1f} s\n")
    if proc.returncode != 0:
        raise LabError(f"{step} failed (exit {proc.returncode}); log: {log}\n{log_tail(log)}")


def capture(argv: Sequence[str | Path], *, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a short command and capture its output (no check: callers decide what failure means)."""
    return subprocess.run(
        [str(a) for a in argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def on_each(items: Sequence[T], work: Callable[[T], object]) -> None:
    """work(item) for every item, a few at a time (lab work per host is mostly waiting on ssh);
    re-raises the first error in the items' order once all have finished."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(items)))) as pool:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
