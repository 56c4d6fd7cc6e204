"""Where one training iteration of opskit's trainer spends its time on a GPU (the bench/trainer_throughput.py model).

Runs ``opskit.train`` in-process with DeepSpeed's ``train_batch`` wrapped: iterations ``--time-from`` ..
``--profile-from - 1`` are timed with a device synchronize around each, then ``--profile-iters`` iterations run under
``torch.profiler`` (no synchronizes) to give the GPU's busy time per iteration and the top kernels. Prints the tables
last; the Chrome trace goes to ``$OUT`` when set.

Usage (GPU machine)::

    python bench/profile_step.py [--mbs 4] [--gbs 4] [--bloom] [--compile] [--extra "--flag value ..."]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_layout import union_length  # noqa: E402
from trainer_throughput import BLOOM, HEADS, H, L, S, make_data  # noqa: E402


def trainer_args(data: Path, tokenizer: Path, opts) -> list[str]:
    iters = opts.profile_from + opts.profile_iters + opts.host_iters + 1
    return [
        "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length", str(S),
        "--max-position-embeddings", str(S), "--micro-batch-size", str(opts.mbs), "--global-batch-size", str(opts.gbs),
        "--train-samples", str(opts.gbs * iters), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-samples", "4",
        "--bf16", "--zero-stage", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "5",
        "--data-path", str(data), "--tokenizer-name-or-path", str(tokenizer), "--seed", "1",
        *(BLOOM if opts.bloom else []), *(["--torch-compile"] if opts.compile else []), *shlex.split(opts.extra),
    ]


def busy_fraction(prof, iterations: int) -> tuple[float, float]:
    """(GPU busy ms per iteration, kernel-time ms per iteration) from the profiler's device events."""
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(b - a for a, b in intervals)
    return union_length(intervals) / 1000 / iterations, total / 1000 / iterations


def print_synchronizations(prof, iterations: int) -> None:
    """Where the host waits for the GPU (each wait lets the GPU's queue run dry): stream synchronizations per
    iteration, grouped by the Python stack that asked for them."""
    waits = [e for e in prof.key_averages(group_by_stack_n=8) if e.key == "cudaStreamSynchronize"]
    for event in sorted(waits, key=lambda e: -e.count):
        frames = [f for f in event.stack if "site-packages/torch/" not in f][:5]
        print(f"SYNC {event.count / iterations:.1f}/iteration: {' <- '.join(frames)}")


