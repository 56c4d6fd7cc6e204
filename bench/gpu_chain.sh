#!/usr/bin/env bash
# The job script on GPUs (issue 47): `tiny:gpu`'s 2-task chain (the first task exits at iteration 250 with a
# checkpoint, the second resumes from it and finishes) through `opskit submit --wait` on a real one-node SLURM
# (bench/gpu_host_slurm.sh): the rendered script execs opskit.allocation.job, which runs the step through srun and
# opskit.allocation.node_step (torchrun, NCCL). Expected: two COMPLETED tasks in the ledger, the second loading
# global_step250, the finished flag. Prints opskit's main_log lines and `opskit status`; main_log.txt goes to $OUT when
# set. GPUS=1: one GPU (TP=1 x PP=1) instead of 4 (TP=2 x PP=2).
#
# FAULT=SPEC (issue 48) sets OPSKIT_TEST_FAULT on the nodes with a divergence patience of 20, e.g.
# FAULT='poison:*:iteration=300:count=25': the second task detects the spike, replays it from global_step250 on the GPU
# (replay_value against value in incidents.json: how far a GPU replay is from bitwise), rolls back and skips.
#
# There (the device tool, carrying .slurmdebs, the wheels and data/kjv's dataset and tokenizer):
#   [GPUS=1] [FAULT=...] bash bench/gpu_chain.sh .slurmdebs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RUN=runs/tiny-gpu-chain
if [ -e "$RUN" ]; then
    echo "gpu_chain: $RUN exists: this script makes a fresh run (move it away first)" >&2
    exit 2
fi
eval "$(bash bench/gpu_host_slurm.sh "${1:?usage: $0 DEB_FOLDER}")" || exit 2
GPUS=${GPUS:-4} python3 - <<'SPEC' || exit 2
import os
import yaml
from opskit.spec.load import deep_merge

preset = yaml.safe_load(open("opskit/spec/presets/tiny.yaml"))
spec = deep_merge({k: v for k, v in preset.items() if k != "variants"}, preset["variants"]["gpu"])
spec = deep_merge(spec, {"description": "tiny:gpu's chain through opskit.allocation.job (bench/gpu_chain.sh)",
                         "paths": {"output": "runs/tiny-gpu-chain"}})
if os.environ["GPUS"] == "1":
    spec = deep_merge(spec, {
        "parallel": {"gpus_per_node": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        "slurm": {"gres": "gpu:1"}})
if os.environ.get("FAULT"):
    spec = deep_merge(spec, {"slurm": {"env": {"OPSKIT_TEST_FAULT": os.environ["FAULT"]}},
                             "watchdog": {"divergence": {"patience": 20}}})
yaml.safe_dump(spec, open("runs-tiny-gpu-chain.yaml", "w"))
SPEC
started=$SECONDS
timeout 500 python3 -m opskit.cli.app submit runs-tiny-gpu-chain.yaml --wait
echo "chain of 2 tasks: $((SECONDS - started)) s"
LOG=$RUN/logs/main_log.txt
grep -E '^\[opskit\]|iteration +(250|500)/|loaded checkpoint|successfully saved|divergence|Skipped' "$LOG" | cut -c1-300
[ -e "$RUN/incidents.json" ] && cat "$RUN/incidents.json"
python3 -m opskit.cli.app status runs-tiny-gpu-chain.yaml
[ -n "${OUT:-}" ] && cp "$LOG" "$OUT/tiny-gpu-chain-main_log.txt"
[ -e "$RUN/finished" ] && [ "$(grep -c '"state":"COMPLETED"' "$RUN/ledger.jsonl")" -eq 2 ]
