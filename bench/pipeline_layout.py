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

With one micro-batch count there is no fit and no bubble. ``--recompute none`` drops ``--checkpoint-activations``
(what ``opskit plan`` advises where the activations fit), ``--recompute selective`` gives ``--recompute-granularity
selective`` instead; ``--extra=FLAG`` adds trainer flags (e.g.
``--extra=--torch-compile``); ``--runs`` picks the runs: ``layout``, ``single`` (the default pair) and ``peer``,
megatron-core's GPTModel at the same layout, batch and recompute (bench/mcore_gpt.py, its own 1F1B schedule, flash
attention through SDPA, learned positions instead of ALiBi; with its sequence parallelism when ``--extra`` names
``--sequence-parallel``, which needs Transformer Engine or Apex: see bench/mcore_gpt.py). The memory line the
trainer prints is at the first log interval (Megatron's rule): ``--log-interval`` 2 makes it cover iteration 2, with
Adam's states and activations.

Usage (a host with TP*PP GPUs; DeepSpeed and megatron-core installed)::

    python bench/pipeline_layout.py --tp 2 --pp 2                      # 4 GPUs: 30 layers, hidden 4096
    python bench/pipeline_layout.py --tp 1 --pp 2 --micro-batches 8 32   # 2 GPUs (more time per call)
    python bench/pipeline_layout.py --micro-batches 16 --recompute none --extra=--torch-compile --runs layout,peer
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
from trainer_throughput import BLOOM, PEAK_FLOPS, REPO, VOCAB, make_data, memory_lines  # noqa: E402

from opskit.logs.grammar import parse_iteration_line  # noqa: E402
from opskit.rules.model_size import megatron_flops_per_iteration, padded_vocab_size  # noqa: E402

RECOMPUTE_FLAGS = {"full": ["--checkpoint-activations"], "selective": ["--recompute-granularity", "selective"],
                   "none": []}


def trainer_flags(layers: int, hidden: int, heads: int, seq: int, mbs: int, gbs: int, iters: int, tp: int,
                  pp: int, data: Path, tokenizer: Path, recompute: str = "full") -> list[str]:
    """``python -m opskit.train`` flags of one run: tr11's choices (bf16, ZeRO-0, BLOOM; activation checkpointing
    with ``recompute="full"``)."""
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
        "--global-batch-size", str(gbs), "--train-samples", str(gbs * iters), "--lr", "6e-5", "--min-lr", "6e-6",
        "--lr-warmup-samples", str(gbs), "--bf16", "--zero-stage", "0",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "2", "--seed", "1",
        "--data-path", str(data), "--tokenizer-name-or-path", str(tokenizer), *BLOOM,
    ]
    return [*flags, *RECOMPUTE_FLAGS[recompute]]


