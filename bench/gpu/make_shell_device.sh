#!/bin/bash
# Build the real-size shell of the trained pair ON THE GPU MACHINE and check it (issue 24 item 4), from the repo
# root, with `.gpu` (build_carry.sh's site-packages + the trained pair in .gpu/pair/) in the run's carry:
#   set -o pipefail; bash bench/gpu/make_shell_device.sh 2>&1 | tee $OUT/run.log
# 1) unpack the carry to /tmp/site (PYTHONPATH: transformers 5.8.1, as make_tiny_models / SGLang use)
# 2) make_shell.py $PAIR $SHELL --device cuda --check: the 8B-size shell (bf16, sharded), then small vs shell in
#    float32 on the GPU (greedy tokens, logits, padded margin, features, drafter tokens)
# 3) make_shell.py --check-only --check-dtype bfloat16: the same in bf16 (divergences must be numeric ties)
# Env: PAIR (.gpu/pair), SHELL_OUT (/tmp/shell: stays for a server started later in the same call), SHELL_ARGS (more
# make_shell.py flags, e.g. --placement spread), PROMPTS (8), NEW_TOKENS (32).
# Back in $OUT: run.log, shell_build.json (+ the float32 check), shell_check_bf16.json, shell.json.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/device_env.sh"
PAIR=${PAIR:-.gpu/pair}
SHELL_DIR=${SHELL_OUT:-/tmp/shell}
ts "start"; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; python3 -V; df -h /tmp | tail -1; free -g | head -2
if [ -f .gpu/site312.tar.xz ] && [ ! -d /tmp/site/transformers ]; then
  rm -rf /tmp/site && mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site312.tar.xz || { echo "extract failed"; exit 1; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
[ -f "$PAIR/target/config.json" ] && [ -f "$PAIR/draft/config.json" ] || { echo "no pair in $PAIR"; exit 2; }
ts "site ready"
python3 "$HERE/make_shell.py" "$PAIR" "$SHELL_DIR" --device cuda --check --prompts "${PROMPTS:-8}" \
  --new-tokens "${NEW_TOKENS:-32}" --report "$OUT/shell_build.json" ${SHELL_ARGS:-} > "$OUT/shell_build.log" 2>&1
RC=$?
grep -v '^{' "$OUT/shell_build.log" | tail -20
ts "build + float32 check rc=$RC"
cp "$SHELL_DIR/shell.json" "$OUT/" 2>/dev/null
python3 "$HERE/make_shell.py" "$PAIR" "$SHELL_DIR" --check-only --device cuda --check-dtype bfloat16 \
  --prompts "${PROMPTS:-8}" --new-tokens "${NEW_TOKENS:-32}" --report "$OUT/shell_check_bf16.json" \
  > "$OUT/shell_check_bf16.log" 2>&1
BRC=$?
ts "bf16 check rc=$BRC"
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
for name in ("shell_build.json", "shell_check_bf16.json"):
    try:
        r = json.load(open(f"{out}/{name}"))
    except (OSError, ValueError) as e:
        print(name, "unreadable:", e)
        continue
    b = r.get("build")
    if b:
        for k in ("target", "draft"):
            print(f"{k}: {b[k]['params'] / 1e9:.3f} B params, {b[k]['bytes'] / 2**30:.2f} GiB, {b[k]['wall_s']} s, "
                  f"GEMM zeros {b[k]['gemm_zero_fraction']}")
        print("build wall_s", b["wall_s"])
    c = r.get("check", {})
    t, d = c.get("target", {}), c.get("draft", {})
    print(f"{name}: ok={c.get('ok')} dtype={c.get('dtype')} tokens_equal={t.get('tokens_equal')} "
          f"not_ties={t.get('divergences_not_ties')} rel={t.get('logits_max_rel_diff')} pad_margin={t.get('pad_margin_min')} "
          f"| draft tokens_equal={d.get('draft_tokens_equal')} rel={d.get('logits_max_rel_diff')} "
          f"pad_margin={d.get('pad_margin_min')} | k_norm eps {c.get('k_norm_eps_effect')} | {c.get('wall_s')} s")
EOF
ls -la "$SHELL_DIR"/target "$OUT"
[ "$RC" = 0 ] && [ "$BRC" = 0 ]
