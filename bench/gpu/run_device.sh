#!/bin/bash
# DDTree proof in real SGLang 0.5.13.post1 — run ON THE GPU MACHINE (nvidia-h200) from the repo root,
# with `.gpu` (carried site-packages, bench/gpu/build_carry.sh) and `dist` (the payload bundle,
# `ddtree-ops build` / ddtree_ops.bundle.build_bundle) in the run's carry:
#   bash bench/gpu/run_device.sh 2>&1 | tee $OUT/run.log
# 1) unpack the carry to /tmp/site, install the DDTree bundle there (sha256-checked, pristine-checked)
# 2) tiny random Qwen3 target + DFlash draft, random (/tmp/tiny_r) and PEAKED (/tmp/tiny_p), and tiny
#    hybrid targets (/tmp/tiny_h: a real Qwen3-Next, and a Qwen3 with a recurrent config marker)
# 3) servers, all with --attention-backend triton, greedy: for each model set
#    plain | DFLASH | DFLASH+DDTree shadow-linear | DFLASH+DDTree full at budgets 15, 64, 256,
#    plus DDTree full (must be refused by the worker's hybrid guard) and shadow-linear on the hybrids.
#    One server starts alone to warm the JIT caches; the rest start together on the one GPU so a
#    single call fits every variant. Each tiny server really uses ~2 GB (KV capped by
#    --max-total-tokens); SGLang 0.5.13.post1 sizes its pool as free_after_load - free_before_load *
#    (1 - fraction) ~= fraction * (total - used by others) - weights, so 0.3 leaves ample room even
#    with ~20 servers on GPU 0 (TP servers take the minimum over their ranks).
# 4) the same greedy requests to each (sequentially: timings are not shared), then compare_ddtree.py.
# Env: BUDGET_S (deadline, default 560), ONLY="tag tag" (subset), SGLANG_DDTREE_LOG_EVERY (default 8),
#   COMMON_EXTRA (flags added to every server), SITE_TAR (the carried site, default .gpu/site312.tar.xz;
#   .gpu/site312-0.5.17.tar.xz, from build_carry.sh BASE=0.5.17, is SGLang 0.5.17: dist's bundle of that base is
#   installed). HYBRID_KERNELS=1: first hybrid_kernels_check.py on the GPU (issue 25,
#   G1; HYBRID_KERNELS_ONLY=1 stops after it; HYBRID_KERNELS_ARGS adds flags, e.g. --dedup-windows).
# NORADIX_SETS="r q" (set prefixes): those servers also get --disable-radix-cache.
# MIX=1 (issue 12): the production-mix proof instead (production_mix.py): --context-length 1024,
#   --schedule-policy fcfs; for the random (r_) and peaked (p_) sets plain | DFLASH | full 16, 64, 256;
#   a retraction set (*_rt: --max-total-tokens 4096, SGLANG_TEST_RETRACT=1) plain | full 64, 256; and,
#   r_full256_cap (SGLANG_DDTREE_MAX_VERIFY_TOKENS=1024: busy steps verify smaller trees); and,
#   when dist/old/ holds an older bundle, r_full64_old / r_full256_old served from it (the payload
#   before the fix: expected to fail, which shows the workload catches the fault).
# TP2=1 (nvidia-h200-x2, issue 6): first tp_tree_check.py --nproc 2 (NCCL, SGLang's real TP groups and
#   ParallelLMHead shards: the gathered-vocab tree equals the one-device tree; runs in the background
#   while the warm-up server starts, log $OUT/tp_tree_check.log), then also serves p_plain_tp2,
#   p_dflash_tp2, p_full64_tp2, p_shadow_tp2, r_full64_tp2 = their one-GPU twins + --tp-size 2 on GPUs
#   0,1, each with its own --nccl-port (server port + 5; our ports stay below the ephemeral range that
#   the one-GPU servers' random NCCL ports come from). One-GPU servers stay on GPU 0 (--base-gpu-id 0).
#   On a v2 base (SITE_TAR=.gpu/site312-0.5.17.tar.xz) the TP servers run under the v2 TP proof switch.
#   TP2_EXTRA (default --disable-custom-all-reduce: its v2 kernel would JIT-compile in every TP server at
#   start; the DDTree gather is an all-gather over NCCL either way) is added to the TP servers' flags.
# MIX_SET=h (issue 25, with MIX=1): the hybrid set; HYB_MODELS picks its model dir (<dir>/next/{target,draft});
#   HYB_RADIX=1 serves it with the radix cache (extra_buffer tracking every HYB_TRACK tokens) instead of without;
#   h_dflash_pristine serves upstream DFLASH without the payload (judged beside the payload's DFLASH);
#   HYB_PAIR=1 serves the trained hybrid pair from .gpu/pair_h (train_pair_device.sh HYBRID=1);
#   the summary ends with route_ties.py (what the margin rule leaves, judged by float32 with router near-ties flipped).
# GRAPHS=1 (issue 13): graphs_phases.sh. SWEEP=1 (issue 14): sweep_phases.sh, on the trained pair that
#   train_pair_device.sh made (unpack its pair.tar and heldout_prompts.json into .gpu/pair/).
# AUTO=1 (issue 24): auto_phases.sh: --speculative-ddtree-budget auto vs DFLASH and fixed budgets at batch 1..64 on
#   the trained pair and its real-size shell (make_shell.py); needs the pair in .gpu/pair like SWEEP=1, or TRAIN_PAIR=1
#   (a checkout without it: the pair is trained first, in the same call).
# LIMITS=1 (issue 23): limits_phases.sh (LIMITS_SET=p the peaked set alone, LIMITS_SET=h the hybrid pair,
#   LIMITS_SET=hd the hybrid without MoE, LIMITS_SET=hm Qwen3.5's MoE architecture):
#   full graph batches at the context limit (1024 and 4096), penalties,
#   samples at T 1 / top_p 1, the logprob probe, the production mix; upstream DFLASH (and, with
#   dist/old/, the previous payload's full 64) on the limits workload, expected to crash. LEAK_PROBE=1 (with LIMITS=1):
#   instead, leak_probe.py on every server (one request kind at a time, each followed by an idle check). LIMITS_LIVE=1: p_dflash,
#   p_full64 and p_auto also run graphs_proof.py's liveness rounds (issue 26 asks them of each base).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/device_env.sh"
export SGLANG_DISABLE_REQUEST_LOGGING=1 SGLANG_DDTREE_LOG_EVERY=${SGLANG_DDTREE_LOG_EVERY:-8}
# a multimodal target (the dense hybrid) forks a processor pool of this many per server (default: every core)
export SGLANG_CPU_WORKERS=${SGLANG_CPU_WORKERS:-2}
if command -v nvcc >/dev/null; then export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}; fi
DEADLINE=$(( T0 + ${BUDGET_S:-560} ))
SITE_TAR=${SITE_TAR:-.gpu/site312.tar.xz}

