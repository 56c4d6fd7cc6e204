#!/usr/bin/env bash
# The in-job watchdog under NCCL (issue 35): `tiny:gpu` (4 GPUs, TP=2 x PP=2, bf16, ZeRO-0) under a real SLURM
# (bench/gpu_host_slurm.sh) with the test-only fault hook hanging local rank 1 after iteration 100 and
# watchdog.in_job_timeout_mins 0.5. Expected in main_log.txt: the watchdog line naming localhost, local rank 1, about
# 30 s after iteration 100's line, and the step stopped (one node, no spare: no restart, the task FAILED). Prints the
# lines (the watchdog's says how long the ranks were silent); main_log.txt goes to $OUT when set. GPUS=1: the same on
# one GPU (TP=1 x PP=1): its one rank is silent, no rank is named (none is behind another, the stacks are alike), and
# the step is restarted on the same node up to slurm.in_job_restarts times, then the task fails.
#
# There (the device tool, carrying .slurmdebs, the wheels and data/kjv's dataset and tokenizer):
#   [GPUS=1] bash bench/gpu_in_job_hang.sh .slurmdebs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RUN=runs/tiny-gpu-hang
GPUS=${GPUS:-4}
if [ -e "$RUN" ]; then
    echo "gpu_in_job_hang: $RUN exists: this script makes a fresh run (move it away first)" >&2
    exit 2
fi
eval "$(bash bench/gpu_host_slurm.sh "${1:?usage: $0 DEB_FOLDER}")" || exit 2
GPUS=$GPUS python3 - <<'SPEC' || exit 2
import os
import yaml
from opskit.spec.load import deep_merge

preset = yaml.safe_load(open("opskit/spec/presets/tiny.yaml"))
spec = deep_merge({k: v for k, v in preset.items() if k != "variants"}, preset["variants"]["gpu"])
spec = deep_merge(spec, {
    "description": "tiny:gpu with local rank 1 hung after iteration 100 (bench/gpu_in_job_hang.sh)",
    "megatron_args": {"exit_interval": None}, "paths": {"output": "runs/tiny-gpu-hang"},
    "slurm": {"array": 1, "env": {"OPSKIT_TEST_FAULT": "hang:localhost:iteration=100:local_rank=1"}},
    "checkpoint": {"log_interval": 10}, "watchdog": {"in_job_timeout_mins": 0.5}})
if os.environ["GPUS"] == "1":
    spec = deep_merge(spec, {
        "parallel": {"gpus_per_node": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        "slurm": {"gres": "gpu:1", "env": {"OPSKIT_TEST_FAULT": "hang:localhost:iteration=100:local_rank=0"}}})
spec["megatron_args"] = {k: v for k, v in spec["megatron_args"].items() if v is not None}
yaml.safe_dump(spec, open("runs-tiny-gpu-hang.yaml", "w"))
SPEC
timeout 400 python3 -m opskit.cli.app submit runs-tiny-gpu-hang.yaml --wait
LOG=$RUN/logs/main_log.txt
grep -E '^\[opskit\]|iteration +(90|100)/|stacks requested' "$LOG" | cut -c1-300
[ -n "${OUT:-}" ] && cp "$LOG" "$OUT/tiny-gpu-hang-main_log.txt"
if [ "$GPUS" -gt 1 ]; then
    grep -q "in-job watchdog: .*hung: localhost local rank 1" "$LOG"
else  # one rank: no other to be behind, every stack alike; restarted on the same node until no restart is left
    grep -q "in-job watchdog: 1 of 1 ranks silent .*; hung: not named (every rank alike); stopping the step" "$LOG" &&
        grep -q "no in-job restart left" "$LOG"
fi
