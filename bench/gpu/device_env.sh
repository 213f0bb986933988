# Sourced by the scripts that run ON THE GPU MACHINE (run_device.sh, train_pair_device.sh), from the
# repo root: $OUT, the t+ clock, offline Hugging Face, NVLink multicast off (KINDS.md), and the carried
# libnuma when the image lacks it.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
ts() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1 '; then export LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
# A deadline watchdog: `start_watchdog S FN` runs FN after S seconds unless `stop_watchdog` comes
# first. Stopping ends its sleep too: a sleep left behind holds the caller's `| tee` pipe open, and
# the device call with it, until the deadline (minutes of device time after the work was done).
start_watchdog() {
  ( trap 'kill $sleeper 2>/dev/null; exit 0' TERM; sleep "$1" & sleeper=$!; wait $sleeper && "$2" ) &
  WATCHDOG=$!
}
stop_watchdog() { kill "$WATCHDOG" 2>/dev/null; wait "$WATCHDOG" 2>/dev/null; }
