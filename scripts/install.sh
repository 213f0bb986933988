#!/usr/bin/env bash
# Install everything ddtree-ops, its tests and its lab fleet need, on a Debian 12 machine as root.
# Idempotent: a second run only checks. Used by scripts/test.sh, scripts/rehearse.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[install]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then echo "install.sh: run as root (the lab fleet needs systemd-nspawn, bridges and mounts)" >&2; exit 2; fi

# The lab hosts are systemd-nspawn containers built with debootstrap on a private bridge.
APT_PACKAGES=(systemd-container debootstrap iproute2 openssh-client ca-certificates xz-utils)
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
# torch 2.14.1 + torchvision 0.29.1: SGLang 0.5.13.post1 imports torchvision.io unconditionally and
# no torchvision build matches the CPU-only torch 2.13.0 (see DESIGN.md); these CUDA builds run on CPU.
if ! .venv/bin/python -c "import torch, torchvision; assert torch.__version__.startswith('2.14.1')" 2>/dev/null; then
  log "installing torch 2.14.1 + torchvision 0.29.1 (several GB, from the local wheel mirror when present)"
  "${VPIP[@]}" torch==2.14.1 torchvision==0.29.1
fi
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.13.post1'" 2>/dev/null; then
  log "installing sglang==0.5.13.post1 (no deps) and what its server_args needs on CPU"
  "${VPIP[@]}" --no-deps sglang==0.5.13.post1
  "${VPIP[@]}" -r scripts/sglang-cpu-requirements.txt
fi
log "installing ddtree-ops (editable) with dev extras"
"${VPIP[@]}" -e ".[dev]"
log "done: $(.venv/bin/ddtree-ops --version)"