ts "start"; nvidia-smi -L; python3 -V
# Always a fresh pristine tree: a bundle from an earlier call must not meet a newer one.
rm -rf /tmp/site && mkdir -p /tmp/site && tar -C /tmp/site -xJf "$SITE_TAR" || { echo "extract failed"; exit 1; }
export PYTHONPATH=/tmp/site
# The bundle of the carried site's base: site312-<base>.tar.xz takes ddtree-payload-*-sglang<base>.tar.gz, the
# default site the 0.5.13.post1 bundle (no -sglang suffix), whatever else dist holds.
SITE_BASE=$(basename "$SITE_TAR" .tar.xz); SITE_BASE=${SITE_BASE#site312}; SITE_BASE=${SITE_BASE#-}
pick_bundle() { ls "$1"/ddtree-payload-*.tar.gz 2>/dev/null | grep -E -- "${SITE_BASE:+-sglang$SITE_BASE}\.tar\.gz\$" \
  | { [ -n "$SITE_BASE" ] && cat || grep -v -- -sglang; } | head -1; }
BUNDLE=$(pick_bundle dist)
[ -n "$BUNDLE" ] || { echo "no bundle in dist/ for the carried site ($SITE_TAR)"; exit 1; }
OLD_BUNDLE=$(pick_bundle dist/old)
if { [ "${MIX:-0}" = 1 ] || [ "${LIMITS:-0}" = 1 ]; } && [ -n "$OLD_BUNDLE" ]; then
  rm -rf /tmp/site_old && mkdir -p /tmp/site_old && tar -C /tmp/site_old -xJf "$SITE_TAR" \
    && PYTHONPATH=/tmp/site_old:$PWD python3 -c "import sys; from ddtree_ops.bundle import install_bundle; \
print('old bundle', install_bundle(sys.argv[1], '/tmp/site_old').payload_version)" "$OLD_BUNDLE" || OLD_BUNDLE=
fi
PYTHONPATH=/tmp/site:$PWD python3 - "$BUNDLE" <<'EOF' || { echo "bundle install failed"; exit 1; }
import sys
from ddtree_ops.bundle import check_tree_against_record, install_bundle
m = install_bundle(sys.argv[1], "/tmp/site")
print("installed", sys.argv[1], m.payload_version, [f.path for f in m.patched_files + m.new_files])
bad = check_tree_against_record("/tmp/site", version=m.base_version, ignore=[f.path for f in m.patched_files])
bad = [b for b in bad if b.startswith("sglang/") and not b.endswith(": missing")]  # the carry drops tests/benchmarks
print("untouched upstream files differing from RECORD:", len(bad), bad[:5])
EOF
ts "site extracted + bundle installed"
# KERNEL_TESTS=1: the verify kernels' GPU test (every kernel against its torch path, bit for bit; mostly compiling,
# on the CPU) beside whatever this call serves; needs pytest in .gpu/pytest_site (README). --noconftest: the suite's
# conftest imports the control side's packages (paramiko), which the GPU site does not carry
if [ "${KERNEL_TESTS:-0}" = 1 ] && [ -d .gpu/pytest_site ]; then
  ( PYTHONPATH=/tmp/site:$PWD/.gpu/pytest_site timeout 400 python3 -m pytest -q -p no:cacheprovider --noconftest \
      tests/test_ddtree_verify_step.py -k gpu > "$OUT/kernel_tests.log" 2>&1; echo "rc=$?" >> "$OUT/kernel_tests.log" ) &
fi
if [ "${HYBRID_KERNELS:-0}" = 1 ]; then  # issue 25, G1: SGLang's GDN verify kernels on DDTrees, compiled (HYBRID.md §4)
  timeout ${HYBRID_KERNELS_TIMEOUT:-600} python3 $HERE/hybrid_kernels_check.py --device cuda --batch ${HYBRID_KERNELS_BATCH:-4} ${HYBRID_KERNELS_ARGS:-} > "$OUT/hybrid_kernels.json" 2> "$OUT/hybrid_kernels.log"
  ts "hybrid_kernels_check rc=$?"
  python3 -c "import json,sys; t=open(sys.argv[1]).read(); d=json.loads(t[t.index('{'):]); [print(c['case'], c['width'], c['tree_vs_path'], c['commit'], c['ok']) for c in d['cases']]; print('ok', d['ok'])" "$OUT/hybrid_kernels.json" || tail -20 "$OUT/hybrid_kernels.log"
  [ "${HYBRID_KERNELS_ONLY:-0}" = 1 ] && exit 0
fi
TPC_PID=
if [ "${TP2:-0}" = 1 ]; then  # on both GPUs, alongside the model making and the warm-up server
  python3 $HERE/tp_tree_check.py --nproc 2 --device cuda --require-installed --timeout 180 > "$OUT/tp_tree_check.log" 2>&1 &
  TPC_PID=$!
fi

# A trained pair travels in the carry (train_pair_device.sh's pair*.tar unpacked into .gpu/): `carried_pair DIR
# MODELS WHO HOW` checks .gpu/DIR/MODELS{target,draft} (and DIR's extra files after HOW), then copies .gpu/DIR to /tmp.
carried_pair() {
  local dir=$1 models=$2 who=$3 how=$4 f; shift 4
  for f in "${models}target/config.json" "${models}draft/config.json" "$@"; do
    [ -f ".gpu/$dir/$f" ] || { echo "$who needs .gpu/$dir/${models}{target,draft}${*:+ and $*}: run train_pair_device.sh$how"; exit 1; }
  done
  rm -rf "/tmp/$dir" && cp -r ".gpu/$dir" "/tmp/$dir"
}

# TRAIN_PAIR=1: a checkout without .gpu/pair (it is not in git) trains the pair here first, on the carried site
# (train_pair_device.sh, CHECK_SGLANG=0: ~300 s of this call's BUDGET_S), then serves it; back in $OUT/train/ come
# pair.tar and heldout_prompts.json (unpack both into .gpu/pair/ for later calls) and train_logs.tgz.
if [ "${TRAIN_PAIR:-0}" = 1 ] && [ ! -f .gpu/pair/target/config.json ]; then
  mkdir -p "$OUT/train"
  OUT=$OUT/train SITE=/tmp/site_train PAIR=/tmp/pair_trained SITE_TAR=$SITE_TAR CHECK_SGLANG=0 \
    bash "$HERE/train_pair_device.sh" > "$OUT/train/run.log" 2>&1
  rc=$?; tail -6 "$OUT/train/run.log"
  ( cd "$OUT/train" && tar -czf train_logs.tgz run.log train.log train_report.json 2>/dev/null \
    && rm -f run.log train.log train_report.json )
  [ "$rc" = 0 ] || { echo "training the pair failed (rc=$rc)"; exit 1; }
  mkdir -p .gpu/pair && cp -r /tmp/pair_trained/target /tmp/pair_trained/draft /tmp/pair_trained/heldout_prompts.json .gpu/pair/
  rm -rf /tmp/site_train; ts "pair trained"
fi
if [ "${SWEEP:-0}" = 1 ] || [ "${AUTO:-0}" = 1 ]; then
  carried_pair pair "" "SWEEP=1 / AUTO=1" "" heldout_prompts.json
  # issue 24: the pair's real-size shell (make_shell.py), its greedy outputs checked; only when a wave serves it
  if [ "${AUTO:-0}" = 1 ] && [[ " ${AUTO_SETS:-p s} " == *" s "* ]]; then
    python3 $HERE/make_shell.py /tmp/pair /tmp/shell ${SHELL_ARGS:-} > "$OUT/make_shell.log" 2>&1 \
      || { tail -20 "$OUT/make_shell.log"; echo "make_shell failed"; exit 1; }
    tail -4 "$OUT/make_shell.log"; ts "shell made"
  fi
elif { [ "${LIMITS_SET:-}" = hd ] || [ "${LIMITS_SET:-}" = hm ]; } && [ "${HYB_PAIR:-0}" = 1 ]; then
  true & MAKE_PID=$!  # every server serves the carried pair (hm: its MoE twin, made below): no random model to make
else
# The peaked set first (the warm-up server uses it); the others are made while it starts.
PEAKED=1 python3 $HERE/make_tiny_models.py /tmp/tiny_p 2>&1 | grep -v -i "warn\|Writing model"
( PEAKED=0 python3 $HERE/make_tiny_models.py /tmp/tiny_r > "$OUT/make_r.log" 2>&1;
  python3 $HERE/make_tiny_hybrid.py /tmp/tiny_h > "$OUT/make_h.log" 2>&1
  if [ "${MIX_SET:-}" = h ] || [ "${LIMITS_SET:-}" = hd ] || [ "${LIMITS_SET:-}" = hm ]; then
    PEAKED=1 python3 $HERE/make_tiny_hybrid.py /tmp/tiny_hp > "$OUT/make_hp.log" 2>&1; fi ) &
MAKE_PID=$!
ts "peaked models made"
fi

COMMON=(--host 127.0.0.1 --attention-backend triton --sampling-backend pytorch --grammar-backend none
        --disable-cuda-graph --disable-piecewise-cuda-graph --mem-fraction-static 0.3
        --max-total-tokens 16384 --log-level info --base-gpu-id 0)
DF=(--speculative-algorithm DFLASH --speculative-num-draft-tokens 16)
# tag | model dir | extra args   (the draft is <model dir>/draft when DFLASH is on)
VARIANTS=(
  "p_plain|/tmp/tiny_p|"
  "p_dflash|/tmp/tiny_p|DF"
  "p_shadow|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64"
  "p_full15|/tmp/tiny_p|DF --speculative-ddtree-mode full --speculative-ddtree-budget 15"
  "p_full64|/tmp/tiny_p|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64"
  "p_full256|/tmp/tiny_p|DF --speculative-ddtree-mode full --speculative-ddtree-budget 256"
  "r_plain|/tmp/tiny_r|"
  "r_dflash|/tmp/tiny_r|DF"
  "r_shadow|/tmp/tiny_r|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64"
  "r_full15|/tmp/tiny_r|DF --speculative-ddtree-mode full --speculative-ddtree-budget 15"
  "r_full64|/tmp/tiny_r|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64"
  "r_full256|/tmp/tiny_r|DF --speculative-ddtree-mode full --speculative-ddtree-budget 256"
  "h_next_full|/tmp/tiny_h/next|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64 --disable-radix-cache"
  "h_marker_full|/tmp/tiny_h/marker|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64"
  "h_marker_shadow|/tmp/tiny_h/marker|DF --speculative-ddtree-mode shadow-linear"
  # issue 25: upstream DFLASH on the real hybrid (GDN + attention + MoE), against its plain decoding
  "h_next_plain|/tmp/tiny_h/next|--disable-radix-cache" "h_next_dflash|/tmp/tiny_h/next|DF --disable-radix-cache"
)
if [ "${MIX:-0}" = 1 ]; then
  COMMON+=(--context-length 1024 --schedule-policy fcfs)
  FULL="DF --speculative-ddtree-mode full --speculative-ddtree-budget"
  VARIANTS=(
    "r_plain|/tmp/tiny_r|" "r_dflash|/tmp/tiny_r|DF" "r_full16|/tmp/tiny_r|$FULL 16"
    "r_full64|/tmp/tiny_r|$FULL 64" "r_full256|/tmp/tiny_r|$FULL 256"
    "r_full256_cap|/tmp/tiny_r|$FULL 256 CAP"
    "r_full64_old|/tmp/tiny_r|$FULL 64 OLD" "r_full256_old|/tmp/tiny_r|$FULL 256 OLD"
    "r_plain_rt|/tmp/tiny_r|RT" "r_full64_rt|/tmp/tiny_r|$FULL 64 RT" "r_full256_rt|/tmp/tiny_r|$FULL 256 RT"
    "p_plain|/tmp/tiny_p|" "p_dflash|/tmp/tiny_p|DF" "p_full16|/tmp/tiny_p|$FULL 16"
    "p_full64|/tmp/tiny_p|$FULL 64" "p_full256|/tmp/tiny_p|$FULL 256"
  )
  # Served only when dist/old/ holds the older bundle; the p set queries last, so a tight deadline cuts it first.
  if [ -z "$OLD_BUNDLE" ]; then VARIANTS=("${VARIANTS[@]/*_old|*}"); fi
  if [ "${MIX_SET:-}" = h ]; then
    # Issue 25 (G0, G3, G7 of HYBRID.md): a tiny Qwen3-Next (GDN + attention + MoE; HYB_MODELS=/tmp/tiny_h the
    # random one, default the peaked one); full mode under the proof's switch (HYB), radix cache off; a second
    # plain server for the tie band; a deliberately wrong commit (the deepest node) that must fail.
    # HYB_PAIR=1: the trained hybrid pair instead (train_pair_device.sh HYBRID=1's pair_h.tar unpacked into
    # .gpu/pair_h/, carried): drafts that are really accepted, so full mode commits deep tree nodes.
    if [ "${HYB_PAIR:-0}" = 1 ]; then
      carried_pair pair_h next/ "HYB_PAIR=1" " with HYBRID=1"; HYB_MODELS=/tmp/pair_h
    fi
    H="--disable-radix-cache"; HM=${HYB_MODELS:-/tmp/tiny_hp}/next
    # HYB_RADIX=1 (G5 / G6): every server with the radix cache, recurrent states tracked every HYB_TRACK (64)
    # tokens (extra_buffer); round 2 of the mix resumes from the states round 1 left in the cache
    if [ "${HYB_RADIX:-0}" = 1 ]; then
      H="--mamba-scheduler-strategy extra_buffer --mamba-track-interval ${HYB_TRACK:-64}"; export MIX_ROUND2=${MIX_ROUND2:-40}
    fi
    if [ "${MIX_GRAPHS:-0}" = 1 ]; then  # G4: the same with CUDA graphs (batches above 8 run eagerly)
      KEEP=(); for c in "${COMMON[@]}"; do [ "$c" = --disable-cuda-graph ] || KEEP+=("$c"); done
      COMMON=("${KEEP[@]}" --cuda-graph-max-bs 8)
    fi
    # the wrong commit before budget 256: its mix is quick, 256's samples the slowest (a tight deadline cuts 256)
    VARIANTS=("h_plain|$HM|$H" "h_dflash|$HM|DF $H" "h_full15|$HM|$FULL 15 $H" "h_full64|$HM|$FULL 64 $H"
              "h_full64_deepest|$HM|$FULL 64 $H DEEPEST" "h_full256|$HM|$FULL 256 $H" "h_twin|$HM|$H"
              "h_dflash_pristine|$HM|DF $H PRISTINE"  # upstream, no payload: graph replay's one-token-prompt fault
              "h_dflash_old|$HM|DF $H OLD"  # dist/old/'s payload (HYB_RADIX=1 with 0.8.4: DFLASH's radix tracking unfixed)
              # the recurrent-state pool audited step by step (state_audit/; HYBRID.md §1.11): plain without the
              # overlap scheduler as the state reference, DFLASH and full 64 on graphs and eager
              "h_plain_audit|$HM|$H NOOVERLAP AUDIT" "h_plain_audit_eager|$HM|$H NOOVERLAP EAGER AUDIT"
              "h_dflash_audit|$HM|DF $H AUDIT" "h_dflash_eager|$HM|DF $H EAGER AUDIT"
              "h_full64_audit|$HM|$FULL 64 $H AUDIT" "h_full64_eager|$HM|$FULL 64 $H EAGER AUDIT")
    if [ -z "$OLD_BUNDLE" ]; then VARIANTS=("${VARIANTS[@]/*_old|*}"); fi
    rm -rf /tmp/site_pristine && mkdir -p /tmp/site_pristine && tar -C /tmp/site_pristine -xJf "$SITE_TAR"
  fi
fi
if [ "${GRAPHS:-0}" = 1 ]; then
  # Issue 13: every server with CUDA graphs (target verify and draft), the production-mix flags.
  KEEP=(); for c in "${COMMON[@]}"; do [ "$c" = --disable-cuda-graph ] || KEEP+=("$c"); done; COMMON=("${KEEP[@]}")
  # --sleep-on-idle: a dozen servers share 16 cores, and an idle scheduler otherwise spins on one;
  # phase B measures one server while the others wait.
  COMMON+=(--cuda-graph-max-bs 32 --context-length 1024 --schedule-policy fcfs --sleep-on-idle)
  FULL="DF --speculative-ddtree-mode full --speculative-ddtree-budget"
  VARIANTS=(
    "p_full64|/tmp/tiny_p|$FULL 64"  # first: starts alone, warms the JIT caches (verify width 65, builder)
    "p_plain|/tmp/tiny_p|" "p_dflash|/tmp/tiny_p|DF"
    "p_shadow|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64"
    "p_full64_bias|/tmp/tiny_p|$FULL 64 BIAS"
    "p_full64_cycle|/tmp/tiny_p|$FULL 64 CYCLE"  # every step shrunk in turn: padded on the graphs (<= 32), eager above
    # profiled twins (per-phase times; the mark events cost a little, so the speed rows use the plain ones)
    "p_full64_prof|/tmp/tiny_p|$FULL 64 PROF"
    "p_shadow_prof|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64 PROF"
    "p_full64_unfused_prof|/tmp/tiny_p|$FULL 64 UNFUSED PROF"  # the same step without the verify kernels
    "p_dflash_twin|/tmp/tiny_p|DF"  # a second DFLASH process: the speed rows' process-to-process spread
    "p_shadow_twin|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64"
    "p_shadow_every1|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64 EVERY1"
    "r_plain|/tmp/tiny_r|" "r_dflash|/tmp/tiny_r|DF" "r_dflash_pristine|/tmp/tiny_r|DF PRISTINE"  # queried last
    "r_full16|/tmp/tiny_r|$FULL 16" "r_full64|/tmp/tiny_r|$FULL 64" "r_full256|/tmp/tiny_r|$FULL 256"
    "r_full64_cycle|/tmp/tiny_r|$FULL 64 CYCLE"
    # issue 24: --speculative-ddtree-budget auto (graph ladder, per-step budget), served with ONLY=... when wanted
    "p_auto|/tmp/tiny_p|$FULL auto --speculative-ddtree-budget-max 127" "r_auto|/tmp/tiny_r|$FULL auto --speculative-ddtree-budget-max 127"
    # a fault on auto's mix, told apart: the same flags again (does it repeat?) and the fixed budget of
    # auto's warm-up (every step a 128-wide tree: a width's bf16 rounding, or auto's switching?)
    "p_auto_twin|/tmp/tiny_p|$FULL auto --speculative-ddtree-budget-max 127" "p_full127|/tmp/tiny_p|$FULL 127"
  )
  # Both sets no longer fit one 600 s call: GRAPHS_SET=p serves the p set (mix, samples, liveness,
  # speed), GRAPHS_SET=r the r set (mix, liveness, upstream's stall).
  case "${GRAPHS_SET:-}" in p) VARIANTS=("${VARIANTS[@]/r_*}") ;; r) VARIANTS=("${VARIANTS[@]/p_*}") ;; esac
  rm -rf /tmp/site_pristine && mkdir -p /tmp/site_pristine && tar -C /tmp/site_pristine -xJf "$SITE_TAR"
  # the GPU checks below share the CPU with the servers' start-up: a speed-only call leaves them out
  [ "${PERF_ONLY:-0}" = 1 ] || ( python3 $HERE/sampling_kernels_check.py walk > "$OUT/sampling_kernels_check.log" 2>&1; echo "rc=$?" >> "$OUT/sampling_kernels_check.log"
    # the builder's Triton-vs-torch tests (skipped on CPU CI), with pytest carried in .gpu/pytest_site
    if [ -d .gpu/pytest_site ]; then PYTHONPATH=/tmp/site:$PWD/.gpu/pytest_site timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest \
      tests/test_ddtree_triton.py tests/test_ddtree_verify_step.py > "$OUT/triton_tests.log" 2>&1; echo "rc=$?" >> "$OUT/triton_tests.log"; fi ) &
  SKC_PID=$!
