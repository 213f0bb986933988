"""Agent entry: read one JSON request from stdin, dispatch it, write one JSON answer to stdout."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from . import PROTOCOL
from .errors import AgentError
from .ops import dispatch


def handle(raw: bytes) -> dict:
    try:
        request = json.loads(raw.decode("utf-8"))
    except ValueError as exc:
        raise AgentError("bad_request", f"request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise AgentError("bad_request", "request must be a JSON object")
    args = request.get("args") or {}
    if not isinstance(args, dict):
        raise AgentError("bad_request", "`args` must be a JSON object")
    return {"ok": True, "op": request.get("op"), "result": dispatch(request.get("op"), args)}


def main() -> int:
    started = time.monotonic()
    # Ops and the subprocesses they start must never write to the answer channel: keep a private
    # copy of stdout for the answer and point fd 1 at stderr for everything else.
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Whatever the login shell's umask, nothing the agent creates is writable by group or others
    # (the state dir refuses such entries as possibly planted) and site-packages stays readable.
    os.umask(0o022)
    try:
        answer = handle(sys.stdin.buffer.readline())
    except AgentError as exc:
        answer = {"ok": False, "error": exc.to_dict()}
    except Exception as exc:  # an agent bug must still come back as JSON, with its traceback
        answer = {
            "ok": False,
            "error": {
                "code": "agent_crash",
                "message": f"{type(exc).__name__}: {exc}",
                "hint": "this is a bug in the ddtree-ops agent; the traceback is in error.traceback",
                "traceback": traceback.format_exc(),
            },
        }
    answer["protocol"] = PROTOCOL
    answer["elapsed_ms"] = round((time.monotonic() - started) * 1000, 1)
    data = (json.dumps(answer, default=str) + "\n").encode("utf-8")
    while data:
        data = data[os.write(answer_fd, data):]
    return 0
