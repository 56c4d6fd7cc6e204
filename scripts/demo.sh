#!/usr/bin/env bash
# `make demo`: a tiny BLOOM learns the King James Bible through a 2-task SLURM job array on this machine
# (task 1 stops on its exit duration with a checkpoint, task 2 resumes it), is converted to Hugging Face
# transformers, and writes a few lines. Falls back to the local executor where SLURM cannot run (no root/apt).
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=tiny
RUN=runs/tiny
step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

step "opskit data prepare $SPEC   (KJV Bible -> byte-level BPE tokenizer + Megatron indexed dataset)"
opskit data prepare "$SPEC"

step "a fresh run directory: $RUN"
rm -rf "$RUN"

executor=slurm
if ! scripts/local-slurm.sh start; then
    echo "demo: SLURM cannot run here (needs root and apt); running the same job script with the local executor"
    executor=local
fi

step "opskit plan $SPEC"
opskit plan "$SPEC"

if [ "$executor" = slurm ]; then
    step "opskit submit $SPEC --array 2 --wait   (sbatch --array=1-2%1; PULSE lines as the chain moves)"
    opskit submit "$SPEC" --array 2 --wait
    step "opskit status $SPEC   (the trainer wrote <run>/finished: no ALERT, exit 0; findings of the watchdog)"
    opskit status "$SPEC" || echo "(exit code $?)"
else
    step "opskit submit $SPEC --array 2 --executor local"
    opskit submit "$SPEC" --array 2 --executor local
fi

step "the chain in main_log.txt: job headers, exits, resumes"
grep -E '^\[opskit\]|exiting program|successfully loaded|after training is done' "$RUN/logs/main_log.txt"

step "opskit ckpt convert $SPEC   (Megatron-DeepSpeed checkpoint -> BloomForCausalLM, safetensors, verified)"
opskit ckpt convert "$SPEC"
latest=$(cat "$RUN/checkpoints/latest")

step "opskit ckpt generate $RUN/hf/$latest   (transformers, sampled)"
for prompt in "And God said" "In the beginning" "The LORD is my shepherd"; do
    opskit ckpt generate "$RUN/hf/$latest" --prompt "$prompt" --max-new-tokens 30
done

step "opskit logs show $SPEC"
opskit logs show "$SPEC" --last 5

step "opskit report $SPEC   (the run on one self-contained HTML page)"
opskit report "$SPEC"

step "artefacts"
echo "run page      $RUN/logs/report.html"
echo "main log      $RUN/logs/main_log.txt"
echo "tensorboard   $RUN/tensorboard   (tensorboard --logdir $RUN/tensorboard)"
echo "checkpoints   $RUN/checkpoints   (latest: $latest)"
echo "HF model      $RUN/hf/$latest"
echo "job script    $RUN/slurm/train.slurm"
echo "demo took $(( $(date +%s) - started )) s"