fi
if [ "${LIMITS:-0}" = 1 ]; then
  # Issue 23: every server with CUDA graphs and no overlap scheduler (DFLASH runs without it, and plain
  # with it counts penalties one token late), a pool that holds a full graph batch at the context limit,
  # and one prefill for all of it (a whole batch reaches the limit together).
  KEEP=(); for c in "${COMMON[@]}"; do [ "$c" = --disable-cuda-graph ] || [ "$c" = 16384 ] || [ "$c" = --max-total-tokens ] || KEEP+=("$c"); done
  COMMON=("${KEEP[@]}" --max-total-tokens 65536 --cuda-graph-max-bs 32 --context-length 1024 --schedule-policy fcfs
          --sleep-on-idle --disable-overlap-schedule --chunked-prefill-size 32768 --max-prefill-tokens 32768)
  FULL="DF --speculative-ddtree-mode full --speculative-ddtree-budget"
  VARIANTS=(
    "r_full64|/tmp/tiny_r|$FULL 64"  # first: starts alone, warms the JIT caches
    "r_plain|/tmp/tiny_r|" "r_dflash|/tmp/tiny_r|DF" "r_full15|/tmp/tiny_r|$FULL 15" "r_full256|/tmp/tiny_r|$FULL 256"
    "r_shadow|/tmp/tiny_r|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64"
    "q_plain|/tmp/tiny_r|CTX4K" "q_dflash|/tmp/tiny_r|DF CTX4K" "q_full64|/tmp/tiny_r|$FULL 64 CTX4K"
    "q_full512|/tmp/tiny_r|$FULL 512 CTX4K"
    "p_plain|/tmp/tiny_p|" "p_dflash|/tmp/tiny_p|DF" "p_full64|/tmp/tiny_p|$FULL 64"
    "r_dflash_pristine|/tmp/tiny_r|DF PRISTINE" "q_full512_old|/tmp/tiny_r|$FULL 512 CTX4K OLD"  # upstream / the previous payload: run last
    "r_full64_eager|/tmp/tiny_r|$FULL 64 EAGER"  # (served with ONLY=...) a graph fault told from a tree-step fault
    "p_dflash_pristine|/tmp/tiny_p|DF PRISTINE"  # (served with ONLY=...) upstream's DFLASH on p's mix and penalties
    # issue 24: --speculative-ddtree-budget auto at the limits (its ladder up to each set's largest fixed budget)
    "r_auto|/tmp/tiny_r|$FULL auto --speculative-ddtree-budget-max 255"
    "q_auto|/tmp/tiny_r|$FULL auto --speculative-ddtree-budget-max 511 CTX4K"
    "p_auto|/tmp/tiny_p|$FULL auto --speculative-ddtree-budget-max 127"
  )
  # r_full64_eager and p_dflash_pristine only when named: 18 servers starting together on a cold machine missed a
  # 510 s budget (2026-12-05)
  [ -n "${ONLY:-}" ] || VARIANTS=("${VARIANTS[@]/r_full64_eager|*}") VARIANTS=("${VARIANTS[@]/p_dflash_pristine|*}")
  # LIMITS_SET=p: the peaked set alone: its production mix, samples at T 0.8 with the biased walk's
  # power check, and the penalties on upstream DFLASH and the previous payload (expected to fault).
  [ "${LIMITS_SET:-}" = p ] && VARIANTS=("p_full64|/tmp/tiny_p|$FULL 64" "p_plain|/tmp/tiny_p|" "p_dflash|/tmp/tiny_p|DF"
    "p_full64_bias|/tmp/tiny_p|$FULL 64 BIAS" "p_dflash_pristine|/tmp/tiny_p|DF PRISTINE" "p_full64_old|/tmp/tiny_p|$FULL 64 OLD")
  # LIMITS_SET=h (issue 25): the trained hybrid pair (.gpu/pair_h, radix cache off, full mode as operators start it,
  # no switch): the production mix and a graph batch of 32 at the context limit, the deepest-node commit (must fail),
  # upstream DFLASH last (expected dead)
  # LIMITS_SET=hd: the same on the hybrid without MoE (make_tiny_hybrid.py's random dense Qwen3.5, served as
  # Qwen3_5ForConditionalGeneration; HYB_PAIR=1 the trained dense pair from .gpu/pair_hd), plus the deepest-node
  # commit (must fail), and the peaked dense twin as the k set; no route ties can occur, so the margin rule alone judges.
  # LIMITS_SET=hm: the same on Qwen3.5's MoE architecture (make_tiny_hybrid.py's moe35/: the dense checkpoint with
  # every routed expert a copy of its MLP, so HYB_PAIR=1 turns the trained dense pair into an accepting MoE pair here)
  if [ "${LIMITS_SET:-}" = h ] || [ "${LIMITS_SET:-}" = hd ] || [ "${LIMITS_SET:-}" = hm ]; then
    H="--disable-radix-cache"
    QWEN35=; [ "$LIMITS_SET" = h ] || QWEN35=$([ "$LIMITS_SET" = hd ] && echo dense || echo moe35)
    if [ "$LIMITS_SET" = h ]; then
      carried_pair pair_h next/ "LIMITS_SET=h" " with HYBRID=1"; HM=/tmp/pair_h/next
    elif [ "${HYB_PAIR:-0}" = 1 ]; then  # the trained dense pair (train_pair_device.sh HYBRID=dense's pair_hd.tar)
      carried_pair pair_hd dense/ "LIMITS_SET=$LIMITS_SET HYB_PAIR=1" " with HYBRID=dense"; HM=/tmp/pair_hd/dense
      if [ "$LIMITS_SET" = hm ]; then
        python3 $HERE/make_tiny_hybrid.py --moe-from-dense /tmp/pair_hd /tmp/pair_hm > "$OUT/make_hm.log" 2>&1 \
          || { tail -20 "$OUT/make_hm.log"; echo "moe35 from the dense pair failed"; exit 1; }
        HM=/tmp/pair_hm/moe35; ts "moe35 made from the dense pair"
      fi
    else
      HM=${HYB_MODELS:-/tmp/tiny_h}/$QWEN35
    fi
    # SGLang warms a multimodal target up with an image through the chat API (a chat template the tiny tokenizer
    # lacks; the vision tower is not what this proves): every request here is text, so no warm-up request
    [ -n "$QWEN35" ] && H="$H --skip-server-warmup"
    VARIANTS=("h_full64|$HM|$FULL 64 $H" "h_plain|$HM|$H" "h_dflash|$HM|DF $H" "h_full15|$HM|$FULL 15 $H"
              "h_full256|$HM|$FULL 256 $H" "h_dflash_pristine|$HM|DF $H PRISTINE" "h_full64_deepest|$HM|$FULL 64 $H DEEPEST")
    if [ -n "$QWEN35" ] && [ "${HYB_PAIR:-0}" = 1 ]; then
      # the trained pair a second time as the x set, with the radix cache (states tracked every HYB_TRACK tokens):
      # its mix's round 2 resumes from cached states; samples and liveness there too
      X="--mamba-scheduler-strategy extra_buffer --mamba-track-interval ${HYB_TRACK:-64} --skip-server-warmup"
      VARIANTS+=("x_plain|$HM|$X" "x_dflash|$HM|DF $X"
                 "x_full64|$HM|$FULL 64 $X" "x_full256|$HM|$FULL 256 $X" "x_full64_deepest|$HM|$FULL 64 $X DEEPEST")
    elif [ -n "$QWEN35" ]; then
      KM=/tmp/tiny_hp/$QWEN35  # the peaked twin: drafts accepted, so full mode commits deep nodes
      VARIANTS+=("k_plain|$KM|$H" "k_dflash|$KM|DF $H"
                 "k_full64|$KM|$FULL 64 $H" "k_full256|$KM|$FULL 256 $H" "k_full64_deepest|$KM|$FULL 64 $H DEEPEST")
    fi
  fi
  if [ -z "$OLD_BUNDLE" ]; then VARIANTS=("${VARIANTS[@]/*_old|*}"); fi
  rm -rf /tmp/site_pristine && mkdir -p /tmp/site_pristine && tar -C /tmp/site_pristine -xJf "$SITE_TAR"
  ( python3 $HERE/sampling_kernels_check.py walk > "$OUT/sampling_kernels_check.log" 2>&1; echo "rc=$?" >> "$OUT/sampling_kernels_check.log"
    if [ -d .gpu/pytest_site ]; then PYTHONPATH=/tmp/site:$PWD/.gpu/pytest_site timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest \
      tests/test_ddtree_triton.py tests/test_ddtree_verify_step.py > "$OUT/triton_tests.log" 2>&1; echo "rc=$?" >> "$OUT/triton_tests.log"; fi ) &
  SKC_PID=$!
