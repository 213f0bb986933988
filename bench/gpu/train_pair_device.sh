#!/bin/bash
# Train the target + DFlash drafter pair ON THE GPU MACHINE (nvidia-h200), from the repo root, with `.gpu`
# (bench/gpu/build_carry.sh: the carried site-packages, for the same transformers 5.8.1 that
# make_tiny_models and SGLang use) in the run's carry:
#   set -o pipefail; bash bench/gpu/train_pair_device.sh 2>&1 | tee $OUT/run.log
# 1) unpack the carry to /tmp/site (PYTHONPATH)
# 2) train_pair.py /tmp/pair --device cuda (TRAIN_SECONDS, default 240, of training), corpus: this Python's
#    stdlib + EXTRA (default /tmp/site/sglang: the carried SGLang sources, the same bytes on every machine;
#    EXTRA= for the stdlib alone)
# 3) check_pair_sglang.py on the trained pair, on the CPU (CUDA_VISIBLE_DEVICES=): our drafter = SGLang's
# Env: TRAIN_SECONDS (default 240), EXTRA, TRAIN_ARGS (more train_pair.py flags), PAIR (/tmp/pair), DEVICE (cuda),
# CHECK_SGLANG=0 (skip step 3: up to 240 s more, when the call's time is short),
# SITE (/tmp/site: where the carry unpacks; another folder lets run_device.sh, which unpacks and patches /tmp/site,
# run in the same call: `OUT=$OUT/train SITE=/tmp/site_train ... &`), SITE_TAR (default .gpu/site312.tar.xz; the
# 0.5.17 carry .gpu/site312-0.5.17.tar.xz trains with its transformers 5.12.1, the one its servers load the pair with).
# Back in $OUT: run.log (tee), train.log, train_report.json, heldout_prompts.json, check_sglang.json and
# pair.tar (target/ + draft/, ~12 MB: unpack it into .gpu/pair/ here to carry it into later proof calls).
# HYBRID=1 (issue 25): train_pair.py --hybrid, a Qwen3-Next target (PAIR default /tmp/pair_h, TRAIN_SECONDS
# default 400: its torch-fallback GDN steps are launch-bound); back: pair_h.tar (next/target + next/draft +
# heldout_prompts.json: unpack it into .gpu/pair_h/, which run_device.sh MIX_SET=h HYB_PAIR=1 serves).
# HYBRID=dense: train_pair.py --dense-hybrid, the hybrid without MoE (PAIR default /tmp/pair_hd, TRAIN_SECONDS
# default 400); back: pair_hd.tar (dense/target + dense/draft + heldout_prompts.json: unpack it into .gpu/pair_hd/,
# which run_device.sh LIMITS=1 LIMITS_SET=hd HYB_PAIR=1 serves).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/device_env.sh"
HYBRID=${HYBRID:-0}
if [ "$HYBRID" = 1 ]; then
  PAIR=${PAIR:-/tmp/pair_h}; HYB_ARGS=(--hybrid); export TRAIN_SECONDS=${TRAIN_SECONDS:-400}
elif [ "$HYBRID" = dense ]; then
  PAIR=${PAIR:-/tmp/pair_hd}; HYB_ARGS=(--dense-hybrid); export TRAIN_SECONDS=${TRAIN_SECONDS:-400}
else
  PAIR=${PAIR:-/tmp/pair}; HYB_ARGS=()
fi
ts "start"; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; python3 -V
SITE=${SITE:-/tmp/site}
SITE_TAR=${SITE_TAR:-.gpu/site312.tar.xz}
if [ -f "$SITE_TAR" ]; then
  rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$SITE_TAR" || { echo "extract failed"; exit 1; }
  export PYTHONPATH=$SITE
else
  echo "no $SITE_TAR: the image's own transformers is used"
fi
EXTRA=${EXTRA-$SITE/sglang}
EXTRA_ARGS=()
if [ -n "$EXTRA" ] && [ -d "$EXTRA" ]; then EXTRA_ARGS=(--extra-corpus "$EXTRA"); fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
ts "site extracted"
rm -rf "$PAIR"
python3 "$HERE/train_pair.py" "$PAIR" --device "${DEVICE:-cuda}" "${HYB_ARGS[@]}" "${EXTRA_ARGS[@]}" \
  --report "$OUT/train_report.json" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
RC=$?
grep -v -i "warn\|Writing model\|Loading weights" "$OUT/train.log" | tail -40
ts "train_pair rc=$RC"
[ "$RC" = 0 ] || exit "$RC"
cp "$PAIR/heldout_prompts.json" "$OUT/"
if [ "$HYBRID" = 1 ]; then
  tar -C "$PAIR" -cf "$OUT/pair_h.tar" next heldout_prompts.json
elif [ "$HYBRID" = dense ]; then
  tar -C "$PAIR" -cf "$OUT/pair_hd.tar" dense heldout_prompts.json
else
  tar -C "$PAIR" -cf "$OUT/pair.tar" target draft
fi
CRC=0
if [ "${CHECK_SGLANG:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES= timeout 240 python3 "$HERE/check_pair_sglang.py" "$PAIR" --out "$OUT/check_sglang.json" \
    > "$OUT/check_sglang.log" 2>&1
  CRC=$?
  tail -c 1500 "$OUT/check_sglang.log"
  ts "check_pair_sglang rc=$CRC"
fi
ls -la "$OUT"
exit "$CRC"
