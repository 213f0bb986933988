# Sourced by run_device.sh when LIMITS=1 (issue 23): the servers are in TAGS, the first one warms up.
# Sets: r (random model, --context-length 1024, --cuda-graph-max-bs 32), q (the same model at 4096 and 8),
# p (peaked model, 1024 / 32), h (LIMITS_SET=h alone: the trained hybrid pair, 1024 / 32: mix and limits;
# LIMITS_SET=hd / hm: the dense / MoE Qwen3.5 hybrid, random (h) and peaked (k: drafts accepted, deep commits), each with the
# deepest-node commit that must fail; k also samples at T 1 and proves liveness. With HYB_PAIR=1 the trained dense
# pair is h (hd) or that pair made MoE (hm, make_tiny_hybrid.py --moe-from-dense), and again x with the radix cache
# (mix with 40 round-2 requests, limits, samples, liveness); then B, the pair's speed one server at a time).
# Every server: CUDA graphs, no overlap scheduler (run_device.sh's LIMITS flags).
# A1: each set's plain server makes its workloads (production_mix.py --make; plain returns top-5 logprobs).
# A2, clients of different servers in parallel (the verdicts do not depend on timing):
#   r: the production mix, then the limits workload (a full graph batch of 32 near the context limit);
#   q: the limits workload (8 near 4096);  p: the penalties workload (+ the logprob probe), the production
#   mix, and the first-3-token samples at T 1 / top_p 1 (plain and full 64). LIMITS_SET=p (the peaked set
#   alone): samples at T 0.8 / top_p 0.95 with the biased walk (must be rejected), and the penalties on
#   upstream DFLASH and the previous payload (must fault: the workload catches what was fixed).
# r_auto / q_auto / p_auto (issue 24, when served): the same workloads as full 64 / 512 / 64 on their set.
# C: upstream DFLASH without the payload on r's limits workload and (with dist/old/) the previous
#   payload's full 512 on q's: both expected to crash; greedy only (upstream also stalls on mixed batches).
# Then production_mix.py compare per workload, graphs_proof.py compare for the samples, the GPU checks.
PROOF=(python3 $HERE/graphs_proof.py)
pack() {  # only a few files come back from the device: keep the summaries, pack the rest (an earlier pack inside)
  ( cd "$OUT" && { [ ! -f logs.tgz ] || mv logs.tgz "logs_until_$(date +%s).tgz"; } && find . -maxdepth 1 -type f ! -name summary.txt ! -name run.log ! -name logs.tgz -printf '%P\n' \
      | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
    && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name run.log -delete )
}
at_deadline() { ts "watchdog: packing at the deadline"; pack; }
start_watchdog $(( DEADLINE - $(date +%s) - 10 )) at_deadline
start_servers 200
has() { [ -n "${PORT[$1]:-}" ]; }
served() { for t; do has "$t" && printf '%s ' "$t"; done; }
if [ "${LEAK_PROBE:-0}" = 1 ]; then  # issue 26: which request kind leaks KV slots (leak_probe.py), every server at once
  LP=()
  for v in "${TAGS[@]}"; do t=${v%%|*}; ctx=1024; [ "${t%%_*}" = q ] && ctx=4096
    timeout $(( DEADLINE - $(date +%s) - 30 )) python3 $HERE/leak_probe.py --port "${PORT[$t]}" --tag "$t" \
      --out "$OUT/${t}_leak.json" --context-length $ctx --pid "${PID[$t]}" --wait $(( DEADLINE - $(date +%s) - 60 )) \
      > "$OUT/client_$t.log" 2>&1 & LP+=($!)
  done
  wait "${LP[@]}"
  stop_all; trap - EXIT
  { cat "$OUT"/client_*.log; for t in "${!PID[@]}"; do
      grep -hE "memory leak detected" "$OUT/server_$t.log" | head -2 | sed "s/^/[$t] /" | cut -c1-300; done
  } 2>&1 | tee "$OUT/summary.txt"
  stop_watchdog; pack; exit 0