fi
if [ "${SWEEP:-0}" = 1 ]; then
  # Issue 14: the trained pair, every server with CUDA graphs (target verify and draft); the first
  # three start together and warm the JIT caches (the builder with cap and keep-chain included).
  KEEP=(); for c in "${COMMON[@]}"; do [ "$c" = --disable-cuda-graph ] || KEEP+=("$c"); done; COMMON=("${KEEP[@]}")
  # 32 requests x (256-token prompt + 128) plus a 257-token tree each fit without KV pressure
  COMMON+=(--cuda-graph-max-bs 32 --context-length 1024 --max-total-tokens 32768)
  FULL="DF --speculative-ddtree-mode full --speculative-ddtree-budget"
  VARIANTS=("full_b64_cap4_kc|/tmp/pair|$FULL 64 --speculative-ddtree-topk-cap 4 --speculative-ddtree-keep-chain"
            "plain|/tmp/pair|" "dflash|/tmp/pair|DF")
  for b in 64 32 128 15 256; do
    for cap in "" 4; do
      for kc in "" _kc; do
        tag=full_b$b${cap:+_cap$cap}$kc
        [ "$tag" = full_b64_cap4_kc ] && continue
        VARIANTS+=("$tag|/tmp/pair|$FULL $b${cap:+ --speculative-ddtree-topk-cap $cap}${kc:+ --speculative-ddtree-keep-chain}")
      done
    done
  done
