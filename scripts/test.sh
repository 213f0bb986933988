#!/usr/bin/env bash
# Install everything from nothing (apt packages, .venv, the lab base image on first use) and run
# the whole test suite: lint, unit tests, and the lab-fleet tests (real sshd + systemd in
# systemd-nspawn hosts, the real sglang wheel). Run as root on Debian 12. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
echo "[test] ruff" >&2
.venv/bin/ruff check ddtree_ops tests bench
echo "[test] pytest" >&2
export DDTREE_TEST_SGLANG_V2_EXTRA=${DDTREE_TEST_SGLANG_V2_EXTRA:-$PWD/.venv/sglang-v2-extra}
exec .venv/bin/python -m pytest -q "$@" tests
