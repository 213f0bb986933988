"""The host agent: stdlib-only code that runs ON a host, under the host's own Python.

It is shipped over SSH stdin on every call (see ../shipping.py), never installed, so the agent a
host runs is always the one of the operator's ddtree-ops version. It must import nothing outside
the standard library and stay compatible with Python 3.10+ (SGLang's own floor; tests parse it so).

On the host the package is named `ddtree_agent`; modules use relative imports only.
"""

PROTOCOL = 1
