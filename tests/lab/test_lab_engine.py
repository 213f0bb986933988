"""The lab engine on the lab fleet: installed by `lab up`, started by the hosts' real systemd, parsing
its ARGS with whatever SGLang the host has (pristine, or patched by a real `push`), decoding through
the pushed ddtree_utils. What only a host can show lives here; the rest is in tests/test_lab_engine_*.

Engines run as transient units (`systemd-run`, unique names, ports 31xxx, --host 0.0.0.0 so the test
probes them over the lab bridge) until promote's unit template is wired in.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shlex
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from ddtree_ops import release
from ddtree_ops.bundle import build_bundle
from ddtree_ops.inventory import load_inventory
from ddtree_ops.lab import engine_files
from ddtree_ops.lab.config import (
    DRAFT_MODEL,
    HYBRID_TARGET_MODEL,
    LAB_MODELS_DIR,
    TARGET_MODEL,
    VENV_DIR,
    LabPaths,
)
from ddtree_ops.lab.engine import faults
from ddtree_ops.lab.engine.decoding import Decoder, Request
from ddtree_ops.lab.engine.model import TinyLM
from ddtree_ops.lab.engine.model_files import EOS_ID, MODELS
from ddtree_ops.lab.engine.sampling import Choice
from tests.lab_engine_helpers import first_difference

pytestmark = pytest.mark.lab

HOST = "lab-1"
PYTHON = f"{VENV_DIR}/bin/python"
STATE_DIR = "/var/lib/ddtree-ops"
PAYLOAD = Path(__file__).resolve().parents[2] / "ddtree_ops" / "payload"
PROMPTS = [[5, 6, 7], [40, 41], list(range(3, 60)), [200]]
MAX_NEW = 48


@dataclass
class Unit:
    """One engine under systemd on a lab host."""

    fleet: object
    host: str
    name: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.fleet.addresses[self.host]}:{self.port}"

    def journal(self) -> str:
        return self.fleet.ssh(self.host, f"journalctl -u {self.name} --no-pager -o cat").stdout

    def show(self) -> dict[str, str]:
        out = self.fleet.ssh(self.host, f"systemctl show {self.name} -p ActiveState -p Result -p ExecMainStatus").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_healthy(self, timeout: float = 90) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            assert self.show().get("ActiveState") in ("active", "activating"), self.journal()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not healthy within {timeout} s:\n{self.journal()[-3000:]}")

    def wait_failed(self, timeout: float = 90) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.show()
            if state.get("ActiveState") in ("failed", "inactive"):
                return state
            time.sleep(0.2)
        raise AssertionError(f"{self.name} still running after {timeout} s:\n{self.journal()[-3000:]}")

    def greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        body = {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}
        answer = httpx.post(self.url + "/generate", json=body, timeout=120)
        answer.raise_for_status()
        return [a["output_ids"] for a in answer.json()]


@pytest.fixture
def engines(lab_fleet):
    """Start engines as transient units; every one is stopped and forgotten afterwards."""
    started: list[Unit] = []

    def start(*args: str, env: dict[str, str] | None = None, host: str = HOST) -> Unit:
        unit = Unit(lab_fleet, host, f"ddtree-lab-engine-test-{uuid.uuid4().hex[:8]}", 31000 + len(started))
        argv = ["systemd-run", f"--unit={unit.name}", "--property=Type=exec", "--property=TimeoutStopSec=60"]
        argv += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
        argv += [PYTHON, "-m", "ddtree_lab_engine", "--device", "cpu", "--host", "0.0.0.0", "--port", str(unit.port),
                 *args]
        result = lab_fleet.ssh(host, shlex.join(argv))
        assert result.returncode == 0, result.stderr
        started.append(unit)
        return unit

    yield start
    for unit in started:
        lab_fleet.ssh(unit.host, f"systemctl stop {unit.name}; systemctl reset-failed {unit.name} 2>/dev/null; true")


@pytest.fixture(scope="module")
def inv(lab_fleet):
    return load_inventory(lab_fleet.inventory_path)


def bundle_of(payload: Path, out: Path) -> release.LocalBundle:
    import importlib.metadata

    site = importlib.metadata.distribution("sglang").locate_file("")
    return release.LocalBundle.load(build_bundle(payload, out, site_dir=site).bundle_path)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> release.LocalBundle:
    return bundle_of(PAYLOAD, tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def altered_bundle(tmp_path_factory) -> release.LocalBundle:
    """The payload with one change in follow_verified_tree: the bonus token is the target's choice at
    the root instead of at the last accepted node (what a subtly wrong walk would serve)."""
    root = tmp_path_factory.mktemp("altered")
    payload = root / "payload"
    shutil.copytree(PAYLOAD, payload)
    utils = payload / "sglang/srt/speculative/ddtree_utils.py"
    source = utils.read_text()
    line = "    bonus_tokens = target.gather(1, last).view(-1)\n"
    assert source.count(line) == 1
    utils.write_text(source.replace(line, "    bonus_tokens = target[:, 0].contiguous()\n"))
    return bundle_of(payload, root / "dist")


@pytest.fixture
def pristine_host(lab_fleet, inv):
    """lab-1 pristine, unlocked, with an empty state dir, before and after the test."""
    hosts = inv.select(HOST)

    def reset() -> None:
        release.unlock(inv, hosts)
        results = release.rollback(inv, hosts, to="pristine", adopt=True)
        assert all(r.ok for r in results), [r.to_dict() for r in results]
        lab_fleet.ssh(HOST, f"umount -l {STATE_DIR} 2>/dev/null; rm -rf {STATE_DIR}")

    reset()
    yield hosts
    reset()


def push(inv, hosts, bundle: release.LocalBundle) -> None:
    results = release.push(inv, hosts, bundle)
    assert all(r.ok for r in results), [r.to_dict() for r in results]


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    """Plain greedy decoding of PROMPTS with the same model bytes, on this machine (independent of hosts)."""
    torch.set_num_threads(1)
    model = TinyLM.load(engine_files.models_dir(LabPaths.from_env()) / "target")
    dec = Decoder(model, capacity=1100)
    outs = []
    for p in PROMPTS:
        r = Request(rid="o", input_ids=p, choice=Choice(greedy=True), max_new_tokens=MAX_NEW,
                    stop_token_ids=frozenset(), ignore_eos=True, eos_token_id=EOS_ID)
        dec.prefill(r)
        while not r.finished:
            dec.step([r])
        outs.append(r.output_ids)
    return outs


DFLASH = ["--model-path", TARGET_MODEL, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
          DRAFT_MODEL, "--attention-backend", "triton", "--page-size", "1"]


def test_engine_and_models_installed_on_every_host(lab_fleet):
    sources = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine_files.ENGINE_SOURCE.glob("*.py")}
    probe = (
        "import hashlib, json, pathlib, ddtree_lab_engine as e\n"
        "d = pathlib.Path(e.__file__).parent\n"
        f"m = pathlib.Path({LAB_MODELS_DIR!r})\n"
        "print(json.dumps({'engine': {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.glob('*.py')},"
        " 'models': {str(p.relative_to(m)): json.loads(p.read_text()) if p.suffix == '.json' and p.name == 'config.json'"
        " else p.stat().st_size for p in sorted(m.rglob('*')) if p.is_file()}}))"
    )
    for host in lab_fleet.hosts:
        r = lab_fleet.ssh(host, shlex.join([PYTHON, "-c", probe]))
        assert r.returncode == 0, r.stderr
        found = json.loads(r.stdout)
        assert found["engine"] == sources, host
        models = found["models"]
        for name, config in MODELS.items():
            assert models[f"{name}/config.json"] == config
            assert models[f"{name}/model.safetensors"] > 0 and models[f"{name}/tokenizer.json"] > 0
            assert f"{name}/tokenizer_config.json" in models
        assert "linear_attention" in models["target-hybrid/config.json"]["layer_types"]


def test_pristine_host_serves_dflash_and_refuses_ddtree_flags(lab_fleet, pristine_host, engines, oracle, record_property):
    t0 = time.monotonic()
    dflash = engines(*DFLASH)
    ready_s = dflash.wait_healthy()
    record_property("engine_start_s", round(time.monotonic() - t0, 2))
    print(f"lab engine ready {ready_s:.1f} s after systemd-run on {HOST}")
    assert dflash.greedy(PROMPTS) == oracle
    info = httpx.get(dflash.url + "/server_info", timeout=10).json()
    assert "speculative_ddtree_mode" not in info and "ddtree" not in info["internal_states"][0]
    # pristine SGLang does not know the payload's flags: argparse stops the start, as in production
    shadow = engines(*DFLASH, "--speculative-ddtree-mode", "shadow-linear")
    state = shadow.wait_failed()
    assert (state["Result"], state["ExecMainStatus"]) == ("exit-code", "2")
    assert "unrecognized arguments: --speculative-ddtree-mode shadow-linear" in shadow.journal()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_pushed_payload_runs_all_modes_refuses_bad_flags_and_drains(lab_fleet, inv, pristine_host, bundle, engines, oracle):
    push(inv, pristine_host, bundle)
    bad_budget = engines(*DFLASH, "--speculative-ddtree-mode", "full", "--speculative-ddtree-budget", "0")
    hybrid_full = engines(*DFLASH[:1], HYBRID_TARGET_MODEL, *DFLASH[2:], "--speculative-ddtree-mode", "full")
    hybrid_allowed = engines(*DFLASH[:1], HYBRID_TARGET_MODEL, *DFLASH[2:], "--speculative-ddtree-mode", "full",
                             "--speculative-ddtree-allow-hybrid-unsafe")
    pause = f"/run/ddtree-lab-pause-{uuid.uuid4().hex[:8]}"
    full = engines(*DFLASH, "--speculative-ddtree-mode", "full", "--enable-metrics", env={faults.PAUSE_WHILE: pause})
    for unit in (bad_budget, hybrid_full, hybrid_allowed):
        assert unit.wait_failed()["Result"] == "exit-code"
    assert "--speculative-ddtree-budget must be in 1..512" in bad_budget.journal()
    # refused at argument parsing (the local config.json), before any pool: an unknown hybrid layer type
    journal = hybrid_full.journal()
    assert "DDTree full mode refused: the target model is hybrid" in journal and "linear_attention" in journal
    # no escape hatch: the allow flag itself is refused at parsing
    assert "--speculative-ddtree-allow-hybrid-unsafe is refused" in hybrid_allowed.journal()
    full.wait_healthy()
    assert full.greedy(PROMPTS) == oracle
    state = httpx.get(full.url + "/server_info", timeout=10).json()["internal_states"][0]
    assert state["ddtree"]["mode"] == "full" and state["ddtree"]["tree_steps"] > 0
    assert state["avg_spec_accept_length"] > 2
    hybrid_shadow = engines(*DFLASH[:1], HYBRID_TARGET_MODEL, *DFLASH[2:], "--speculative-ddtree-mode", "shadow-linear")
    hybrid_shadow.wait_healthy()
    assert hybrid_shadow.greedy(PROMPTS) == oracle

    # SIGTERM under systemd: /health 503 at once, the in-flight batch finishes, the unit stops in bound.
    # The batch is held in flight by the engine's pause file, not by a race with the clock: on a fast
    # machine 300 tokens were done (and the engine gone) before the 503 probe.
    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}
    assert lab_fleet.ssh(HOST, f"touch {pause}").returncode == 0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = pool.submit(httpx.post, full.url + "/generate", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while "sglang:num_running_reqs" not in (metrics := httpx.get(full.url + "/metrics", timeout=5).text) or \
                _metric(metrics, "sglang:num_running_reqs") < len(PROMPTS):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        stopping = pool.submit(lab_fleet.ssh, HOST, f"systemctl stop {full.name}")
        # The stop travels by ssh through the bastion on a loaded 2-core machine: its arrival is not timed
        # here (the batch stays in flight until the pause file goes, whenever SIGTERM lands).
        deadline = time.monotonic() + 90
        while (status := httpx.get(full.url + "/health", timeout=5).status_code) != 503:
            assert status == 200 and time.monotonic() < deadline, status
            time.sleep(0.1)
        assert not pending.done()  # still in flight while the engine says 503: it is draining
        started = time.monotonic()
        assert lab_fleet.ssh(HOST, f"rm {pause}").returncode == 0
        answer = pending.result(timeout=120)
        assert stopping.result(timeout=120).returncode == 0
        stop_s = time.monotonic() - started
    assert answer.status_code == 200 and all(len(a["output_ids"]) == 300 for a in answer.json())
    assert stop_s < 30 and "drained; exiting" in full.journal()
    assert full.show()["Result"] == "success"


def test_pushed_bundle_with_altered_walk_changes_full_mode_outputs(lab_fleet, inv, pristine_host, altered_bundle,
                                                                   engines, oracle):
    push(inv, pristine_host, altered_bundle)
    full = engines(*DFLASH, "--speculative-ddtree-mode", "full")
    shadow = engines(*DFLASH, "--speculative-ddtree-mode", "shadow-linear")
    full.wait_healthy()
    shadow.wait_healthy()
    got = full.greedy(PROMPTS)
    diffs = [first_difference(g, w) for g, w in zip(got, oracle, strict=True)]
    assert any(d is not None for d in diffs), "full mode ignored the pushed follow_verified_tree"
    assert shadow.greedy(PROMPTS) == oracle  # shadow-linear never walks the tree
