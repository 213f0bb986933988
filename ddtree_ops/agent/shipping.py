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

import base64
import functools
import json
import zlib
from pathlib import Path

REMOTE_PACKAGE = "ddtree_agent"
_REMOTE_SOURCE = Path(__file__).with_name("remote")

# Readable source of the bootstrap; it is base64-encoded into the command line so the line holds
# only [A-Za-z0-9+/=] and survives any login shell unchanged. It contains no inventory value.
READY = "ddtree-agent: ready"
BOOTSTRAP_SOURCE = """\
import sys, json, zlib, base64, linecache
from importlib.machinery import ModuleSpec
if sys.argv[1:] == ["--ready"]:
    sys.stdout.write("ddtree-agent: ready\\n")
    sys.stdout.flush()
SOURCES = json.loads(zlib.decompress(base64.b64decode(sys.stdin.buffer.readline())))
class AgentFinder:
    def find_spec(self, name, path=None, target=None):
        if name in SOURCES:
            return ModuleSpec(name, self, is_package=SOURCES[name][0])
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        is_package, source = SOURCES[module.__name__]
        filename = "<ddtree-agent>/" + module.__name__.replace(".", "/") + ("/__init__.py" if is_package else ".py")
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), module.__dict__)
sys.meta_path.insert(0, AgentFinder())
from ddtree_agent.main import main
sys.exit(main())
"""

BOOTSTRAP_LINE = 'import base64;exec(base64.b64decode("' + base64.b64encode(BOOTSTRAP_SOURCE.encode()).decode() + '"))'


@functools.cache
def agent_sources() -> dict[str, tuple[bool, str]]:
    """The remote package as {module name: (is_package, source)}."""
    sources: dict[str, tuple[bool, str]] = {}
    for path in sorted(_REMOTE_SOURCE.rglob("*.py")):
        rel = path.relative_to(_REMOTE_SOURCE).with_suffix("")
        parts = [REMOTE_PACKAGE, *rel.parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (is_package, path.read_text(encoding="utf-8"))
    return sources


@functools.cache
def agent_payload_line() -> bytes:
    packed = zlib.compress(json.dumps(agent_sources(), separators=(",", ":")).encode(), 9)
    return base64.b64encode(packed) + b"\n"


def agent_argv(python: str, *, ready: bool = False) -> list[str]:
    """The remote argv (ssh.py quotes it and puts it under sudo when the host asks for sudo)."""
    return [python, "-I", "-c", BOOTSTRAP_LINE, *(["--ready"] if ready else [])]


def agent_stdin(op: str, args: dict) -> bytes:
    request = json.dumps({"op": op, "args": args}, separators=(",", ":")).encode()
    return agent_payload_line() + request + b"\n"
