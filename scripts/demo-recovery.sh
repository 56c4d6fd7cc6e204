#!/usr/bin/env bash
# `make demo-recovery`: recovery inside the allocation on a 3-node SLURM on this machine (scripts/local-slurm.sh
# --nodes 3, state in runs/.slurm-multinode). Two 1-task jobs of a tiny BLOOM trained on 2 nodes of a 3-node
# allocation (slurm.spare_nodes: 1), each with the test-only fault hook on node2:
#   1. a hang after iteration 12: the in-job watchdog (15 s timeout) names node2 and stops the step, and training
#      resumes from the save at 10 on node1 + node3 under the same job id;
#   2. a GEMM 3x slower: the pre-flight check keeps node2 out before training, which runs on node1 + node3;
#   3. bad data (the batches of iterations 25-28 poisoned): the trainer's divergence check stops at 28 without
#      saving, the job replays from global_step20, the spike comes back at 25, the job rolls back to 20 and skips
#      21-28, training finishes: no person;
#   4. silent data corruption (one bit of a replica's parameters on node2 flips after iteration 12, 4 replicas): the
#      replica digests of iteration 15 name node2, which is kept out; training resumes from global_step10 on node3.
# Prints each job's timeline from main_log.txt. The cluster is stopped on every exit. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
MARKER="# Written by scripts/demo-recovery.sh"
export OPSKIT_SLURM_DIR=$PWD/runs/.slurm-multinode
export SLURM_CONF=$OPSKIT_SLURM_DIR/slurm.conf   # opskit's sbatch/squeue/scontrol calls talk to this cluster
step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

if [ "$(id -u)" -ne 0 ]; then
    echo "demo-recovery: the 3-node cluster needs root (network and UTS namespaces)" >&2
    exit 2
fi
for name in demo-recovery-hang demo-recovery-slow demo-recovery-data demo-recovery-flip; do
    if [ -e "trainings/$name.yaml" ] && ! grep -qxF "$MARKER" "trainings/$name.yaml"; then
        echo "demo-recovery: trainings/$name.yaml exists and is not the demo's; move it away first" >&2
        exit 2
    fi
done

write_spec() {  # name, fault, description, [iterations, gpus per node, ZeRO stage]
    local iterations=${4:-30} gpus=${5:-1} zero=${6:-1}
    mkdir -p trainings
    cat >"trainings/$1.yaml" <<EOF
$MARKER
# (make demo-recovery rewrites this file; it refuses to touch one it did not write)
description: "$3"
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32, max_position_embeddings: 32,
        position_embedding_type: alibi, embed_layernorm: true, hidden_dropout: 0.0, attention_dropout: 0.0,
        precision: fp32}
parallel: {nodes: 2, gpus_per_node: $gpus, zero_stage: $zero}
batch: {micro_batch_size: $((4 / gpus)), global_batch_size: 8, train_samples: $((iterations * 8))}
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, lr_decay_style: cosine, lr_warmup_samples: 32}
data: {corpus: kjv, dir: data/kjv, name: kjv, vocab_size: 8000}          # the data of \`make demo\`
checkpoint: {save_interval: 5, log_interval: 1, seed: 42}
watchdog:
  in_job_timeout_mins: 0.25              # 15 s without a heartbeat is a hang
  spike_window: 10                       # a short run: 10 values make the spike rule's window
  divergence: {patience: 3, digest_interval: 5}
slurm:
  job_name: $1
  array: 1
  spare_nodes: 1                         # the allocation is 3 nodes, training uses 2
  time: "10"                             # minutes
  exit_margin_mins: 1.0
  signal_margin_secs: 60
  cpus_per_task: 1                       # the local nodes have CPUs=1
  env:
    OMP_NUM_THREADS: "1"
    PYTHONPATH: "$PWD"                   # this checkout's opskit on every node
    OPSKIT_TEST_FAULT: "$2"              # TEST-ONLY
paths:
  output: runs/$1
EOF
    rm -rf "runs/$1"
}

stop_cluster() {
    step "scripts/local-slurm.sh stop   (every process, namespace and link the cluster made)"
    scripts/local-slurm.sh stop || true
    echo "demo-recovery took $(($(date +%s) - started)) s"
}

timeline() {  # name: the job's [opskit] lines and the iteration lines around the fault
    grep -E '^\[opskit\]|iteration +(1[0-3]|2[4-5]|30|40)/|successfully loaded|divergence:|Skipped' \
        "runs/$1/logs/main_log.txt" | cut -c1-220
    python - "runs/$1/ledger.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"ledger: {r['task']} {r['state']} exit {r['exit_code']} on {r['nodes']}")
EOF
}

write_spec demo-recovery-hang "hang:node2:iteration=12" "recovery demo: node2 hangs after iteration 12 (test-only fault hook)"
write_spec demo-recovery-slow "slow_gemm:node2" "recovery demo: node2's GEMM is 3x slower (test-only fault hook)"
write_spec demo-recovery-data "poison:*:iteration=25:count=4" \
    "recovery demo: the batches of iterations 25-28 are bad data (test-only fault hook)" 40
write_spec demo-recovery-flip "flip:node2:iteration=12:local_rank=1" \
    "recovery demo: a bit of a replica's parameters flips on node2 (test-only fault hook)" 30 2 0

step "opskit data prepare demo-recovery-hang   (the KJV Bible tokenized; skipped when make demo did it)"
opskit data prepare demo-recovery-hang

trap stop_cluster EXIT
trap 'exit 130' INT TERM
step "scripts/local-slurm.sh start --nodes 3   (state: $OPSKIT_SLURM_DIR)"
scripts/local-slurm.sh start --nodes 3
sinfo

run_case() {  # label, name, a line main_log.txt must hold: submit, wait, show the timeline, check it finished
    step "$1: opskit submit $2 --wait"
    opskit submit "$2" --wait
    timeline "$2"
    grep -q "$3" "runs/$2/logs/main_log.txt"
    test -e "runs/$2/finished"
}
run_case "1. a hang on node2" demo-recovery-hang "training step 1 on nodes node1,node3"
run_case "2. a slow node2" demo-recovery-slow "pre-flight: node2 kept out"
run_case "3. bad data" demo-recovery-data "the replay reproduced the spike at iteration 25"
run_case "4. a flipped bit" demo-recovery-flip "training step 1 on nodes node1,node3"

step "opskit logs spikes demo-recovery-data --window 10   (the spike, and what the run did about it)"
COLUMNS=120 opskit logs spikes demo-recovery-data --window 10

step "opskit goodput demo-recovery-hang   (step 0's hang and redone iterations, step 1 on the spare)"
COLUMNS=120 opskit goodput demo-recovery-hang