fi
work() {  # TAG KIND [ARGS...]: one production_mix.py workload on one server
  local tag=$1 kind=$2 set=${1%%_*}; shift 2
  local ctx=1024 gbs=32
  [ "$set" = q ] && ctx=4096 gbs=8
  has "$tag" || return 0
  local limit=$(( DEADLINE - $(date +%s) - 60 ))
  [ -n "${WORK_TIMEOUT:-}" ] && [ "$WORK_TIMEOUT" -lt "$limit" ] && limit=$WORK_TIMEOUT
  timeout $limit python3 $HERE/production_mix.py run --port "${PORT[$tag]}" --tag "$tag" \
    --out "$OUT/${tag}_$kind.json" --workload "$OUT/workload_${kind}_$set.json" --kind "$kind" --context-length $ctx \
    --graph-bs $gbs --wait ${WAIT_HEALTHY:-60} --pid "${PID[$tag]}" "$@" >> "$OUT/client_$tag.log" 2>&1
  ts "$tag $kind rc=$? $(tail -1 "$OUT/client_$tag.log" | cut -c1-200)"
}
samples() {  # TAG T TOP_P: 2000 x 3 prompts of 3 tokens (T 1 / top_p 1: no filter at all)
  has "$1" || return 0
  timeout $(( DEADLINE - $(date +%s) - 40 )) "${PROOF[@]}" run --port "${PORT[$1]}" --tag "${1}_t$2" \
    --out "$OUT/${1}_t$2_proof.json" --wait 60 --pid "${PID[$1]}" --samples 2000 --temperature $2 --top-p $3 \
    >> "$OUT/proof_$1.log" 2>&1
  ts "$1 samples T $2 top_p $3 rc=$?"
}
live() {  # TAG FLAGS...: graphs_proof.py's liveness rounds (8 sampled + 8 greedy, 20 rounds, 15 s bound) or --perf
  has "$1" || return 0
  timeout $(( DEADLINE - $(date +%s) - 40 )) "${PROOF[@]}" run --port "${PORT[$1]}" --tag "$1" --out "$OUT/${1}_proof.json" \
    --wait 60 --pid "${PID[$1]}" "${@:2}" >> "$OUT/proof_$1.log" 2>&1
  ts "$1 ${*:2} rc=$?"
}
hybrid() {  # TAG: a hybrid server's workloads; on the accepting sets (k, x) samples at T 1 and liveness as well
  work "$1" mix; work "$1" limits
  case $1 in
    [kx]_full64|[kx]_full256) samples "$1" 1 1; live "$1" --liveness ;;
    [kx]_dflash) live "$1" --liveness ;;
  esac
}
T1=$([ "${LIMITS_SET:-}" = p ] || echo 1)  # the peaked set's own call samples at T 0.8, the full call at T 1
# A1 (a server still starting after wait_all's limit gets until the deadline's last 90 s, 60 s at least)
export WAIT_HEALTHY=$(( DEADLINE - $(date +%s) - 90 )); [ "$WAIT_HEALTHY" -ge 60 ] || WAIT_HEALTHY=60
( work r_plain mix --make; work r_plain limits --make ) & P1=$!
( work q_plain limits --make ) & P2=$!
( work p_plain penalties --make; work p_plain mix --make ) & P3=$!
( work h_plain mix --make; work h_plain limits --make ) & P4=$!
( work k_plain mix --make; work k_plain limits --make ) & P5=$!
( work x_plain mix --make --round2 40; work x_plain limits --make ) & P6=$!  # round 2 over the radix cache
wait $P1 $P2 $P3 $P4 $P5 $P6
ts "A1 done (workloads made)"
# A2
JOBS=()
for t in r_dflash r_shadow r_full15 r_full64 r_full256 r_auto r_full64_eager; do has $t && { ( work $t mix; work $t limits ) & JOBS+=($!); }; done
for t in q_dflash q_full64 q_full512 q_auto; do has $t && { ( work $t limits ) & JOBS+=($!); }; done
for t in h_dflash h_full15 h_full64 h_full256 h_full64_deepest k_dflash k_full64 k_full256 k_full64_deepest \
         x_dflash x_full64 x_full256 x_full64_deepest; do
  has $t && { ( hybrid $t ) & JOBS+=($!); }
done
for t in k_plain x_plain; do has $t && { ( samples $t 1 1 ) & JOBS+=($!); }; done
TP=${T1:+1}; TP=${TP:-0.95}; TT=${T1:-0.8}
LIVE=; [ "${LIMITS_LIVE:-0}" = 1 ] && LIVE=1
has p_dflash && { ( work p_dflash penalties; work p_dflash mix; [ -z "$LIVE" ] || live p_dflash --liveness ) & JOBS+=($!); }
has p_full64 && { ( work p_full64 penalties; work p_full64 mix; samples p_full64 $TT $TP; [ -z "$LIVE" ] || live p_full64 --liveness ) & JOBS+=($!); }
has p_auto && { ( work p_auto penalties; work p_auto mix; samples p_auto $TT $TP; [ -z "$LIVE" ] || live p_auto --liveness ) & JOBS+=($!); }
has p_plain && { ( samples p_plain $TT $TP ) & JOBS+=($!); }
has p_full64_bias && { ( samples p_full64_bias $TT $TP ) & JOBS+=($!); }
# upstream's DFLASH also takes p's mix when served with the full list's p set (LIMITS_SET=p keeps it to the penalties)
PRISTINE_MIX=; [ "${LIMITS_SET:-}" = p ] || PRISTINE_MIX=1
for t in p_dflash_pristine p_full64_old; do has $t && { ( work $t penalties
  [ -z "$PRISTINE_MIX" ] || [ $t != p_dflash_pristine ] || work $t mix ) & JOBS+=($!); }; done
