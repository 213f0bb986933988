"""How the agent gets to a host without a file copy: one constant bootstrap plus stdin.

The remote command is always

    <python> -I -c 'import base64;exec(base64.b64decode("<BOOTSTRAP>"))'

with only `python` coming from the inventory (through shlex.quote). stdin carries two lines:

    1. base64(zlib(JSON {module name: [is_package, source]}))   the agent package, `ddtree_agent`
    2. JSON request {"op": ..., "args": {...}}

The bootstrap serves the agent's modules from memory through a meta-path finder, so nothing is
written on the host and the agent always matches the operator's ddtree-ops version. With `--ready`
after the bootstrap it first prints READY on stdout: the sign that sudo has started it (sudo.py).
`-I` (isolated mode) keeps PYTHON* variables, the user site and the current directory out of it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ddtree_ops.agent.remote import bootstrap

REMOTE_PACKAGE = bootstrap.PACKAGE
_REMOTE_SOURCE = Path(__file__).with_name("remote")
READY = bootstrap.READY
BOOTSTRAP_SOURCE = bootstrap.SOURCE
BOOTSTRAP_LINE = bootstrap.LINE


@functools.cache
def agent_sources() -> dict[str, tuple[bool, str]]:
    """The remote package as {module name: (is_package, source)}."""
    return bootstrap.package_sources(_REMOTE_SOURCE, REMOTE_PACKAGE)


@functools.cache
def agent_payload_line() -> bytes:
    return bootstrap.payload_line(agent_sources())


def agent_argv(python: str, *, ready: bool = False) -> list[str]:
    """The remote argv (ssh.py quotes it and puts it under sudo when the host asks for sudo)."""
    return [python, "-I", "-c", BOOTSTRAP_LINE, *(["--ready"] if ready else [])]


def agent_stdin(op: str, args: dict) -> bytes:
    request = json.dumps({"op": op, "args": args}, separators=(",", ":")).encode()
    return agent_payload_line() + request + b"\n"
