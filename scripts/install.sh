#!/usr/bin/env bash
# Install everything ddtree-ops, its tests and its lab fleet need, on a Debian 12 machine as root.
# Idempotent: a second run only checks. Used by scripts/test.sh, scripts/rehearse.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[install]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then echo "install.sh: run as root (the lab fleet needs systemd-nspawn, bridges and mounts)" >&2; exit 2; fi

# The lab owns its list (systemd-nspawn, debootstrap, ...); its module needs only the stdlib.
read -r -a APT_PACKAGES <<< "$(PYTHONPATH=. python3 -m ddtree_ops.lab.image apt-packages)"
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY -V)"
  "$PY" -m venv .venv
fi
VPIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The same stack as every lab host's venv (ddtree_ops/lab/image.py): torch 2.14.1 + torchvision
# 0.29.1 CUDA builds that run on CPU (sglang imports torchvision.io unconditionally and no
# torchvision matches the CPU-only torch 2.13.0), and what sglang's server_args and the patched
# serving path import; sglang itself goes in --no-deps (its full set pulls GPU-only packages).
REQS=$(mktemp); trap 'rm -f "$REQS"' EXIT
PYTHONPATH=. python3 -m ddtree_ops.lab.image venv-requirements > "$REQS"
if ! .venv/bin/python - "$REQS" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
for line in open(sys.argv[1]).read().split():
    name, _, version = line.partition("==")
    assert m.version(name) == version if version else m.version(name)
assert m.version("sglang") == "0.5.13.post1"
PY
then
  log "installing sglang==0.5.13.post1 (--no-deps), torch 2.14.1 and the lab's CPU stack (several GB; local wheel mirror when present)"
  "${VPIP[@]}" -r "$REQS"
  "${VPIP[@]}" --no-deps sglang==0.5.13.post1
fi
# The v2 bases' tests (tests/test_payload_v2.py puts this directory on their path): 0.5.17's server_args imports
# xgrammar, which imports tvm_ffi, and 0.5.23's argument resolution imports tvm_ffi. Beside the venv, not in it, so
# the 0.5.13.post1 stack stays the lab hosts'.
V2_EXTRA=.venv/sglang-v2-extra
if [ ! -d $V2_EXTRA/tvm_ffi ] || [ ! -d $V2_EXTRA/xgrammar ]; then
  log "installing apache-tvm-ffi==0.1.11 and xgrammar==0.2.1 for the SGLang 0.5.17 / 0.5.23 tests ($V2_EXTRA)"
  "${VPIP[@]}" --no-deps --target $V2_EXTRA apache-tvm-ffi==0.1.11 xgrammar==0.2.1
fi
log "installing ddtree-ops (editable) with dev extras"
"${VPIP[@]}" -e ".[dev]"
log "done: $(.venv/bin/ddtree-ops --version)"
