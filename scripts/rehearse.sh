#!/usr/bin/env bash
# The main job, rehearsed on the built-in lab fleet (3 systemd-nspawn hosts with sshd, systemd, the
# real sglang==0.5.13.post1 and the lab engine serving SGLang's HTTP API on CPU):
#   install → lab up → build → push → smoke → promote shadow-linear → promote full → rollback
# ending in a readable summary (per step: result and wall time; per host and gate: verdicts and
# seconds; the tool's own time vs time spent waiting for the services). Run as root on Debian 12.
# Every step's --json document is kept in rehearsal/<time>/ (REHEARSAL_OUT overrides). The lab
# stays up afterwards (`.venv/bin/ddtree-ops lab down` removes it).
set -euo pipefail
cd "$(dirname "$0")/.."
# OPS=/path/to/ddtree-ops skips the install and uses that CLI (e.g. another checkout's venv).
if [ -z "${OPS:-}" ]; then
  bash scripts/install.sh
  OPS=.venv/bin/ddtree-ops
fi
INV=inventory/lab.yaml
OUT=${REHEARSAL_OUT:-rehearsal/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
banner() { printf '\n\033[1;36m== %s\033[0m\n' "$*" >&2; }

# step NAME COMMAND...: runs it with --json (the document goes to $OUT/NAME.json, human text to
# stderr), records exit status and wall time; the rehearsal stops at the first failed step.
step() {
  local name=$1; shift
  banner "$name"
  local t0 t1 rc=0
  t0=$(date +%s%N)
  "$@" --json > "$OUT/$name.json" || rc=$?
  t1=$(date +%s%N)
  ms=$(( (t1 - t0) / 1000000 ))
  printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $(( ms / 1000 )) $(( ms % 1000 )) >> "$OUT/steps.tsv"
  python3 scripts/rehearsal_summary.py --step "$OUT" "$name" >&2 || true
  if [ "$rc" != 0 ]; then
    banner "step $name failed (exit $rc): summary so far"
    python3 scripts/rehearsal_summary.py "$OUT"
    exit "$rc"
  fi
}

step lab-up $OPS lab up --hosts 3
# Signed with the lab's key, which inventory/lab.yaml trusts (`signers:`): push refuses anything else.
step build $OPS build --download --out dist --sign-key inventory/lab/signer_ed25519
step push $OPS push -i "$INV"
step smoke $OPS smoke -i "$INV"
step promote-shadow-linear $OPS promote -i "$INV" --mode shadow-linear --evidence-dir "$OUT/evidence"
step promote-full $OPS promote -i "$INV" --mode full --evidence-dir "$OUT/evidence"
step status $OPS status -i "$INV"
step rollback $OPS rollback -i "$INV"
step status-after-rollback $OPS status -i "$INV"
banner "rehearsal complete"
python3 scripts/rehearsal_summary.py "$OUT"
