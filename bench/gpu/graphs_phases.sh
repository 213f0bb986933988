# Sourced by run_device.sh when GRAPHS=1 (issue 13): the servers are in TAGS, the first one warms up.
# PERF_ONLY=1: phase B alone (a second speed sample in a short call). Seven servers are up at about
# t+250 s on a cold machine and each perf run takes ~6 s: BUDGET_S=330 is too short, ~360 is enough.
# PERF_PASSES=N: phase B measures every server N times, interleaved (pass k of each server, in an order
# rotated per pass, before pass k+1), and compare reports each server's ms per step over DFLASH's pass by
# pass: processes with the same flags differ by up to 25 % on this machine, its minutes by as much.
# Phase A1: the plain servers make the production-mix workloads. Phase B (speed, one server at a
# time, the others idle): graphs_proof.py --perf on plain / DFLASH / shadow / full.
# Phase A2 (correctness, clients of different servers in parallel: the verdicts do not depend on timing):
#   the production mix on the r and p sets (plain makes each set's workload first), the liveness mix
#   (8 sampled + 8 greedy, 20 rounds) and the first-3-token samples of the sampled-walk test.
# Then production_mix.py compare and graphs_proof.py compare; the summary goes to $OUT/summary.txt.
# Last (phase C): upstream DFLASH without the payload on the liveness mix, and (RENORM=1) the renorm kernels on
# tied rows: a spinning kernel starves every process on the GPU, so nothing else runs beside them.
PROOF=(python3 $HERE/graphs_proof.py)
pack() {  # only a few files come back from the device: keep the summaries, pack the rest
  ( cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name graphs_summary.json ! -name run.log \
      ! -name logs.tgz -printf '%P\n' | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
    && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name graphs_summary.json ! -name run.log -delete )
}
# A watchdog: whatever is still running at the deadline, the logs come back.
at_deadline() { ts "watchdog: packing at the deadline"; pack; }
start_watchdog $(( DEADLINE - $(date +%s) - 10 )) at_deadline
PERF_ONLY=${PERF_ONLY:-0}
start_servers $(( PERF_ONLY ? 60 : 200 ))
has() { [ -n "${PORT[$1]:-}" ]; }
served() { for t; do has "$t" && printf '%s ' "$t"; done; }  # the tags among these that this call serves
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
A1=(); if [ "$PERF_ONLY" != 1 ]; then for t in p_plain r_plain; do if has $t; then mix $t --make & A1+=($!); fi; done; fi; [ ${#A1[@]} = 0 ] || wait "${A1[@]}"
# B: speed, one server at a time, the others idle
PERF_TAGS=(p_plain p_dflash p_shadow p_full64 p_full64_prof p_shadow_prof p_full64_unfused_prof p_dflash_twin
           p_shadow_twin p_shadow_every1 r_plain r_dflash r_full64)
for pass in $(seq "${PERF_PASSES:-1}"); do
  k=$(( (pass - 1) % ${#PERF_TAGS[@]} ))
  for t in "${PERF_TAGS[@]:k}" "${PERF_TAGS[@]:0:k}"; do
    has $t && [ $(( DEADLINE - $(date +%s) )) -gt $(( PERF_ONLY ? 15 : 60 )) ] && proof $t --perf
  done
done
RATIO_TO=$(served p_dflash r_dflash | cut -d' ' -f1)
ts "phase B done"
# A2: everything else at once
JOBS=()
for v in "${TAGS[@]}"; do
  t=${v%%|*}
  [ "$PERF_ONLY" = 1 ] && break
  case $t in
    p_plain) ( proof $t --samples 2000 ) & ;;
    p_full64|p_full64_cycle) ( mix $t; proof $t --samples 2000 --liveness ) & ;;
    p_full64_bias) ( proof $t --samples 2000 ) & ;;
    p_*_prof|p_dflash_twin|p_shadow_twin|p_shadow_every1) continue ;;
    p_dflash|p_auto) ( mix $t; proof $t --samples 2000 --liveness ) & ;;
    p_auto_twin|p_full127) ( mix $t ) & ;;
    p_shadow) ( mix $t; proof $t --liveness ) & ;;
    r_plain|r_dflash_pristine) continue ;;
    r_*) ( mix $t; proof $t --liveness ) & ;;
  esac
  JOBS+=($!)
done
[ ${#JOBS[@]} = 0 ] || wait "${JOBS[@]}"  # a bare wait would wait for the watchdog too
ts "phase A done"
for t in "${!PID[@]}"; do
  [ "$t" = r_dflash_pristine ] || kill -TERM -- "-${PID[$t]}" 2>/dev/null
  grep -hE "DDTree (enabled|builder|full: verify)|Traceback|Error|Capture cuda graph bs" "$OUT/server_$t.log" | head -6 | sed "s/^/[$t] /" | cut -c1-300
done
wait $SKC_PID 2>/dev/null
# C: what stalls (bounded: 15 s per liveness request, 20 s per renorm run; stop at the first stall)
if has r_dflash_pristine && [ $(( DEADLINE - $(date +%s) )) -gt 70 ]; then proof r_dflash_pristine --liveness; fi
stop_all; trap - EXIT
# The renorm repro is opt-in (RENORM=1): on the H200 a fresh process importing sgl_kernel has never
# finished within its 40 s per input (RESULTS.md), so by default it would spend ~200 s on nothing.
[ "${RENORM:-0}" = 1 ] && [ $(( DEADLINE - $(date +%s) )) -gt 120 ] && timeout $(( DEADLINE - $(date +%s) - 40 )) python3 $HERE/sampling_kernels_check.py renorm 40 >> "$OUT/sampling_kernels_check.log" 2>&1
{ echo "--- sampling kernels check"; cat "$OUT/sampling_kernels_check.log"
  MIXC=(python3 $HERE/production_mix.py compare "$OUT")
  echo "--- production mix, graphs on"
  for set in r p; do
    has ${set}_plain && [ "$PERF_ONLY" != 1 ] || continue
    "${MIXC[@]}" ${set}_plain --upstream ${set}_dflash --expect-padded ${set}_full64_cycle -- \
      $(served ${set}_dflash ${set}_shadow ${set}_full16 ${set}_full64 ${set}_full256 ${set}_full64_cycle ${set}_full127 ${set}_auto ${set}_auto_twin); echo "rc=$?"
  done
  if [ "$PERF_ONLY" = 1 ]; then
    echo "--- speed"; "${PROOF[@]}" compare "$OUT" --plain p_plain --perf $(served "${PERF_TAGS[@]}") ${RATIO_TO:+--ratio-to $RATIO_TO}; echo "rc=$?"
  else
    echo "--- sampling, liveness, speed (bf16: the walk and the verify kernels' rounding; DFLASH, lossless by upstream's construction, beside it)"
    "${PROOF[@]}" compare "$OUT" --plain p_plain --cand $(served p_full64 p_full64_cycle p_dflash p_auto) $(has p_full64_bias && echo --biased p_full64_bias) \
      --liveness $(served p_dflash p_shadow p_full64 p_full64_cycle p_auto r_dflash r_full16 r_full64 r_full256 r_full64_cycle r_auto r_dflash_pristine) \
      --expect-stall r_dflash_pristine --perf $(served "${PERF_TAGS[@]}") ${RATIO_TO:+--ratio-to $RATIO_TO}; echo "rc=$?"
  fi
  echo "--- builder and verify-step Triton tests on the GPU"; tail -3 "$OUT/triton_tests.log" 2>/dev/null
} 2>&1 | tee "$OUT/summary.txt"
ts "done"
stop_watchdog
pack