fi
if [ "${AUTO:-0}" = 1 ]; then
  # Issue 24: CUDA graphs up to batch 64 for every server; the KV pool capped (64 requests x (256 + 64 + a
  # 128-node tree)). SGLang sizes the pool as free-after-load - free-at-init x (1 - fraction): servers of 16 GB
  # loading together see each other's weights, so the fraction is high and --max-total-tokens bounds the pool.
  KEEP=(); for c in "${COMMON[@]}"; do case $c in --disable-cuda-graph|--max-total-tokens|16384|--mem-fraction-static|0.3) ;; *) KEEP+=("$c") ;; esac; done
  COMMON=("${KEEP[@]}" --cuda-graph-max-bs 64 --max-running-requests 64 --context-length 1024 --schedule-policy fcfs
          --sleep-on-idle --max-total-tokens 40000 --mem-fraction-static ${AUTO_MEM:-0.8})
  FULL="DF --speculative-ddtree-mode full --speculative-ddtree-budget"
  VARIANTS=()
  for set in p s; do
    m=/tmp/pair; [ $set = s ] && m=/tmp/shell
    prof=; [ "${AUTO_PROFILE:-0}" = 1 ] && prof=" PROF"
    VARIANTS+=("${set}_plain|$m|" "${set}_dflash|$m|DF" "${set}_auto|$m|$FULL auto --speculative-ddtree-budget-max ${AUTO_MAX:-127}$prof")
    for b in ${AUTO_FIXED:-16 32 64 128}; do VARIANTS+=("${set}_full$b|$m|$FULL $b$prof"); done
  done