[ ${#JOBS[@]} = 0 ] || wait "${JOBS[@]}"
ts "A2 done"
# B (LIMITS_SET=hd / hm HYB_PAIR=1): the trained pair's speed, one server at a time (batch 1, 8, 32)
if { [ "${LIMITS_SET:-}" = hd ] || [ "${LIMITS_SET:-}" = hm ]; } && [ "${HYB_PAIR:-0}" = 1 ]; then
  for t in h_dflash h_full15 h_full64 h_full256 h_plain; do [ $(( DEADLINE - $(date +%s) )) -gt 90 ] && live $t --perf; done
fi
for t in "${!PID[@]}"; do
  case $t in r_dflash_pristine|q_full512_old|h_dflash_pristine) continue ;; esac
  kill -TERM -- "-${PID[$t]}" 2>/dev/null
  grep -hE "DDTree (enabled|full: verify)|Traceback|Error|refused" "$OUT/server_$t.log" | head -4 | sed "s/^/[$t] /" | cut -c1-300
done
wait $SKC_PID 2>/dev/null
# C: what crashes, alone on the GPU, bounded
( WORK_TIMEOUT=90 work r_dflash_pristine limits --greedy-only ) & C1=$!  # a hung server must not eat the call
( WORK_TIMEOUT=90 work q_full512_old limits --greedy-only ) & C2=$!
( WORK_TIMEOUT=90 work h_dflash_pristine limits --greedy-only ) & C3=$!
wait $C1 $C2 $C3
for t in r_dflash_pristine q_full512_old h_dflash_pristine; do
  has $t && grep -hE "RuntimeError|Traceback|expanded size" "$OUT/server_$t.log" | head -3 | sed "s/^/[$t] /" | cut -c1-300
done
stop_all; trap - EXIT
MIXC=(python3 $HERE/production_mix.py compare "$OUT")
{ echo "--- GPU checks: sampled walk vs sgl_kernel, the leftover case, plain's filters"; cat "$OUT/sampling_kernels_check.log"
  echo "--- builder and verify-step Triton tests on the GPU"; tail -3 "$OUT/triton_tests.log" 2>/dev/null
  if has r_plain; then
    echo "--- production mix (r, context 1024, graphs on)"
    # as on p: a divergence DFLASH shares (bf16, plain against any verify; stop0 on 2026-12-07) is classed upstream
    "${MIXC[@]}" r_plain --suffix _mix $(has r_dflash && echo --upstream r_dflash) -- \
      $(served r_dflash r_shadow r_full15 r_full64 r_full256 r_auto r_full64_eager); echo "rc=$?"
    echo "--- limits: a graph batch of 32 at --context-length 1024"
    "${MIXC[@]}" r_plain --suffix _limits --expect-dead $(served r_dflash_pristine) -- \
      $(served r_dflash r_shadow r_full15 r_full64 r_full256 r_auto r_full64_eager r_dflash_pristine); echo "rc=$?"
  fi
  if has q_plain; then
    echo "--- limits: a graph batch of 8 at --context-length 4096"
    "${MIXC[@]}" q_plain --suffix _limits --expect-dead $(served q_full512_old) -- \
      $(served q_dflash q_full64 q_full512 q_auto q_full512_old); echo "rc=$?"
  fi
  if has p_plain; then
    echo "--- penalties (greedy) and the logprob probe"
    "${MIXC[@]}" p_plain --suffix _penalties --expect-fault $(served p_dflash_pristine p_full64_old) -- \
      $(served p_dflash p_full64 p_auto p_dflash_pristine p_full64_old); echo "rc=$?"
    python3 -c "import json,sys; [print(t, json.load(open(f'$OUT/{t}_penalties.json')).get('logprob_probe')) for t in sys.argv[1:]]" \
      $(served p_plain p_dflash p_full64 p_auto)
    echo "--- production mix (p, context 1024, graphs on)"
    # DFLASH's own bf16 divergence (stop5, every call since issue 12) is classed upstream, not the payload's
    # upstream's DFLASH on 0.5.17 dies of its idle pool check there (the rows the payload widens)
    "${MIXC[@]}" p_plain --suffix _mix $(has p_dflash && echo --upstream p_dflash) \
      $([ -n "$PRISTINE_MIX" ] && has p_dflash_pristine && echo --expect-dead p_dflash_pristine) -- $(served p_dflash p_full64 p_auto)$([ -n "$PRISTINE_MIX" ] && served p_dflash_pristine); echo "rc=$?"
    echo "--- samples at T $TT / top_p $TP"
    "${PROOF[@]}" compare "$OUT" --plain p_plain_t$TT --cand p_full64_t$TT \
      $(has p_full64_bias && echo --biased p_full64_bias_t$TT); echo "rc=$?"
    has p_auto && { "${PROOF[@]}" compare "$OUT" --plain p_plain_t$TT --cand p_auto_t$TT; echo "rc=$?"; }
    [ -n "$LIVE" ] && { echo "--- liveness (8 sampled + 8 greedy, 20 rounds)"; "${PROOF[@]}" compare "$OUT" --plain p_plain_t$TT --liveness $(served p_dflash p_full64 p_auto); echo "rc=$?"; }
  fi
  if has h_plain; then  # LIMITS_SET=h / hd: the hybrids; on the MoE pair what the margin rule leaves goes to the float32 oracle
    echo "--- hybrid ($LIMITS_SET): production mix (context 1024, graphs on up to 32)"
    "${MIXC[@]}" h_plain --suffix _mix --upstream h_dflash -- $(served h_dflash h_full15 h_full64 h_full256); echo "rc=$?"
    echo "--- hybrid ($LIMITS_SET): limits, a graph batch of 32 at --context-length 1024"
    "${MIXC[@]}" h_plain --suffix _limits --upstream h_dflash --expect-dead $(served h_dflash_pristine) -- \
      $(served h_dflash h_full15 h_full64 h_full256 h_dflash_pristine); echo "rc=$?"
    if has h_full64_deepest; then
      for k in mix limits; do
        echo "--- hybrid ($LIMITS_SET), $k: the deliberately wrong commit (expected to fail)"
        "${MIXC[@]}" h_plain --suffix "_$k" --upstream h_dflash --expect-fault h_full64_deepest -- h_full64_deepest; echo "rc=$?"
      done
    fi
  fi
  # k: the peaked Qwen3.5 hybrid; x: the pair with the radix cache (round 2 resumes from it); each judged by its own
  # plain, served with or without the h set
  for s in k x; do
    has ${s}_plain || continue
    echo "--- $LIMITS_SET, $s: production mix and limits$([ $s = x ] && echo ', radix cache on (extra_buffer)')"
    for k in mix limits; do
      # DFLASH judged by itself first (with the radix cache its tracking is the payload's too, 0.5.17)
      has ${s}_dflash && { "${MIXC[@]}" ${s}_plain --suffix "_$k" -- ${s}_dflash; echo "rc=$?"; }
      "${MIXC[@]}" ${s}_plain --suffix "_$k" --upstream ${s}_dflash -- $(served ${s}_full64 ${s}_full256); echo "rc=$?"
      echo "--- $s, $k: the deliberately wrong commit (expected to fail)"
      "${MIXC[@]}" ${s}_plain --suffix "_$k" --upstream ${s}_dflash --expect-fault ${s}_full64_deepest -- ${s}_full64_deepest
      echo "rc=$?"
    done
  done
  for s in k x; do
    has ${s}_plain || continue
    echo "--- $s: samples at T 1 / top_p 1 (3 tokens), liveness"
    "${PROOF[@]}" compare "$OUT" --plain ${s}_plain_t1 --cand $(for t in $(served ${s}_full64 ${s}_full256); do printf '%s_t1 ' $t; done) \
      --liveness $(served ${s}_dflash ${s}_full64 ${s}_full256); echo "rc=$?"
  done
  if has h_plain; then
    if [ "${HYB_PAIR:-0}" = 1 ]; then
      echo "--- the pair ($LIMITS_SET): speed, one server at a time (radix cache off)"
      "${PROOF[@]}" compare "$OUT" --plain h_plain --perf $(served h_plain h_dflash h_full15 h_full64 h_full256) --ratio-to h_dflash; echo "rc=$?"
    fi
    [ "$LIMITS_SET" = h ] && for k in mix limits; do
      echo "--- hybrid pair, $k: route ties (float32 oracle, CPU)"
      python3 $HERE/route_ties.py "$OUT" --model /tmp/pair_h/next/target --plain h_plain --suffix "_$k" \
        --workload "$OUT/workload_${k}_h.json" --upstream h_dflash --cand $(served h_dflash h_full15 h_full64 h_full256)
      echo "rc=$?"
    done
  fi
} 2>&1 | tee "$OUT/summary.txt"
ts "done"
stop_watchdog
pack
