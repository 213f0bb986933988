# Sourced by run_device.sh when AUTO=1 (issue 24): `--speculative-ddtree-budget auto` against DFLASH and fixed
# budgets, CUDA graphs on, on the trained pair (p_) and on its real-size shell (s_: make_shell.py, 36 layers,
# hidden 4096: every verify step costs what an 8B model's does, the outputs are the pair's).
# Waves (AUTO_WAVES, default "plain dflash auto|dflash 16 32|dflash 64 128": fixed budgets by number) on both
# sets (AUTO_SETS, default "p s"); every wave has its own DFLASH, so each server's ratio is paired with a DFLASH
# of the same minutes. AUTO_PASSES (2), AUTO_BATCHES, AUTO_TEMPS, AUTO_MAX_NEW (64), AUTO_MIN_TOKENS (512: a small batch
# repeats over the next prompts until it has generated this many), AUTO_MIN_SECONDS (1: and until a measurement has
# lasted this long), AUTO_WARMUP (warm-up batches per
# size, 1) shape the measurement.
# Each wave's servers start together, then auto_bench.py measures them in paired passes (AUTO_PASSES, default 2)
# at batch 1..64 (AUTO_BATCHES), greedy and T 0.8 (AUTO_TEMPS), plain's greedy outputs the identity reference.
# Summaries: auto_bench.py compare over both waves' JSON per set -> summary.txt.
# AUTO_PROFILE=1: auto and the fixed budgets run with SGLANG_DDTREE_PROFILE=1 (run_device.sh's PROF) and every
# measurement keeps their per-phase step times (where auto's steps cost more than a fixed budget's at the same plan).
ABENCH=(python3 $HERE/auto_bench.py)
pack() {
  ( cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name 'auto_*.json' ! -name run.log \
      ! -name logs.tgz -printf '%P\n' | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
    && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name 'auto_*.json' ! -name run.log -delete )
}
summarize() {
  # the card that ran it (issue 24's figures count only from an H200; a title must not say so for another card)
  local fixed_p=() fixed_s=() b gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); gpu=${gpu:-unknown GPU}
  for b in ${AUTO_FIXED:-16 32 64 128}; do fixed_p+=(p_full$b); fixed_s+=(s_full$b); done
  # a set this call did not measure (AUTO_SETS) has no files and no summary
  { if ls "$OUT"/auto_p_*.json > /dev/null 2>&1; then
      "${ABENCH[@]}" compare "$OUT"/auto_p_*.json --plain p_plain --dflash p_dflash --auto p_auto \
        --fixed "${fixed_p[@]}" --title "trained pair (hidden 256), $gpu $(date -u +%F)"
    fi
    if ls "$OUT"/auto_s_*.json > /dev/null 2>&1; then
      "${ABENCH[@]}" compare "$OUT"/auto_s_*.json --plain s_plain --dflash s_dflash --auto s_auto \
        --fixed "${fixed_s[@]}" --cost-realistic --title "real-size shell of the pair (36 x 4096), $gpu $(date -u +%F)"
    fi
  } 2>&1 | tee "$OUT/summary.txt"
}
at_deadline() { ts "watchdog: summary and packing at the deadline"; summarize; pack; }
start_watchdog $(( DEADLINE - $(date +%s) - 15 )) at_deadline
# The shell's servers hold 16.2 GB of weights each and need KV room beside them (--mem-fraction-static is taken of
# what is free when each starts): four fit an H200's 139 GiB, not an H100's 80 (2026-12-06: every tree server died
# "Not enough memory", DFLASH ran on a 362-token pool). A wave that cannot fit is skipped, said, not half-measured.
SHELL_SERVER_MIB=${SHELL_SERVER_MIB:-24000}
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
run_wave() {  # NAME TAG...: start the wave's servers together, measure each set's, stop them
  local wave=$1; shift
  local ports=() t v shells=0
  for t in "$@"; do [[ $t == s_* ]] && shells=$((shells + 1)); done
  if [ "$shells" -gt 0 ] && [ -n "$GPU_MIB" ] && [ $(( shells * SHELL_SERVER_MIB )) -gt "$GPU_MIB" ]; then
    ts "skip wave $wave: its $shells shell servers need ~$(( shells * SHELL_SERVER_MIB )) MiB, this GPU has $GPU_MIB MiB (an H200, or fewer shell servers a wave)"
    return
  fi
  for t in "$@"; do
    for v in "${TAGS[@]}"; do [ "${v%%|*}" = "$t" ] || continue; IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
  done
  for t in "$@"; do [ -n "${PID[$t]:-}" ] && ports+=("${PORT[$t]}:${PID[$t]}"); done
  python3 $HERE/wait_all.py $(( DEADLINE - $(date +%s) - 120 )) "${ports[@]}"
  ts "wave $wave up or dead; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
  for set in ${AUTO_SETS:-p s}; do
    local servers=() ref=()
    for t in "$@"; do [[ $t == ${set}_* ]] && [ -n "${PID[$t]:-}" ] && servers+=("$t=${PORT[$t]}:${PID[$t]}"); done
    [ ${#servers[@]} -gt 0 ] || continue
    [[ " $* " == *" ${set}_plain "* ]] && ref=(--reference ${set}_plain)
    local prof=()
    [ "${AUTO_PROFILE:-0}" = 1 ] && for t in "$@"; do [[ $t == ${set}_auto || $t == ${set}_full* ]] && prof+=("$t"); done
    local left=$(( DEADLINE - $(date +%s) - 40 ))
    [ "$left" -gt 20 ] || { ts "skip $set wave $wave: no time left"; continue; }
    timeout "$left" "${ABENCH[@]}" run --servers "${servers[@]}" "${ref[@]}" --prompts /tmp/pair/heldout_prompts.json \
      --out "$OUT/auto_${set}_$wave.json" --passes "${AUTO_PASSES:-2}" --batches "${AUTO_BATCHES:-1,2,4,8,16,32,64}" \
      --temps "${AUTO_TEMPS:-0,0.8}" --max-new "${AUTO_MAX_NEW:-64}" --min-tokens "${AUTO_MIN_TOKENS:-512}" --min-seconds "${AUTO_MIN_SECONDS:-1}" --warmup "${AUTO_WARMUP:-1}" --wait 60 \
      ${prof[@]:+--profiled "${prof[@]}"} > "$OUT/client_${set}_$wave.log" 2>&1
    ts "$set wave $wave rc=$? $(grep -c 'tok/s' "$OUT/client_${set}_$wave.log") measurements"
    grep -E "pass 0 T 0 bs (1|8|64) " "$OUT/client_${set}_$wave.log" | cut -c1-160
  done
  for t in "$@"; do
    # v1's "DDTree auto: verify graphs at widths ..." and v2's "DDTree v2 auto: verify graphs at widths ..." (the ladder)
    grep -hE "DDTree (v2 )?auto|DDTree full|Traceback|Error|refused" "$OUT/server_$t.log" 2>/dev/null | grep -v "server_args=" \
      | head -5 | sed "s/^/[$t] /" | cut -c1-400
    [ -n "${PID[$t]:-}" ] && kill -TERM -- "-${PID[$t]}" 2>/dev/null
  done
  sleep 5
  for t in "$@"; do mv "$OUT/server_$t.log" "$OUT/server_${t}_w$wave.log" 2>/dev/null; done  # a later wave reuses the tag
}
# AUTO_WAVES: the servers of each wave by kind, waves split by '|'; both sets' servers of a kind start together.
IFS='|' read -r -a WAVES <<< "${AUTO_WAVES:-plain dflash auto|dflash 16 32|dflash 64 128}"
w=0
for kinds in "${WAVES[@]}"; do
  w=$((w + 1)); members=()
  for k in $kinds; do
    for set in ${AUTO_SETS:-p s}; do
      case $k in plain|dflash|auto) members+=(${set}_$k) ;; *) members+=(${set}_full$k) ;; esac
    done
  done
  run_wave "$w" "${members[@]}"
done
stop_watchdog
stop_all; trap - EXIT
summarize; RC=${PIPESTATUS[0]}
ts "done"
pack
exit "$RC"