fi
if [ "${TP2:-0}" = 1 ]; then  # the TP twins (token TP2 -> --tp-size 2 --nccl-port ...), queried early
  WITH_TP=()
  for v in "${VARIANTS[@]}"; do
    WITH_TP+=("$v")
    case ${v%%|*} in
      p_full256) WITH_TP+=("p_plain_tp2|/tmp/tiny_p|TP2" "p_dflash_tp2|/tmp/tiny_p|DF TP2"
        "p_full64_tp2|/tmp/tiny_p|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64 TP2"
        "p_shadow_tp2|/tmp/tiny_p|DF --speculative-ddtree-mode shadow-linear --speculative-ddtree-budget 64 TP2") ;;
      # r_plain_tp2 is r_full64_tp2's arithmetic twin: the random model has sub-ulp bf16 near-ties
      # where TP's reduction order alone can flip an argmax (seen on 2026-11-29, see RESULTS.md).
      r_full256) WITH_TP+=("r_plain_tp2|/tmp/tiny_r|TP2" "r_dflash_tp2|/tmp/tiny_r|DF TP2"
        "r_full64_tp2|/tmp/tiny_r|DF --speculative-ddtree-mode full --speculative-ddtree-budget 64 TP2") ;;
    esac
  done
  VARIANTS=("${WITH_TP[@]}")
