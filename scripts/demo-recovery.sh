#!/usr/bin/env bash
# `make demo-recovery`: recovery inside the allocation on a 3-node SLURM on this machine (scripts/local-slurm.sh
# --nodes 3, state in runs/.slurm-multinode). Two 1-task jobs of a tiny BLOOM trained on 2 nodes of a 3-node
# allocation (slurm.spare_nodes: 1), each with the test-only fault hook on node2:
#   1. a hang after iteration 12: the in-job watchdog (15 s timeout) names node2 and stops the step, and training
#      resumes from the save at 10 on node1 + node3 under the same job id;
#   2. a GEMM 3x slower: the pre-flight check keeps node2 out before training, which runs on node1 + node3.
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
for name in demo-recovery-hang demo-recovery-slow; do
    if [ -e "trainings/$name.yaml" ] && ! grep -qxF "$MARKER" "trainings/$name.yaml"; then
        echo "demo-recovery: trainings/$name.yaml exists and is not the demo's; move it away first" >&2
        exit 2
    fi
done

write_spec() {  # name, fault, description
    mkdir -p trainings
    cat >"trainings/$1.yaml" <<EOF
$MARKER
# (make demo-recovery rewrites this file; it refuses to touch one it did not write)
description: "$3"
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32, max_position_embeddings: 32,
        position_embedding_type: alibi, embed_layernorm: true, hidden_dropout: 0.0, attention_dropout: 0.0,
        precision: fp32}
parallel: {nodes: 2, gpus_per_node: 1}
batch: {micro_batch_size: 4, global_batch_size: 8, train_samples: 240}    # 30 iterations
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, lr_decay_style: cosine, lr_warmup_samples: 32}
data: {corpus: kjv, dir: data/kjv, name: kjv, vocab_size: 8000}          # the data of \`make demo\`
checkpoint: {save_interval: 5, log_interval: 1, seed: 42}
watchdog: {in_job_timeout_mins: 0.25}    # 15 s without a heartbeat is a hang
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
    grep -E '^\[opskit\]|iteration +(1[0-3]|30)/|successfully loaded' "runs/$1/logs/main_log.txt" | cut -c1-200
    python - "runs/$1/ledger.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"ledger: {r['task']} {r['state']} exit {r['exit_code']} on {r['nodes']}")
EOF
}

write_spec demo-recovery-hang "hang:node2:iteration=12" "recovery demo: node2 hangs after iteration 12 (test-only fault hook)"
write_spec demo-recovery-slow "slow_gemm:node2" "recovery demo: node2's GEMM is 3x slower (test-only fault hook)"

step "opskit data prepare demo-recovery-hang   (the KJV Bible tokenized; skipped when make demo did it)"
opskit data prepare demo-recovery-hang

trap stop_cluster EXIT
trap 'exit 130' INT TERM
step "scripts/local-slurm.sh start --nodes 3   (state: $OPSKIT_SLURM_DIR)"
scripts/local-slurm.sh start --nodes 3
sinfo

step "1. a hang on node2: opskit submit demo-recovery-hang --wait"
opskit submit demo-recovery-hang --wait
timeline demo-recovery-hang
grep -q "training step 1 on nodes node1,node3" runs/demo-recovery-hang/logs/main_log.txt
test -e runs/demo-recovery-hang/finished

step "2. a slow node2: opskit submit demo-recovery-slow --wait"
opskit submit demo-recovery-slow --wait
timeline demo-recovery-slow
grep -q "pre-flight: node2 kept out" runs/demo-recovery-slow/logs/main_log.txt
test -e runs/demo-recovery-slow/finished

step "opskit goodput demo-recovery-hang   (step 0's hang and redone iterations, step 1 on the spare)"
COLUMNS=120 opskit goodput demo-recovery-hang
