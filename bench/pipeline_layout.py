"""tr11's parallel layout at small scale on the GPUs of one host (issue 20): a BLOOM-style model (ALiBi, embedding
LayerNorm, bf16, ZeRO-0, activation checkpointing, as tr11 ran) under TP x PP, its MFU per GPU, its pipeline bubble
measured next to the 1F1B schedule's ``(p-1)/(m+p-1)``, its peak memory next to ``opskit plan``'s estimate, and, in
the same call, one GPU running the same layers' share (``L / (TP * PP)`` layers at TP = PP = 1).

The bubble comes from timed runs only: an iteration of ``m`` micro-batches on ``p`` stages takes
``t(m) = (m + p - 1) tau + c`` (``tau``: one micro-batch's forward and backward on a stage; ``c``: the optimizer step
and what does not grow with ``m``). Two runs, at ``m1 < m2`` micro-batches, give the slope ``tau`` and the intercept
``b = (p - 1) tau + c``; the one-GPU run at the same two counts gives its own intercept ``c1`` (one stage: no bubble;
its optimizer step is over the same number of parameters per GPU), so the measured bubble at ``m`` is
``(b - c1) / t(m)``.

Usage (a host with TP*PP GPUs; DeepSpeed and megatron-core installed)::

    python bench/pipeline_layout.py --tp 2 --pp 2                      # 4 GPUs: 30 layers, hidden 4096
    python bench/pipeline_layout.py --tp 1 --pp 2 --micro-batches 8 32   # 2 GPUs (more time per call)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import BLOOM, PEAK_FLOPS, REPO, VOCAB, make_data  # noqa: E402

from opskit.logs.grammar import parse_iteration_line  # noqa: E402
from opskit.rules.model import megatron_flops_per_iteration, padded_vocab_size  # noqa: E402


def trainer_flags(layers: int, hidden: int, heads: int, seq: int, mbs: int, gbs: int, iters: int, tp: int,
                  pp: int, data: Path, tokenizer: Path) -> list[str]:
    """``python -m opskit.train`` flags of one run: tr11's choices (bf16, ZeRO-0, activation checkpointing, BLOOM)."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
        "--global-batch-size", str(gbs), "--train-samples", str(gbs * iters), "--lr", "6e-5", "--min-lr", "6e-6",
        "--lr-warmup-samples", str(gbs), "--bf16", "--zero-stage", "0", "--checkpoint-activations",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--seed", "1",
        "--data-path", str(data), "--tokenizer-name-or-path", str(tokenizer), *BLOOM,
    ]


def timed_run(flags: list[str], gpus: int, gbs: int) -> dict:
    """One trainer run under torchrun (``gpus`` processes): median seconds per iteration after the first two (from
    the log's samples per second, 3 decimals), and the largest ``max allocated`` of any rank (GiB, None on CPU)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    done = subprocess.run([*launcher, "-m", "opskit.train", *flags], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        sys.exit(f"trainer exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    records = [r for line in done.stdout.splitlines() if (r := parse_iteration_line(line))]
    seconds = statistics.median(gbs / r["samples_per_second"] for r in records[2:])
    peaks = [float(line.split("max allocated:")[1].split("|")[0]) for line in done.stdout.splitlines()
             if "max allocated:" in line]
    return {"s_per_iter": round(seconds, 4), "peak_gib": round(max(peaks) / 1024, 1) if peaks else None}


def plan_gib(layers: int, hidden: int, heads: int, seq: int, mbs: int, gbs: int, tp: int, pp: int) -> float:
    """``opskit plan``'s memory estimate (GiB on the heaviest GPU) for the same run, from bench/specs/gpt2-1.3B.yaml
    with this shape, layout and batch."""
    from opskit.spec.load import load_spec
    from opskit.spec.plan import make_plan

    overrides = {
        "model": {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": seq,
                  "max_position_embeddings": seq, "position_embedding_type": "alibi", "embed_layernorm": True,
                  "checkpoint_activations": True},
        "parallel": {"gpus_per_node": tp * pp, "tensor_model_parallel_size": tp,
                     "pipeline_model_parallel_size": pp, "zero_stage": 0},
        "batch": {"micro_batch_size": mbs, "global_batch_size": gbs, "train_samples": gbs * 100},
        "optimizer": {"lr_warmup_samples": gbs},
    }
    return make_plan(load_spec(str(REPO / "bench" / "specs" / "gpt2-1.3B.yaml"), overrides)).memory.total_gib_per_gpu


def measure(layers: int, tp: int, pp: int, micro_batches: list[int], args, data: Path, tokenizer: Path) -> dict:
    """Runs at each micro-batch count: seconds, tokens/s, MFU per GPU (Megatron's model FLOPs without recompute),
    peak memory and the plan's; the fitted slope and intercept of seconds over micro-batches."""
    gpus = tp * pp
    vocab = padded_vocab_size(VOCAB, 128, tp)
    rows = []
    for m in micro_batches:
        gbs = args.mbs * m
        run = timed_run(trainer_flags(layers, args.hidden, args.heads, args.seq, args.mbs, gbs, args.iters, tp, pp,
                                      data, tokenizer), gpus, gbs)
        flops = megatron_flops_per_iteration(gbs, args.seq, layers, args.hidden, vocab, recompute=False)
        rows.append({"micro_batches": m, **run, "tokens_per_s": round(gbs * args.seq / run["s_per_iter"]),
                     "mfu_per_gpu": round(flops / run["s_per_iter"] / gpus / PEAK_FLOPS, 4),
                     "plan_gib": round(plan_gib(layers, args.hidden, args.heads, args.seq, args.mbs, gbs, tp, pp), 1)})
    (m1, t1), (m2, t2) = [(r["micro_batches"], r["s_per_iter"]) for r in (rows[0], rows[-1])]
    slope = (t2 - t1) / (m2 - m1)
    return {"tp": tp, "pp": pp, "layers": layers, "rows": rows, "s_per_micro_batch": round(slope, 4),
            "intercept_s": round(t1 - slope * m1, 4)}


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout and model shape flags this bench and bench/profile_layout.py share (tr11's shape scaled to 30
    layers, TP2 x PP2)."""
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=2, help="tr11's micro-batch size")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_arguments(parser)
    # 8 and 16 micro-batches, 6 iterations: both layouts' four runs fit one 10-minute device call (8 and 32 at 8
    # iterations did not finish in 290 s)
    parser.add_argument("--micro-batches", type=int, nargs=2, default=[8, 16], metavar=("M1", "M2"))
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = args.mbs * max(args.micro_batches) * args.seq * (args.iters + 2)
        data, tokenizer = make_data(Path(tmp), max(tokens, 1 << 16))  # whole 8192-token documents
        layout = measure(args.layers, args.tp, args.pp, args.micro_batches, args, data, tokenizer)
        single = measure(args.layers // (args.tp * args.pp), 1, 1, args.micro_batches, args, data, tokenizer)
    p = args.pp
    for row in layout["rows"]:
        m = row["micro_batches"]
        row["bubble_measured"] = round((layout["intercept_s"] - single["intercept_s"]) / row["s_per_iter"], 4)
        row["bubble_schedule"] = round((p - 1) / (m + p - 1), 4)
    result = {"layout": layout, "one_gpu": single, "peak_flops": PEAK_FLOPS}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