fi
read -r -a TP2_EXTRA_ARGS <<< "${TP2_EXTRA---disable-custom-all-reduce}"
# COMMON_EXTRA: flags every server gets (e.g. "--dtype float16": does a divergence survive finer rounding? float32 is refused by sgl_kernel's rmsnorm)
read -r -a COMMON_EXTRA_ARGS <<< "${COMMON_EXTRA:-}"; COMMON+=("${COMMON_EXTRA_ARGS[@]}")
declare -A PID PORT
launch() {  # TAG MODEL_DIR EXTRA...
  local tag=$1 model=$2; shift 2
  local args=() envs=(PYTHONPATH=/tmp/site) audit=0
  for a in "$@"; do
    case $a in
      DF) args+=("${DF[@]}" --speculative-draft-model-path "$model/draft") ;;
      RT) args+=(--max-total-tokens 4096); envs+=(SGLANG_TEST_RETRACT=1 SGLANG_TEST_RETRACT_INTERVAL=25) ;;
      OLD) envs+=(PYTHONPATH=/tmp/site_old) ;;
      CAP) envs+=(SGLANG_DDTREE_MAX_VERIFY_TOKENS=1024) ;;  # steps must shrink their trees
      PRISTINE) envs+=(PYTHONPATH=/tmp/site_pristine) ;;  # upstream 0.5.13.post1, no payload
      BIAS) envs+=(SGLANG_DDTREE_TEST_BIASED_WALK=1 SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1) ;;  # a deliberately wrong sampled walk
      PROF) envs+=(SGLANG_DDTREE_PROFILE=1) ;;  # per-phase step times in /server_info (ddtree_profile)
      HYB) envs+=(SGLANG_DDTREE_TEST_UNPROVEN_HYBRID=1 SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1) ;;  # full mode on an unproven hybrid architecture (Qwen3.6: add HYB to its servers); the proven ones run without it
      DEEPEST) envs+=(SGLANG_DDTREE_TEST_MAMBA_COMMIT=deepest) ;;  # commit the deepest node's recurrent state: must fail
      UNFUSED) envs+=(SGLANG_DDTREE_VERIFY_KERNELS=0) ;;  # the verify step on torch ops (ddtree_verify_step)
      CYCLE) envs+=(SGLANG_DDTREE_TEST_CYCLE_BUDGETS=1 SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1) ;;  # step k takes the k-th ladder budget (0 included)
      CTX4K) args+=(--context-length 4096 --cuda-graph-max-bs 8) ;;  # LIMITS: the second context length (after COMMON's)
      EVERY1) envs+=(SGLANG_DDTREE_SHADOW_EVERY=1) ;;  # shadow builds on every step, not one in 4: the build's cost x4
      AUDIT) audit=1 ;;  # state_audit/sitecustomize.py: the recurrent-state pool fingerprinted around every step
      EAGER) args+=(--disable-cuda-graph) ;;
      NOOVERLAP) args+=(--disable-overlap-schedule) ;;
      TP2) args+=(--tp-size 2 --nccl-port $(( PORT[$tag] + 5 )) "${TP2_EXTRA_ARGS[@]}")
        # a v2 base's tree step takes --tp-size 2 only under its proof switch (ddtree_args.TEST_V2_TP)
        [ -z "$SITE_BASE" ] || envs+=(SGLANG_DDTREE_TEST_V2_TP=1 SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1) ;;
      *) args+=("$a") ;;
    esac
  done
  if [ $audit = 1 ]; then  # ahead of whichever site tree the server runs from
    local pp=/tmp/site e; for e in "${envs[@]}"; do [[ $e == PYTHONPATH=* ]] && pp=${e#PYTHONPATH=}; done
    envs+=(PYTHONPATH=$HERE/state_audit:$pp DDTREE_STATE_AUDIT=$OUT/audit_$tag.jsonl)
  fi
  # SGLang picks a free torch.distributed port at random when not told, and servers starting together
  # can pick the same one (EADDRINUSE, seen in a LIMITS call): each gets its own, beside its HTTP port.
  [[ " ${args[*]} " == *" --nccl-port "* ]] || args+=(--nccl-port $(( PORT[$tag] + 5 )))
  # A v2 base's tree step refuses the overlap scheduler (ddtree_v2_step): every full-mode server there runs without
  # it, whichever phase serves it; plain and DFLASH keep it, as operators run them.
  if [ -n "$SITE_BASE" ] && [[ " ${args[*]} " == *" --speculative-ddtree-mode full "* ]] \
     && [[ " ${args[*]} " != *" --disable-overlap-schedule "* ]]; then
    args+=(--disable-overlap-schedule)
  fi
  # NORADIX_SETS="r q": those sets' servers without the radix cache (a fault told from prefix sharing)
  [[ " ${NORADIX_SETS:-} " == *" ${tag%%_*} "* ]] && args+=(--disable-radix-cache)
  rm -f /tmp/spid_$tag
  env "${envs[@]}" setsid bash -c 'echo $$ > /tmp/spid_'$tag'; exec python3 -m sglang.launch_server "$@"' _ \
    --model-path "$model/target" --port "${PORT[$tag]}" "${COMMON[@]}" "${args[@]}" > "$OUT/server_$tag.log" 2>&1 &
  for i in $(seq 50); do [ -s /tmp/spid_$tag ] && break; sleep 0.1; done
  PID[$tag]=$(cat /tmp/spid_$tag)
  ts "launched $tag port=${PORT[$tag]} pid=${PID[$tag]} ${args[*]}"
}
stop_all() {
  for tag in "${!PID[@]}"; do kill -TERM -- "-${PID[$tag]}" 2>/dev/null; done
  sleep 5
  for tag in "${!PID[@]}"; do kill -KILL -- "-${PID[$tag]}" 2>/dev/null; done
}
trap stop_all EXIT
query() {  # TAG
  local tag=$1 left=$(( DEADLINE - $(date +%s) - 20 ))
  if [ "$left" -lt 10 ]; then ts "skip $tag: no time left"; return 9; fi
  # A refused server should already be gone; never let one eat the deadline.
  if [[ $tag == h_*_full ]] && [ "$left" -gt 60 ]; then left=60; fi
  client "$tag" "$left"
  local rc=$?
  ts "$tag client rc=$rc $(grep -c . "$OUT/client_$tag.log") lines: $(grep '^\[mix\]' "$OUT/client_$tag.log" | tail -1 | cut -c1-300)"
  grep -E "DDTree|Traceback|Error|refused" "$OUT/server_$tag.log" | grep -v "server_args=" | cut -c1-400 | tail -6
  # Free the GPU share and CPU as soon as a server has answered.
  kill -TERM -- "-${PID[$tag]}" 2>/dev/null
  return $rc
}

i=0; TAGS=()
for v in "${VARIANTS[@]}"; do
  tag=${v%%|*}
  [ -n "$tag" ] || continue
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $tag "* ]]; then continue; fi
  PORT[$tag]=$(( 30000 + 10 * i )); i=$((i + 1)); TAGS+=("$v")
done
client() {  # TAG WAIT_S: the proof's client for this server
  local tag=$1 wait_s=$2
  if [ "${MIX:-0}" = 1 ]; then
    local set=${tag%%_*} make=()
    [[ $tag == *_rt ]] && set=rt
    [[ $tag == *_plain* && $tag != *_audit* ]] && make=(--make --round2 ${MIX_ROUND2:-14})  # an audited plain twin reads the workload
    timeout "$wait_s" python3 $HERE/production_mix.py run --port "${PORT[$tag]}" --tag "$tag" --out "$OUT/$tag.json" \
      --workload "$OUT/workload_$set.json" --wait "$wait_s" --pid "${PID[$tag]}" "${make[@]}" > "$OUT/client_$tag.log" 2>&1
    # HYB_SAMPLES=N (issue 25, MIX_SET=h): then N samples per prompt at T 1 / top_p 1 and the liveness rounds
    if [ -n "${HYB_SAMPLES:-}" ] && [[ $tag == h_plain || ( $tag == h_full* && $tag != *_deepest ) ]]; then
      timeout $(( DEADLINE - $(date +%s) - 20 )) python3 $HERE/graphs_proof.py run --port "${PORT[$tag]}" --tag "$tag" \
        --out "$OUT/${tag}_proof.json" --wait 30 --pid "${PID[$tag]}" --samples "$HYB_SAMPLES" --temperature 1 --top-p 1 \
        --liveness >> "$OUT/proof_$tag.log" 2>&1; ts "$tag samples + liveness rc=$?"
    fi
  else
    python3 $HERE/client.py --port "${PORT[$tag]}" --tag "$tag" --out "$OUT/$tag.json" --wait "$wait_s" --pid "${PID[$tag]}" \
      > "$OUT/client_$tag.log" 2>&1
  fi
}

first=${TAGS[0]}; rest=("${TAGS[@]:1}")
start_servers() {  # MARGIN_S: the first server alone (it warms the JIT caches), then the rest together;
  # wait until all are up or dead, MARGIN_S before the deadline at the latest
  IFS='|' read -r tag model extra <<< "$first"
  [ -d "$model/target" ] || wait $MAKE_PID  # a model the background job makes
  launch "$tag" "$model" $extra
  python3 $HERE/wait_all.py 300 "${PORT[$tag]}:${PID[$tag]}"
  ts "$first up (warm-up)"
  # A server that skips SGLang's own warm-up request leaves Triton's JIT cache (on disk, shared) cold, and the
  # servers started next would each compile the prefill, decode and verify kernels on their first requests:
  # a few text requests (greedy and sampled, three lengths) through the first server compile them once.
  [[ " $extra " == *" --skip-server-warmup "* ]] && python3 - "${PORT[$tag]}" <<'PY'
import json, sys, threading, time, urllib.request
port, t0 = sys.argv[1], time.time()
def one(n: int, temperature: float) -> None:
    body = {"text": "def f(x):\n    return x + 1\n" * n, "sampling_params": {"max_new_tokens": 24, "temperature": temperature}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=150).read()
    except Exception as e:  # the proof's own requests will show a broken server
        print(f"JIT warm-up request ({n}, T {temperature}) failed: {e}")
threads = [threading.Thread(target=one, args=a) for a in ((1, 0.0), (12, 0.0), (40, 1.0))]
[t.start() for t in threads]; [t.join() for t in threads]
print(f"JIT warm-up requests done in {time.time() - t0:.1f} s")
PY
  wait $MAKE_PID; ts "other models made"
  for v in "${rest[@]}"; do IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
  local ports=() t
  for v in "${rest[@]}"; do t=${v%%|*}; ports+=("${PORT[$t]}:${PID[$t]}"); done
  python3 $HERE/wait_all.py $(( DEADLINE - $(date +%s) - $1 )) "${ports[@]}"
  ts "all servers up or dead; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
}
if [ "${LIMITS:-0}" = 1 ]; then
  source $HERE/limits_phases.sh
  exit $?
