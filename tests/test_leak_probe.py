"""bench/gpu/leak_probe.py without a GPU: against a local stand-in of SGLang's HTTP API that goes down after
one kind of request (as 0.5.17's idle pool check takes a leaking server down), the probe names that kind and
the attempt; a server that never goes down is reported alive after every probe."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from http_stand_in import JSONHandler, serve

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def _client_gone(sock, wait_s: float) -> bool:
    """Whether the client closed its end within wait_s (readable with nothing to read is EOF)."""
    readable, _, _ = select.select([sock], [], [], wait_s)
    return bool(readable) and not sock.recv(1, 0)


def _stand_in(dies_after):
    """dies_after(body, aborted, seen) -> bool: whether this request takes the server down; `seen` counts the
    requests of the same shape so far (the probe sends each kind twice).

    Deterministic on a loaded machine: a stream is paced and watches for the client's close, so a probe that
    breaks off is always seen as aborted (a whole stream fits the socket buffers, so a failed write is not a
    signal); and /health answers only once no request is in flight, as SGLang's idle check runs only then."""
    down: list[bool] = []
    seen: dict[tuple, int] = {}
    in_flight = [0]
    idle = threading.Condition()

    class Handler(JSONHandler):
        def do_GET(self):
            with idle:
                idle.wait_for(lambda: in_flight[0] == 0, timeout=60)
            if down:
                self.send_error(503)
                return
            self.send_json({})

        def do_POST(self):
            with idle:
                in_flight[0] += 1
            try:
                self._generate()
            finally:
                with idle:
                    in_flight[0] -= 1
                    idle.notify_all()

        def _generate(self):
            body = self.read_json()
            sp = body["sampling_params"]
            shape = (len(body["input_ids"]), sp["max_new_tokens"], bool(body.get("stream")))
            seen[shape] = seen.get(shape, 0) + 1
            aborted = False
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for _ in range(sp["max_new_tokens"]):
                        self.wfile.write(b'data: {"output_ids": [1]}\n\n')
                        self.wfile.flush()
                        if _client_gone(self.connection, 0.02):
                            aborted = True
                            break
                except (BrokenPipeError, ConnectionResetError):
                    aborted = True
            else:
                self.send_json({"output_ids": [1] * sp["max_new_tokens"], "meta_info": {"finish_reason": None}})
            if dies_after(body, aborted, seen[shape]):
                down.append(True)

    return serve(Handler)


@pytest.mark.parametrize(
    ("dies_after", "culprit"),
    [
        (lambda body, aborted, n: aborted and n == 1, "abort_early#1"),  # first stream the client breaks off
        (lambda body, aborted, n: len(body["input_ids"]) == 1024 - 40 and n == 2, "near_limit#2"),  # cached prefix
        (lambda body, aborted, n: False, None),
    ],
)
def test_probe_names_the_request_kind_after_which_the_server_went_down(tmp_path: Path, dies_after, culprit) -> None:
    pytest.importorskip("requests")
    srv = _stand_in(dies_after)
    out = tmp_path / "leak.json"
    try:
        proc = subprocess.run(
            [sys.executable, str(GPU / "leak_probe.py"), "--port", str(srv.server_address[1]), "--tag", "t",
             "--out", str(out), "--idle-s", "0.05", "--wait", "10"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        srv.shutdown()
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["culprit"] == culprit
    if culprit is None:
        assert all(s["alive"] for s in report["steps"]) and len(report["steps"]) == 18  # 9 kinds, twice each
        assert "alive after every probe" in proc.stdout
    else:
        assert report["steps"][-1]["alive"] is False and all(s["alive"] for s in report["steps"][:-1])
        assert f"died after {culprit}" in proc.stdout
