#!/usr/bin/env bash
# The in-job watchdog under NCCL (issue 35): `tiny:gpu` (4 GPUs, TP=2 x PP=2, bf16, ZeRO-0) under a real SLURM
# (bench/gpu_host_slurm.sh) with the test-only fault hook hanging local rank 1 after iteration 100 and
# watchdog.in_job_timeout_mins 0.5. Expected in main_log.txt: the watchdog line naming localhost, local rank 1, about
# 30 s after iteration 100's line, and the step stopped (one node, no spare: no restart, the task FAILED). Prints the
# lines (the watchdog's says how long the ranks were silent); main_log.txt goes to $OUT when set.
#
# There (the device tool, carrying .slurmdebs, the wheels and data/kjv's dataset and tokenizer):
#   bash bench/gpu_in_job_hang.sh .slurmdebs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RUN=runs/tiny-gpu-hang
if [ -e "$RUN" ]; then
    echo "gpu_in_job_hang: $RUN exists: this script makes a fresh run (move it away first)" >&2
    exit 2
fi
eval "$(bash bench/gpu_host_slurm.sh "${1:?usage: $0 DEB_FOLDER}")" || exit 2
python3 - <<'SPEC' || exit 2
import yaml
from opskit.spec.load import deep_merge

preset = yaml.safe_load(open("opskit/spec/presets/tiny.yaml"))
spec = deep_merge({k: v for k, v in preset.items() if k != "variants"}, preset["variants"]["gpu"])
spec = deep_merge(spec, {
    "description": "tiny:gpu with local rank 1 hung after iteration 100 (bench/gpu_in_job_hang.sh)",
    "megatron_args": {"exit_interval": None}, "paths": {"output": "runs/tiny-gpu-hang"},
    "slurm": {"array": 1, "env": {"OPSKIT_TEST_FAULT": "hang:localhost:iteration=100:local_rank=1"}},
    "checkpoint": {"log_interval": 10}, "watchdog": {"in_job_timeout_mins": 0.5}})
spec["megatron_args"] = {k: v for k, v in spec["megatron_args"].items() if v is not None}
yaml.safe_dump(spec, open("runs-tiny-gpu-hang.yaml", "w"))
SPEC
timeout 400 python3 -m opskit.cli.app submit runs-tiny-gpu-hang.yaml --wait
LOG=$RUN/logs/main_log.txt
grep -E '^\[opskit\]|iteration +(90|100)/|stacks requested' "$LOG" | cut -c1-300
[ -n "${OUT:-}" ] && cp "$LOG" "$OUT/tiny-gpu-hang-main_log.txt"
grep -q "in-job watchdog: .*hung: localhost local rank 1" "$LOG"