fi
if [ "${GRAPHS:-0}" = 1 ]; then
  source $HERE/graphs_phases.sh
  exit $?
fi
if [ "${SWEEP:-0}" = 1 ]; then
  source $HERE/sweep_phases.sh
  exit $?
fi
if [ "${AUTO:-0}" = 1 ]; then
  source $HERE/auto_phases.sh
  exit $?
fi
IFS='|' read -r tag model extra <<< "$first"
[ -d "$model/target" ] || wait $MAKE_PID  # ONLY= may start with a model the background job makes
launch "$tag" "$model" $extra
client "$tag" 300
ts "$tag (warm-up server) client rc=$?"
kill -TERM -- "-${PID[$tag]}" 2>/dev/null
wait $MAKE_PID; grep -v -i "warn\|Writing model" "$OUT/make_r.log" "$OUT/make_h.log" | tail -8
ts "other models made"
if [ -n "$TPC_PID" ]; then
  wait $TPC_PID; ts "tp_tree_check rc=$?"; grep '^{' "$OUT/tp_tree_check.log" | tail -1 | cut -c1-3000
  grep -E "Error|Traceback" "$OUT/tp_tree_check.log" | tail -4
fi
for v in "${rest[@]}"; do IFS='|' read -r tag model extra <<< "$v"; launch "$tag" "$model" $extra; done
# Query only once every server is up (or dead), so start-up CPU load does not skew the timings.
ALLPORTS=(); for v in "${rest[@]}"; do t=${v%%|*}; ALLPORTS+=("${PORT[$t]}:${PID[$t]}"); done
python3 $HERE/wait_all.py $(( DEADLINE - $(date +%s) - 150 )) "${ALLPORTS[@]}"
ts "all servers up or dead; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
for v in "${rest[@]}"; do IFS='|' read -r tag model extra <<< "$v"; query "$tag"; done
ts "queries done; GPU mem: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"
stop_all; trap - EXIT
if [ "${MIX:-0}" = 1 ]; then
  { MIXC=(python3 $HERE/production_mix.py compare "$OUT")
    if [ "${MIX_SET:-}" = h ]; then
    "${MIXC[@]}" h_plain --upstream h_dflash h_twin h_dflash h_full15 h_full64 h_full256; echo "rc=$?"
    echo "--- DFLASH judged itself: with the payload (its graph-replay fix), and upstream without it"
    "${MIXC[@]}" h_plain h_dflash h_dflash_pristine; echo "rc=$?"
    if [ -f "$OUT/h_dflash_old.json" ]; then echo "--- DFLASH of the previous payload ($OLD_BUNDLE)"
      "${MIXC[@]}" h_plain h_dflash_old; echo "rc=$?"; fi
    echo "--- the deliberately wrong commit (expected to fail):"; "${MIXC[@]}" h_plain --upstream h_dflash h_full64_deepest; echo "rc=$?"
    # what the margin rule leaves, judged by the float32 reference with MoE router near-ties flipped (route_ties.py);
    # the wrong commit's faults must survive it
    echo "--- route ties (float32 oracle, CPU)"
    python3 $HERE/route_ties.py "$OUT" --model "$HM/target" --plain h_plain --upstream h_dflash \
      --cand h_dflash h_full15 h_full64 h_full256 h_full64_deepest --expect-fault h_full64_deepest; echo "rc=$?"
    if ls "$OUT"/audit_* >/dev/null 2>&1; then
      echo "--- audited servers (plain without the overlap scheduler; DFLASH and full 64 on graphs and eager)"
      "${MIXC[@]}" h_plain h_plain_audit h_plain_audit_eager h_dflash_audit h_dflash_eager h_full64_audit h_full64_eager
      echo "rc=$?"
      # sublayer outputs are seen eagerly only (a graph replays no Python): eager candidates against eager plain
      python3 $HERE/state_audit/analyze.py "$OUT" --workload "$OUT/workload_h.json" --plain h_plain_audit \
        --cand h_dflash_audit h_full64_audit; echo "rc=$?"
      python3 $HERE/state_audit/analyze.py "$OUT" --workload "$OUT/workload_h.json" --plain h_plain_audit_eager \
        --cand h_dflash_eager h_full64_eager; echo "rc=$?"
    fi
    if [ -n "${HYB_SAMPLES:-}" ]; then
      cands=(); for t in h_full15 h_full64 h_full256; do [ -f "$OUT/${t}_proof.json" ] && cands+=("$t"); done
      echo "--- samples at T 1 / top_p 1 ($HYB_SAMPLES per prompt) and liveness"
      python3 $HERE/graphs_proof.py compare "$OUT" --plain h_plain --cand "${cands[@]}" --liveness "${cands[@]}"; echo "rc=$?"
    fi
    else
    "${MIXC[@]}" r_plain --upstream r_dflash r_dflash r_full16 r_full64 r_full256 r_full256_cap; echo "rc=$?"
    "${MIXC[@]}" p_plain --upstream p_dflash p_dflash p_full16 p_full64 p_full256; echo "rc=$?"
    "${MIXC[@]}" r_plain_rt r_full64_rt r_full256_rt; echo "rc=$?"
    if [ -n "$OLD_BUNDLE" ]; then echo "--- the payload before the fix ($OLD_BUNDLE), same workload (expected to fail):"
      "${MIXC[@]}" r_plain --upstream r_dflash r_full64_old r_full256_old; echo "rc=$?"; fi
    fi
  } 2>&1 | tee "$OUT/summary.txt"
  for t in "${!PID[@]}"; do grep -hE "DDTree full: verify steps sized|DDTree full \(hybrid|Traceback|Error" "$OUT/server_$t.log" | head -3 | sed "s/^/[$t] /" | cut -c1-300; done
else
python3 $HERE/compare_ddtree.py "$OUT" | tee "$OUT/summary.txt"
fi
ts "done"
# Only a few files come back from the device: keep the summaries, pack everything else.
# (tar into /tmp first: a tarball growing inside the folder it reads makes tar fail.)
( cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name summary.json ! -name run.log -printf '%P\n' \
    | tar -czf /tmp/ddtree_logs.tgz -T - && mv /tmp/ddtree_logs.tgz logs.tgz \
  && find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name summary.json ! -name run.log -delete )
