"""ddtree-ops: ship DDTree speculative decoding to SGLang fleets, safely."""

__version__ = "0.1.0"
