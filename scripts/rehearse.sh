#!/usr/bin/env bash
# The main job, rehearsed on the built-in lab fleet (3 systemd-nspawn hosts with sshd, systemd and
# the real sglang==0.5.13.post1): install → lab up → build → push → smoke → status → rollback.
# Run as root on Debian 12. The lab stays up afterwards (`.venv/bin/ddtree-ops lab down` removes it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OPS=.venv/bin/ddtree-ops
INV=inventory/lab.yaml
step() { printf '\n\033[1;36m== %s\033[0m\n' "$*" >&2; }

step "lab up: 3 hosts (the first run builds the base image: a few minutes)"
$OPS lab up --hosts 3
step "build: DDTree payload bundle against pristine sglang==0.5.13.post1"
$OPS build --download --out dist
step "status before"
$OPS status -i "$INV"
step "push (dry run, then for real)"
$OPS push -i "$INV" --dry-run
$OPS push -i "$INV"
step "smoke: imports, DDTree server flags, CPU tree-builder self-test, on each host"
$OPS smoke -i "$INV"
step "status with the release installed"
$OPS status -i "$INV"
step "rollback to pristine, byte for byte"
$OPS rollback -i "$INV" --to pristine
step "history"
$OPS history -i "$INV" --entries 5
step "rehearsal complete: build → push → smoke → rollback on $(grep -c '^  lab-' "$INV") lab hosts"
