# Sourced by run_device.sh when SWEEP=1 (issue 14): the trained pair's servers are in TAGS; the first
# three (full_b64_cap4_kc, plain, dflash) start together and warm the JIT caches, then the rest start.
# Once all are up, pair_sweep.py measures one server at a time (the others idle): greedy and T 0.8, batch
# 1 and 32, with plain's top-5 logprobs for the token-identity check; then pair_sweep.py compare
# writes the table and sweep.json (plot_sweep.py's input) into $OUT.
SWEEPC=(python3 $HERE/pair_sweep.py)
pack() {  # only a few files come back from the device: keep the summaries, pack the rest
  ( cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name sweep.json ! -name run.log \
      ! -name logs.tgz -printf '%P\n' | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
    && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name sweep.json ! -name run.log -delete )
}
summarize() {
  local tags=(); for v in "${TAGS[@]}"; do t=${v%%|*}; [ "$t" = plain ] || [ "$t" = dflash ] || tags+=("$t"); done
  "${SWEEPC[@]}" compare "$OUT" --plain plain --dflash dflash --tags "${tags[@]}" --json "$OUT/sweep.json" \
    --title "trained pair, SGLang 0.5.13.post1 + DDTree payload, CUDA graphs on, H200 ($(date -u +%F))" 2>&1 \
    | tee "$OUT/summary.txt"
  return "${PIPESTATUS[0]}"
}
at_deadline() { ts "watchdog: summary and packing at the deadline"; summarize; pack; }
start_watchdog $(( DEADLINE - $(date +%s) - 15 )) at_deadline
WARM=("${TAGS[@]:0:3}"); REST=("${TAGS[@]:3}")
for v in "${WARM[@]}"; do IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
WP=(); for v in "${WARM[@]}"; do t=${v%%|*}; WP+=("${PORT[$t]}:${PID[$t]}"); done
python3 $HERE/wait_all.py 300 "${WP[@]}"
ts "warm-up servers up"
for v in "${REST[@]}"; do IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
RP=(); for v in "${REST[@]}"; do t=${v%%|*}; RP+=("${PORT[$t]}:${PID[$t]}"); done
python3 $HERE/wait_all.py $(( DEADLINE - $(date +%s) - 150 )) "${RP[@]}"
ts "all servers up or dead; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
for v in "${TAGS[@]}"; do
  t=${v%%|*}
  left=$(( DEADLINE - $(date +%s) - 30 ))
  if [ "$left" -lt 15 ]; then ts "skip $t: no time left"; continue; fi
  ref=(); [ "$t" = plain ] && ref=(--reference)
  timeout "$left" "${SWEEPC[@]}" run --port "${PORT[$t]}" --tag "$t" --out "$OUT/$t.json" \
    --prompts /tmp/pair/heldout_prompts.json --wait 30 --pid "${PID[$t]}" "${ref[@]}" > "$OUT/client_$t.log" 2>&1
  ts "$t rc=$? $(grep -c '^\[sweep\]' "$OUT/client_$t.log") runs; $(grep '^\[sweep\].*greedy bs1' "$OUT/client_$t.log" | cut -c1-160)"
  kill -TERM -- "-${PID[$t]}" 2>/dev/null  # free its CPU and GPU share
done
stop_watchdog
stop_all; trap - EXIT
for t in "${!PID[@]}"; do grep -hE "Traceback|Error|refused" "$OUT/server_$t.log" | head -3 | sed "s/^/[$t] /" | cut -c1-300; done
summarize; RC=$?
ts "done"
pack
exit "$RC"
