# Sourced by run_device.sh when GRAPHS=1 (issue 13): the servers are in TAGS, the first one warms up.
# Phase A (correctness, clients of different servers in parallel: the verdicts do not depend on timing):
#   the production mix on the r and p sets (plain makes each set's workload first), the liveness mix
#   (8 sampled + 8 greedy, 20 rounds) and the first-3-token samples of the sampled-walk test.
# Phase B (speed, one server at a time): graphs_proof.py --perf on plain / DFLASH / shadow / full.
# Then production_mix.py compare and graphs_proof.py compare; the summary goes to $OUT/summary.txt.
PROOF=(python3 $HERE/graphs_proof.py)
IFS='|' read -r tag model extra <<< "$first"; launch "$tag" "$model" $extra
python3 $HERE/wait_all.py 300 "${PORT[$tag]}:${PID[$tag]}"
ts "$first up (warm-up)"
wait $MAKE_PID; ts "other models made"
for v in "${rest[@]}"; do IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
ALLPORTS=(); for v in "${rest[@]}"; do t=${v%%|*}; ALLPORTS+=("${PORT[$t]}:${PID[$t]}"); done
python3 $HERE/wait_all.py $(( DEADLINE - $(date +%s) - 200 )) "${ALLPORTS[@]}"
ts "all servers up or dead; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
has() { [ -n "${PORT[$1]:-}" ]; }
mix() {  # TAG [--make]
  local tag=$1 set=${1%%_*}; shift
  timeout $(( DEADLINE - $(date +%s) - 60 )) python3 $HERE/production_mix.py run --port "${PORT[$tag]}" --tag "$tag" \
    --out "$OUT/$tag.json" --workload "$OUT/workload_$set.json" --wait 60 --pid "${PID[$tag]}" "$@" > "$OUT/client_$tag.log" 2>&1
  ts "$tag mix rc=$? $(tail -1 "$OUT/client_$tag.log" | cut -c1-200)"
}
proof() {  # TAG ARGS...
  local tag=$1; shift
  timeout $(( DEADLINE - $(date +%s) - 40 )) "${PROOF[@]}" run --port "${PORT[$tag]}" --tag "$tag" --out "$OUT/${tag}_proof.json" \
    --wait 60 --pid "${PID[$tag]}" "$@" >> "$OUT/proof_$tag.log" 2>&1
  ts "$tag proof $* rc=$? $(grep -E '^\[(proof|live)\]' "$OUT/proof_$tag.log" | tail -1 | cut -c1-300)"
}
# A1: plain makes the workloads
for t in p_plain r_plain; do has $t && mix $t --make & done; wait
# A2: everything else at once
JOBS=()
for v in "${TAGS[@]}"; do
  t=${v%%|*}
  case $t in
    p_plain) ( proof $t --samples 2000 ) & ;;
    p_full64) ( mix $t; proof $t --samples 2000 --liveness ) & ;;
    p_full64_bias) ( proof $t --samples 2000 ) & ;;
    p_dflash|p_shadow) ( mix $t; proof $t --liveness ) & ;;
    r_dflash_pristine) ( proof $t --liveness; kill -TERM -- "-${PID[$t]}" 2>/dev/null ) & ;;
    r_plain) continue ;;
    r_*) ( mix $t; proof $t --liveness ) & ;;
  esac
  JOBS+=($!)
done
wait "${JOBS[@]}"
ts "phase A done"
kill -TERM -- "-${PID[p_full64_bias]}" "-${PID[r_dflash_pristine]}" 2>/dev/null
# B: speed, one server at a time, the others idle
for t in p_plain p_dflash p_shadow p_full64 r_plain r_dflash r_full64; do
  has $t && [ $(( DEADLINE - $(date +%s) )) -gt 60 ] && proof $t --perf
done
ts "phase B done"
for t in "${!PID[@]}"; do grep -hE "DDTree (enabled|builder|full: verify)|Traceback|Error|Capture cuda graph bs" "$OUT/server_$t.log" | head -6 | sed "s/^/[$t] /" | cut -c1-300; done
stop_all; trap - EXIT
wait $SKC_PID 2>/dev/null
{ echo "--- sampling kernels check"; cat "$OUT/sampling_kernels_check.log"
  MIXC=(python3 $HERE/production_mix.py compare "$OUT")
  echo "--- production mix, graphs on"
  "${MIXC[@]}" r_plain --upstream r_dflash r_dflash r_full16 r_full64 r_full256; echo "rc=$?"
  "${MIXC[@]}" p_plain --upstream p_dflash p_dflash p_shadow p_full64; echo "rc=$?"
  echo "--- sampling, liveness, speed"
  "${PROOF[@]}" compare "$OUT" --plain p_plain --cand p_full64 --biased p_full64_bias \
    --liveness p_dflash p_shadow p_full64 r_dflash r_full16 r_full64 r_full256 r_dflash_pristine \
    --expect-stall r_dflash_pristine --perf p_plain p_dflash p_shadow p_full64 r_plain r_dflash r_full64; echo "rc=$?"
} 2>&1 | tee "$OUT/summary.txt"
ts "done"
( cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name graphs_summary.json ! -name run.log -printf '%P\n' \
    | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
  && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name graphs_summary.json ! -name run.log -delete )
