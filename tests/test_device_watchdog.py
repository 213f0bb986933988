"""bench/gpu/device_env.sh's deadline watchdog, in bash as the device scripts use it: stopped before
its deadline it neither fires nor keeps the caller's output pipe open (a sleep left behind held every
device call's `| tee` until its deadline); left running, it fires at the deadline."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ENV_SH = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "device_env.sh"


def _run(tmp_path: Path, deadline_s: int, work_s: float, stop: bool) -> tuple[str, float]:
    script = f"""
OUT={tmp_path}/out; source {ENV_SH}
fired() {{ echo FIRED; }}
start_watchdog {deadline_s} fired
sleep {work_s}
{"stop_watchdog" if stop else ""}
echo end
"""
    t0 = time.monotonic()
    # read through a pipe, as `bash run_device.sh | tee` does: the call ends when every writer closes it
    out = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, text=True, timeout=60).stdout
    return out, time.monotonic() - t0


def test_a_stopped_watchdog_neither_fires_nor_holds_the_pipe(tmp_path: Path) -> None:
    out, took = _run(tmp_path, deadline_s=20, work_s=0.5, stop=True)
    assert out.split() == ["end"]
    assert took < 10, f"the pipe stayed open {took:.1f} s: the watchdog's sleep outlived it"


def test_a_watchdog_left_running_fires_at_its_deadline(tmp_path: Path) -> None:
    out, took = _run(tmp_path, deadline_s=1, work_s=2, stop=False)
    assert out.split() == ["FIRED", "end"]
    assert 1.5 < took < 10