def timed_run(flags: list[str], gpus: int, gbs: int, sync_points: str | None = None) -> dict:
    """One trainer run under torchrun (``gpus`` processes): median seconds per iteration after the first two (from
    the log's samples per second, one line per 2 iterations), and the largest ``max allocated`` of any rank at the
    first log line (iteration 2: Adam's states and the activations; GiB, None on CPU). With ``sync_points`` (a
    folder) the trainer runs under bench/sync_points.py, which counts its synchronizing calls there (and slows it)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    trainer = ([str(REPO / "bench" / "sync_points.py"), "--out", sync_points, "--"] if sync_points
               else ["-m", "opskit.train"])
    done = subprocess.run([*launcher, *trainer, *flags], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        sys.exit(f"trainer exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    records = [r for line in done.stdout.splitlines() if (r := parse_iteration_line(line))]
    seconds = statistics.median(gbs / r["samples_per_second"] for r in records[1:])
    peaks = [r["max_allocated_mib"] for r in memory_lines(done.stdout)]
    return {"s_per_iter": round(seconds, 4), "peak_gib": round(max(peaks) / 1024, 1) if peaks else None}


def plan_gib(layers: int, hidden: int, heads: int, seq: int, mbs: int, gbs: int, tp: int, pp: int,
             recompute: str = "full", extra: tuple[str, ...] = ()) -> float:
    """``opskit plan``'s memory estimate (GiB on the heaviest GPU) for the same run, from bench/specs/gpt2-1.3B.yaml
    with this shape, layout, batch, recompute and the extra flags the plan reads (``--sequence-parallel``,
    ``--torch-compile``: its loss buffers differ)."""
    from opskit.spec.load import load_spec
    from opskit.spec.plan import make_plan

    overrides = {
        "model": {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": seq,
                  "max_position_embeddings": seq, "position_embedding_type": "alibi", "embed_layernorm": True,
                  "checkpoint_activations": recompute == "full",
                  "recompute_granularity": "selective" if recompute == "selective" else None},
        "parallel": {"gpus_per_node": tp * pp, "tensor_model_parallel_size": tp,
                     "pipeline_model_parallel_size": pp, "zero_stage": 0,
                     "sequence_parallel": "--sequence-parallel" in extra},
        "batch": {"micro_batch_size": mbs, "global_batch_size": gbs, "train_samples": gbs * 100},
        "optimizer": {"lr_warmup_samples": gbs},
        "megatron_args": {"torch_compile": "--torch-compile" in extra},
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
        flags = trainer_flags(layers, args.hidden, args.heads, args.seq, args.mbs, gbs, args.iters, tp, pp, data,
                              tokenizer, args.recompute)
        run = timed_run([*flags, *args.extra], gpus, gbs, args.sync_points if gpus > 1 else None)
        flops = megatron_flops_per_iteration(gbs, args.seq, layers, args.hidden, vocab, recompute=False)
        rows.append({"micro_batches": m, **run, "tokens_per_s": round(gbs * args.seq / run["s_per_iter"]),
                     "mfu_per_gpu": round(flops / run["s_per_iter"] / gpus / PEAK_FLOPS, 4),
                     "plan_gib": round(plan_gib(layers, args.hidden, args.heads, args.seq, args.mbs, gbs, tp, pp,
                                                args.recompute, tuple(args.extra)), 1)})
        print(json.dumps({"tp": tp, "pp": pp, **rows[-1]}), flush=True)
    result = {"tp": tp, "pp": pp, "layers": layers, "recompute": args.recompute, "extra": args.extra, "rows": rows}
    if len(rows) == 2:
        (m1, t1), (m2, t2) = [(r["micro_batches"], r["s_per_iter"]) for r in rows]
        slope = (t2 - t1) / (m2 - m1)
        result.update(s_per_micro_batch=round(slope, 4), intercept_s=round(t1 - slope * m1, 4))
    return result


def peer_run(args) -> dict:
    """megatron-core's GPTModel at this layout, shape, batch (the largest micro-batch count) and recompute: the JSON
    line bench/mcore_gpt.py's last stage prints."""
    env = dict(os.environ, TP=str(args.tp), PP=str(args.pp), LAYERS=str(args.layers), HIDDEN=str(args.hidden),
               HEADS=str(args.heads), SEQ=str(args.seq), MBS=str(args.mbs), GAS=str(max(args.micro_batches)),
               STEPS=str(args.iters), RECOMPUTE=args.recompute, ATTN="sdpa",
               SP="1" if "--sequence-parallel" in args.extra else "0")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp * args.pp)]
    done = subprocess.run([*launcher, str(REPO / "bench" / "mcore_gpt.py")], capture_output=True, text=True,
                          cwd=REPO, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:  # the workers' own error lines first: torchrun's summary hides them
        errors = [line for line in done.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line]
        return {"error": f"exit {done.returncode}: {errors[-5:]} {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


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
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16], metavar="M",
                        help="one count, or two for the bubble fit")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--recompute", choices=tuple(RECOMPUTE_FLAGS), default="full")
    parser.add_argument("--extra", action="append", default=[], help="a trainer flag, given as --extra=FLAG")
    parser.add_argument("--runs", default="layout,single",
                        help="which runs, comma-separated: layout (TP x PP), single (one GPU, the same share), peer "
                             "(megatron-core's GPTModel at the layout)")
    parser.add_argument("--sync-points", default=None, metavar="DIR",
                        help="run the layout under bench/sync_points.py: its synchronizing calls per rank in DIR")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    if len(args.micro_batches) > 2 or not runs <= {"layout", "single", "peer"}:
        parser.error("--micro-batches takes one or two counts; --runs names layout, single or peer")
    result = {"peak_flops": PEAK_FLOPS}
    with tempfile.TemporaryDirectory() as tmp:
        tokens = args.mbs * max(args.micro_batches) * args.seq * (args.iters + 2)
        data, tokenizer = make_data(Path(tmp), max(tokens, 1 << 16))  # whole 8192-token documents
        if "layout" in runs:
            result["layout"] = measure(args.layers, args.tp, args.pp, args.micro_batches, args, data, tokenizer)
        if "single" in runs:
            result["one_gpu"] = measure(args.layers // (args.tp * args.pp), 1, 1, args.micro_batches, args, data,
                                        tokenizer)
    if "peer" in runs:
        result["peer"] = peer_run(args)
        print(json.dumps(result["peer"]), flush=True)
    layout, single, peer = (result.get(k) for k in ("layout", "one_gpu", "peer"))
    if layout and single:
        for row in layout["rows"] if "intercept_s" in layout else []:
            m, p = row["micro_batches"], args.pp
            row["bubble_measured"] = round((layout["intercept_s"] - single["intercept_s"]) / row["s_per_iter"], 4)
            row["bubble_schedule"] = round((p - 1) / (m + p - 1), 4)
        mfus = layout["rows"][-1]["mfu_per_gpu"], single["rows"][-1]["mfu_per_gpu"]
        result["layout_over_one_gpu_mfu"] = round(mfus[0] / mfus[1], 4) if mfus[1] else None  # None: 0.0% (a CPU)
    if layout and peer and "tokens_per_s" in peer:
        result["opskit_over_peer_tokens"] = round(layout["rows"][-1]["tokens_per_s"] / peer["tokens_per_s"], 4)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
