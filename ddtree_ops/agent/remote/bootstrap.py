"""How the agent starts from nothing but stdin (stdlib only); shared by the control side, which
ships it, and the agent, which starts its own confirm-deadline watchdog the same way.

The command is always `<python> -I -c '<bootstrap line>'`: the line holds only base64 characters
and no inventory value. stdin carries two lines: base64(zlib(JSON {module: [is_package, source]}))
of the agent package `ddtree_agent`, then the JSON request.
"""

from __future__ import annotations

import base64
import json
import sys
import zlib
from pathlib import Path

PACKAGE = "ddtree_agent"

# With `--ready` the bootstrap first prints this line (under sudo with a password, the control side
# knows from it that sudo started the agent and its input is the agent's, not sudo's prompt).
READY = "ddtree-agent: ready"
# Readable source of the bootstrap; it serves the agent's modules from memory through a meta-path
# finder, so nothing is written on the host and the agent always matches the operator's ddtree-ops.
SOURCE = """\
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

LINE = 'import base64;exec(base64.b64decode("' + base64.b64encode(SOURCE.encode()).decode() + '"))'


def package_sources(root: Path, package: str = PACKAGE) -> dict:
    """The agent package under `root` as {module name: (is_package, source)}."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (is_package, path.read_text(encoding="utf-8"))
    return sources


def payload_line(sources: dict) -> bytes:
    packed = zlib.compress(json.dumps(sources, separators=(",", ":")).encode(), 9)
    return base64.b64encode(packed) + b"\n"


def running_sources() -> dict:
    """The sources of this very agent: served from memory on a host (the bootstrap's SOURCES), read
    from the package directory when it runs from a checkout."""
    served = getattr(sys.modules.get("__main__"), "SOURCES", None)
    if isinstance(served, dict) and f"{PACKAGE}.main" in served:
        return served
    return package_sources(Path(__file__).resolve().parent)
