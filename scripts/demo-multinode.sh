#!/usr/bin/env bash
# `make demo-multinode`: the node-failure story on a 3-node SLURM on this machine (scripts/local-slurm.sh --nodes 3,
# state in runs/.slurm-multinode). A 2-task chain of a tiny BLOOM on 2 nodes (1 CPU each) where the test-only fault
# hook crashes the trainer on node2 at iteration 6: task 1 is FAILED on node[1-2] with the CUDA crash signature,
# node2 goes on the run's bad-node list, the queued task 2 is moved off node2 and resumes on node[1,3] from the last
# checkpoint (iteration 4). The cluster is stopped on every exit (Ctrl-C and failures included). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=demo-multinode
SPEC=trainings/$NAME.yaml
RUN=runs/$NAME
MARKER="# Written by scripts/demo-multinode.sh"
export OPSKIT_SLURM_DIR=$PWD/runs/.slurm-multinode
export SLURM_CONF=$OPSKIT_SLURM_DIR/slurm.conf   # opskit's sbatch/squeue/scontrol calls talk to this cluster
step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

if [ -e "$SPEC" ] && ! grep -qxF "$MARKER" "$SPEC"; then
    echo "demo-multinode: $SPEC exists and is not the demo's; move it away first" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "demo-multinode: the 3-node cluster needs root (network and UTS namespaces)" >&2
    exit 2
fi

step "the spec $SPEC: the tiny BLOOM made smaller, 2 nodes x 1 CPU, crash hook on node2 after iteration 6"
mkdir -p trainings
cat >"$SPEC" <<EOF
$MARKER
# (make demo-multinode rewrites this file; it refuses to touch one it did not write)
description: multi-node demo, a crash on node2 (test-only fault hook)
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32, max_position_embeddings: 32,
        position_embedding_type: alibi, embed_layernorm: true, hidden_dropout: 0.0, attention_dropout: 0.0,
        precision: fp32}
parallel: {nodes: 2, gpus_per_node: 1}
batch: {micro_batch_size: 4, global_batch_size: 8, train_samples: 96}    # 12 iterations
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, lr_decay_style: cosine, lr_warmup_samples: 32}
data: {corpus: kjv, dir: data/kjv, name: kjv, vocab_size: 8000}          # the data of \`make demo\`
checkpoint: {save_interval: 4, log_interval: 1, seed: 42}
slurm:
  job_name: $NAME
  array: 2
  max_failures: 3
  time: "10"                             # minutes
  exit_margin_mins: 1.0
  signal_margin_secs: 60
  cpus_per_task: 1                       # the local nodes have CPUs=1
  env:
    OMP_NUM_THREADS: "1"
    PYTHONPATH: "$PWD"                   # this checkout's opskit on every node
    OPSKIT_TEST_FAULT: "crash:node2:iteration=6"   # TEST-ONLY: a CUDA crash signature on node2, exit 1
paths:
  output: $RUN
EOF

step "opskit data prepare $NAME   (the KJV Bible tokenized; skipped when make demo did it)"
opskit data prepare "$NAME"

step "a fresh run directory: $RUN"
rm -rf "$RUN"

stop_cluster() {
    step "scripts/local-slurm.sh stop   (every process, namespace and link the cluster made)"
    scripts/local-slurm.sh stop || true
    echo "demo-multinode took $(($(date +%s) - started)) s"
}
trap stop_cluster EXIT
trap 'exit 130' INT TERM

step "scripts/local-slurm.sh start --nodes 3   (state: $OPSKIT_SLURM_DIR)"
scripts/local-slurm.sh start --nodes 3
sinfo

step "opskit submit $NAME --wait   (sbatch --array=1-2%1 on 2 nodes; PULSE lines as the chain moves)"
opskit submit "$NAME" --wait

step "the ledger $RUN/ledger.jsonl"
python - "$RUN/ledger.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['time']}  {r['task']:<8} {r['state']:<10} exit {r['exit_code']}  {r['nodes']:<10} {r['reason']}")
EOF

step "the crash and what the epilogue did, in $RUN/logs/main_log.txt"
grep -E 'CUDA error|bad node|now exclude|successfully loaded|^\[opskit\].*: start$' "$RUN/logs/main_log.txt"

step "opskit nodes list $NAME"
opskit nodes list "$NAME"

step "opskit status $NAME   (exit 1: the crash is an alert)"
COLUMNS=120 opskit status "$NAME" || echo "(exit code $?)"

step "resume point and measured time"
resumed=$(grep -oP 'successfully loaded checkpoint from .* at iteration +\K[0-9]+' "$RUN/logs/main_log.txt" | head -1)
echo "task 2 resumed from iteration $resumed (the last save before the crash); latest: $(cat "$RUN/checkpoints/latest")"
failed_at=$(python -c 'import json,sys; print(next(json.loads(l)["time"] for l in open(sys.argv[1])
            if json.loads(l)["state"] == "FAILED"))' "$RUN/ledger.jsonl")
next_at=$(grep -oP '^\[opskit\] \K\S+ \S+(?= job \S+ \(array task \S+_2\) nodes \S+: start$)' "$RUN/logs/main_log.txt" |
          head -1)
echo "crash recorded $failed_at -> task 2 running $next_at: $(($(date -d "$next_at" +%s) - $(date -d "$failed_at" +%s))) s"

step "opskit goodput $NAME --out $RUN/goodput.png   (the crash's redone iterations: from the resume point to 6)"
COLUMNS=120 opskit goodput "$NAME" --out "$RUN/goodput.png"
redone=$(opskit goodput "$NAME" --json | python -c 'import json,sys; print(json.load(sys.stdin)["tasks"][0]["redone_iterations"])')
if [ "$redone" -ne $((6 - ${resumed:-0})) ]; then
    echo "goodput: task 1 lost $redone iterations; the crash at 6 after the save at ${resumed:-0} lost" \
         "$((6 - ${resumed:-0}))" >&2
    exit 1
fi
echo "redone iterations of task 1: $redone = 6 (the crash) - ${resumed:-0} (the last save): exact"

step "opskit report $NAME   (the run's page: the crash on node2, its exclusion, the resume on node[1,3])"
opskit report "$NAME"