def print_idle_gaps(trace_file: str, iterations: int, min_gap_us: float = 20.0) -> None:
    """Where the GPU waits for the host: each gap of at least ``min_gap_us`` between kernels, charged to the Python
    frames (innermost first, torch's own left out) that were running when the host launched the kernel that ended it.
    Reads the Chrome trace torch.profiler exported with ``with_stack=True``."""
    import bisect
    import collections
    import json

    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    frames = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    starts = [f["ts"] for f in frames]
    idle: collections.Counter = collections.Counter()
    end = kernels[0]["ts"] if kernels else 0
    for kernel in kernels:
        gap = kernel["ts"] - end
        end = max(end, kernel["ts"] + kernel.get("dur", 0))
        launched = launches.get(kernel["args"].get("correlation"))
        if gap < min_gap_us or launched is None:
            continue
        # the innermost frames started shortly before the launch: the 4,000 frames before it hold them
        enclosing = [f["name"] for f in frames[max(0, bisect.bisect_right(starts, launched) - 4000):
                                               bisect.bisect_right(starts, launched)]
                     if f["ts"] + f.get("dur", 0) >= launched and "site-packages/torch/" not in f["name"]]
        idle[" <- ".join(reversed(enclosing[-4:]))] += gap
    total = sum(idle.values())
    print(f"GPU IDLE in gaps >= {min_gap_us:.0f} us: {total / 1000 / iterations:.1f} ms/iteration, by launching frames")
    for where, us in idle.most_common(20):
        print(f"IDLE {us / 1000 / iterations:6.1f} ms/iteration: {where[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=4)
    parser.add_argument("--bloom", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--extra", default="")
    parser.add_argument("--time-from", type=int, default=4)
    parser.add_argument("--profile-from", type=int, default=10)
    parser.add_argument("--profile-iters", type=int, default=3)
    parser.add_argument("--host-iters", type=int, default=0, help="Iterations after the profiled ones whose host "
                        "time cProfile breaks down.")
    opts = parser.parse_args()

    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from opskit.train.main import main as train_main

    calls = {"n": 0}
    host = cProfile.Profile()
    iteration_seconds: list[float] = []
    # Over the host iterations, per iteration: inside train_batch (launching, DeepSpeed's own waits), the GPU's tail
    # after it returns (waited for here, as the trainer's float(loss) would), and the trainer's loop until the next.
    split: dict[str, list[float]] = {"inside": [], "tail": [], "loop": []}
    last_return = {"t": None}
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                 torch.profiler.ProfilerActivity.CUDA], with_stack=True)
    inner_train_batch = PipelineEngine.train_batch

    def train_batch(self, *args, **kwargs):
        calls["n"] += 1
        n = calls["n"]
        timed = opts.time_from <= n < opts.profile_from
        if n == opts.profile_from:
            profile.start()
        if timed:
            torch.cuda.synchronize()
        start = time.perf_counter()
        hosted = opts.profile_from + opts.profile_iters <= n < opts.profile_from + opts.profile_iters + opts.host_iters
        if hosted and last_return["t"] is not None:
            split["loop"].append(start - last_return["t"])
        loss = inner_train_batch(self, *args, **kwargs)
        if hosted:
            returned = time.perf_counter()
            torch.cuda.synchronize()
            last_return["t"] = time.perf_counter()
            split["inside"].append(returned - start)
            split["tail"].append(last_return["t"] - returned)
        if timed:
            torch.cuda.synchronize()
            iteration_seconds.append(time.perf_counter() - start)
        if n == opts.profile_from + opts.profile_iters - 1:
            profile.stop()
            host.enable()  # the host's time over the next iterations, the trainer's loop included
        if n == opts.profile_from + opts.profile_iters + opts.host_iters - 1:
            host.disable()
        return loss

    PipelineEngine.train_batch = train_batch
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    with tempfile.TemporaryDirectory() as tmp:
        iterations = opts.profile_from + opts.profile_iters + opts.host_iters + 3
        data, tokenizer = make_data(Path(tmp), tokens=iterations * opts.gbs * (S + 1) * 2)
        train_main(trainer_args(data, tokenizer, opts))

    trace = os.path.join(os.environ.get("OUT") or tempfile.mkdtemp(), "trace.json")
    profile.export_chrome_trace(trace)
    print_idle_gaps(trace, opts.profile_iters)
    print(profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    print_synchronizations(profile, opts.profile_iters)
    if opts.host_iters:
        print(f"HOST: Python functions over {opts.host_iters} iterations (cProfile, by own time)")
        stats = pstats.Stats(host).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        stats.print_callers(r"format_stack|_lazy_call|rng_state|has_overflow_partitioned")
        print("HOST SPLIT ms/iteration: " + ", ".join(f"{k} {1000 * sum(v) / max(len(v), 1):.1f}"
                                                      for k, v in split.items()))
    busy, kernels = busy_fraction(profile, opts.profile_iters)
    iteration_ms = 1000 * sum(iteration_seconds) / len(iteration_seconds)
    print(f"\nSYNCHRONIZED: {iteration_ms:.1f} ms/iteration (mean of {len(iteration_seconds)}, MBS {opts.mbs} "
          f"GBS {opts.gbs})")
    print(f"PROFILED: GPU busy {busy:.1f} ms/iteration, kernel time {kernels:.1f} ms/iteration")


if __name__ == "__main__":
    main()
