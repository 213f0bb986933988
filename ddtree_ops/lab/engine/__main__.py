"""`python -m ddtree_lab_engine ARGS`: ARGS exactly as `python -m sglang.launch_server ARGS`."""

import sys

from .launch import main

sys.exit(main())
