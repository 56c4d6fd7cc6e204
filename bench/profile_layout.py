"""Where a TP x PP iteration's time goes on each GPU, next to one GPU running the same share of layers (issue 33's
first question: why TP2 x PP2 loses ~27% MFU against one GPU, when the bubble explains only a few percent).

Two runs of bench/pipeline_layout.py's model (tr11's choices: ALiBi, embedding LayerNorm, bf16, ZeRO-0, full
activation checkpointing) with the trainer's Megatron-LM profiling flags (``--profile --use-pytorch-profiler``,
iterations ``[--start, --start + --iters)`` traced on every rank): the layout on TP x PP GPUs, and one GPU with
``L / (TP * PP)`` layers at the same micro-batch size and count. Each rank's Chrome trace is reduced to milliseconds
per iteration of its GPU timeline: the window (first kernel start to last kernel end over the traced iterations),
the time any compute kernel runs, the time NCCL kernels run, NCCL time with no compute kernel running beside it
(exposed communication), and idle time (no kernel at all: bubble, host overhead, waits); plus the kernels by class
(GEMM, attention, NCCL, other) and the largest ones, each iteration's host span, and the CUDA runtime calls the host
spent most time in (launches, synchronizations, copies).

Usage (a host with TP*PP GPUs)::

    python bench/profile_layout.py --tp 2 --pp 2 --micro-batches 16 --out DIR
    python bench/profile_layout.py --extra=--torch-compile --out DIR     # a flag value: with '='
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_layout import add_layout_arguments, trainer_flags  # noqa: E402
from trainer_throughput import REPO, make_data  # noqa: E402

CLASSES = (("nccl", ("nccl",)), ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
           ("attention", ("flash", "fmha", "attention", "softmax")))


def kernel_class(name: str) -> str:
    """``nccl``, ``gemm``, ``attention`` or ``other``, from a CUDA kernel's name (first matching class)."""
    lower = name.lower()
    return next((cls for cls, words in CLASSES if any(w in lower for w in words)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` ((start, end) pairs, any order, overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarise(trace: Path, iterations: int) -> dict:
    """One rank's GPU timeline over the traced iterations, in ms per iteration (module docstring)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("cat") == "kernel" and e.get("dur") is not None]
    if not kernels:
        return {"trace": trace.name, "error": "no CUDA kernels in the trace"}
    window = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    by_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    names: dict[str, float] = defaultdict(float)
    for a, b, name in kernels:
        by_class[kernel_class(name)].append((a, b))
        names[name] += b - a
    host: dict[str, float] = defaultdict(float)  # where the host blocks or launches (cuda_runtime calls)
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("dur") is not None:
            host[e["name"]] += e["dur"]
    compute = [iv for cls, ivs in by_class.items() if cls != "nccl" for iv in ivs]
    nccl = by_class.get("nccl", [])
    busy = union_length(compute + nccl)
    compute_busy, nccl_busy = union_length(compute), union_length(nccl)
    per_iter = 1e-3 / iterations  # trace times are microseconds
    return {
        "trace": trace.name,
        "window_ms": round(window * per_iter, 2),
        "compute_ms": round(compute_busy * per_iter, 2),
        "nccl_ms": round(nccl_busy * per_iter, 2),
        "nccl_exposed_ms": round((busy - compute_busy) * per_iter, 2),
        "idle_ms": round((window - busy) * per_iter, 2),
        "by_class_ms": {cls: round(sum(b - a for a, b in ivs) * per_iter, 2) for cls, ivs in sorted(by_class.items())},
        "top_kernels_ms": [(name[:90], round(t * per_iter, 2))
                           for name, t in sorted(names.items(), key=lambda kv: -kv[1])[:12]],
        "iteration_spans_ms": [round(e["dur"] / 1e3, 1) for e in events
                               if e.get("name", "").startswith("iteration ") and e.get("dur") is not None],
        "top_cuda_runtime_ms": [(name, round(t * per_iter, 2))
                                for name, t in sorted(host.items(), key=lambda kv: -kv[1])[:6]],
    }


def profiled_run(flags: list[str], gpus: int, start: int, iters: int, tb: Path) -> list[dict]:
    """The trainer under torchrun with every rank profiled; one summary per rank's trace."""
    profile = ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end",
               str(start + iters), "--profile-ranks", *map(str, range(gpus)), "--tensorboard-dir", str(tb)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    done = subprocess.run([*launcher, "-m", "opskit.train", *flags, *profile], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        sys.exit(f"trainer exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    traces = sorted(tb.glob("rank*.pt.trace.json*"))
    return [summarise(t, iters) for t in traces]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_arguments(parser)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--start", type=int, default=4, help="first traced iteration (after warm-up)")
    parser.add_argument("--iters", type=int, default=2, help="traced iterations")
    parser.add_argument("--extra", default="", help="more trainer flags for both runs (e.g. --torch-compile)")
    parser.add_argument("--runs", default="layout,one_gpu", help="which runs, comma-separated: layout, one_gpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not set(args.runs.split(",")) <= {"layout", "one_gpu"}:
        parser.error(f"--runs names layout or one_gpu, got {args.runs!r}")
    gbs, total = args.mbs * args.micro_batches, args.start + args.iters
    result = {"config": vars(args) | {"out": None}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, tokenizer = make_data(tmp, max(gbs * args.seq * (total + 2), 1 << 16))
        for name, layers, tp, pp in (("layout", args.layers, args.tp, args.pp),
                                     ("one_gpu", args.layers // (args.tp * args.pp), 1, 1)):
            if name not in args.runs.split(","):
                continue
            flags = trainer_flags(layers, args.hidden, args.heads, args.seq, args.mbs, gbs, total, tp, pp, data,
                                  tokenizer) + args.extra.split()
            result[name] = profiled_run(flags, tp * pp, args.start, args.iters, tmp / f"tb-{name}")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_layout.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
