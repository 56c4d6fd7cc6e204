#!/usr/bin/env bash
# The product path on a GPU host: `opskit submit tiny:gpu` (4 GPUs, TP=2 x PP=2, bf16, ZeRO-0) as a 2-task chain
# under a real SLURM (bench/gpu_host_slurm.sh), the second task resuming the first's checkpoint; then `opskit status`,
# `opskit ckpt check`, `opskit ckpt convert` and `opskit logs show`, as a user runs them. Prints one line per step
# (PASS/FAIL) at the end; main_log.txt goes to $OUT when set.
#
# Here, once: `opskit data prepare tiny` (data/kjv) and the .debs of bench/gpu_host_slurm.sh. There (the device tool,
# carrying .slurmdebs, the wheels and data/kjv's dataset and tokenizer):
#   bash bench/gpu_product_path.sh .slurmdebs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RUN=runs/tiny-gpu
if [ -e "$RUN" ]; then
    echo "gpu_product_path: $RUN exists: this script makes a fresh run (move it away first)" >&2
    exit 2
fi
eval "$(bash bench/gpu_host_slurm.sh "${1:?usage: $0 DEB_FOLDER}")" || exit 2
opskit() { python3 -m opskit.cli.app "$@"; }
results=()
check() {  # name, command...: run it, record PASS/FAIL by its exit code
    local name=$1 rc
    shift
    printf '\n==> %s: %s\n' "$name" "$*"
    "$@"
    rc=$?
    results+=("$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)  $name (exit $rc)")
}

check "submit, 2-task chain" timeout 480 python3 -m opskit.cli.app submit tiny:gpu --array 2 --wait
check "status" opskit status tiny:gpu
check "task 2 resumed task 1's step" grep -q "successfully loaded checkpoint from .* at iteration 250" \
    "$RUN/logs/main_log.txt"
check "finished flag" test -e "$RUN/finished"
grep -E '^\[opskit\]|exiting program|successfully loaded|after training is done' "$RUN/logs/main_log.txt"
check "ckpt check" opskit ckpt check "$RUN/checkpoints"
check "ckpt convert" opskit ckpt convert tiny:gpu
check "logs show" opskit logs show tiny:gpu --last 3
[ -n "${OUT:-}" ] && cp "$RUN/logs/main_log.txt" "$OUT/tiny-gpu-main_log.txt"
printf '%s\n' "" "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q '^FAIL'
