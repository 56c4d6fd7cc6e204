"""The trainer's peak GPU memory against ``opskit plan``, and where the peak comes from (issue 50).

Model: bench/trainer_throughput.py's 1.3B GPT-2 (bf16, ZeRO-1, DP 1, random tokens), eager (``gpt``) or compiled
(``gpt-compile``), at a micro-batch size M and G micro-batches per step (``gpt:MxG``). Each run trains 3 iterations
and logs at 2: the trainer's one memory line (``max allocated``, torch.cuda.max_memory_allocated) then covers a whole
iteration with the optimizer states in place, which is the steady state (every later iteration allocates the same).
``plan_mem_gb`` is ``opskit plan bench/specs/gpt2-1.3B.yaml`` at the run's MBS, GBS and compile flag.

With ``--snapshot``, the named runs record every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``); the log is replayed up to the moment of the peak, and what was
allocated then is grouped by the pipeline instruction that allocated it (DeepSpeed's ``_exec_forward_pass``,
``_exec_backward_pass``, ``_exec_optimizer_step``, ...; the micro-batch and iteration it belonged to), the innermost
opskit or DeepSpeed frame and the size. Allocations of autograd's backward have no Python frame (they run on its
device thread) and count for the instruction running at the time.

Usage (on a GPU machine, DeepSpeed and megatron-core installed)::

    python bench/memory_peak.py gpt:8x8 gpt:8x1 gpt-compile:8x16 --snapshot gpt:8x8 --out peaks.json
    python bench/memory_peak.py gpt:8x8 gpt-compile:8x1 gpt:4x1 gpt-compile:4x1 --lanes 2  # eager | compiled
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import (  # noqa: E402
    REPO,
    TRAINER_VARIANTS,
    S,
    make_data,
    memory_lines,
    plan_gib,
    trainer_flags,
)

ITERATIONS, LOG_INTERVAL = 3, 2
GIB = 2**30
NO_FRAME = "(no Python frame: autograd's backward or C++)"


def parse_run(text: str) -> tuple[str, int, int]:
    """``gpt-compile:8x16`` -> (variant, micro-batch size, micro-batches per step)."""
    variant, _, shape = text.partition(":")
    mbs, _, gas = shape.partition("x")
    if variant not in TRAINER_VARIANTS or not mbs.isdigit() or not gas.isdigit():
        raise argparse.ArgumentTypeError(f"{text}: want VARIANT:MxG, VARIANT one of {sorted(TRAINER_VARIANTS)}")
    return variant, int(mbs), int(gas)


def _label(frames: list[dict]) -> str:
    """The innermost opskit frame of an allocation's Python stack (innermost first), else DeepSpeed's, else any."""
    for part in ("/opskit/", "/deepspeed/", ""):
        for frame in frames:
            if part in frame["filename"]:
                name = frame["filename"].rsplit("/site-packages/", 1)[-1].rsplit("/opskit/", 1)[-1]
                return f"{name}:{frame['line']} {frame['name']}"
    return NO_FRAME


def _instruction(frames: list[dict]) -> str | None:
    """The DeepSpeed pipeline instruction (``_exec_*`` of its engine) a Python stack runs in, or None."""
    return next((f["name"] for f in frames if f["name"].startswith("_exec_")), None)


def _events(trace: list[dict]):
    """``(index, action, addr, size, instruction, micro_batch, frames)`` per alloc / free; ``instruction`` is the
    pipeline instruction in force (the last one seen, for events without a Python frame), ``micro_batch`` counts the
    forward passes so far (1-based; 0 before the first)."""
    instruction, micro_batch = "setup", 0
    for index, entry in enumerate(trace):
        frames = entry.get("frames") or []
        current = _instruction(frames)
        if current is not None:
            if current == "_exec_forward_pass" and instruction != current:
                micro_batch += 1
            instruction = current
        if entry["action"] in ("alloc", "free_requested"):
            yield index, entry["action"], entry["addr"], entry["size"], instruction, micro_batch, frames


def peak_breakdown(snapshot: dict, micro_batches_per_step: int, top: int = 30) -> dict:
    """What was allocated at the peak of a ``torch.cuda.memory._snapshot()`` taken with history from the process's
    first allocation: the replayed peak (GiB), the instruction and micro-batch running then, each instruction's
    highest allocation, and the live blocks grouped by (instruction and micro-batch that allocated them, innermost
    frame, block size), largest first."""
    trace = next(t for t in snapshot["device_traces"] if t)
    live: dict[int, int] = {}
    allocated = peak = 0
    peak_at = None
    highest: dict[str, float] = collections.defaultdict(float)
    for index, action, addr, size, instruction, micro_batch, _ in _events(trace):
        if action == "alloc":
            live[addr] = size
            allocated += size
        elif addr in live:
            allocated -= live.pop(addr)
        highest[instruction] = max(highest[instruction], allocated / GIB)
        if allocated > peak:
            peak, peak_at = allocated, (index, instruction, micro_batch)
    blocks: dict[int, tuple] = {}
    for index, action, addr, size, instruction, micro_batch, frames in _events(trace):
        if index > peak_at[0]:
            break
        if action == "alloc":
            blocks[addr] = (size, _when(instruction, micro_batch, micro_batches_per_step), _label(frames))
        else:
            blocks.pop(addr, None)
    groups: dict[tuple, list] = collections.defaultdict(lambda: [0, 0])
    by_when: dict[str, float] = collections.defaultdict(float)
    for size, when, label in blocks.values():
        groups[(when, label, size)][0] += size
        groups[(when, label, size)][1] += 1
        by_when[when] += size / GIB
    rows = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        "peak_gib_replayed": round(peak / GIB, 3), "events": len(trace),
        "at_peak": {"event": peak_at[0], "when": _when(peak_at[1], peak_at[2], micro_batches_per_step)},
        "highest_gib_by_instruction": {k: round(v, 3) for k, v in highest.items()},
        "live_gib_by_when": {k: round(v, 3) for k, v in sorted(by_when.items(), key=lambda kv: -kv[1])},
        "live_groups": [{"gib": round(total / GIB, 3), "count": count, "block_mib": round(size / 2**20, 2),
                         "when": when, "where": label} for (when, label, size), (total, count) in rows[:top]],
    }


def _when(instruction: str, micro_batch: int, per_step: int) -> str:
    """``"_exec_forward_pass it2 mb8/8"``: the instruction, iteration and micro-batch within it."""
    if micro_batch == 0:
        return instruction
    iteration, within = divmod(micro_batch - 1, per_step)
    return f"{instruction} it{iteration + 1} mb{within + 1}/{per_step}"


def child(snapshot_path: str, gas: int, argv: list[str]) -> int:
    """The trainer in this process (``opskit.train.main.main(argv)``), with its allocation history recorded when
    ``snapshot_path`` is given, and the peak's breakdown written there as JSON."""
    import torch

    if snapshot_path:
        torch.cuda.init()
        torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
    from opskit.train.main import main

    rc = main(argv)
    if snapshot_path:
        started = time.time()
        breakdown = peak_breakdown(torch.cuda.memory._snapshot(), gas)
        breakdown["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        breakdown["analysis_s"] = round(time.time() - started, 1)
        Path(snapshot_path).write_text(json.dumps(breakdown, indent=1))
    return rc


def run(variant: str, mbs: int, gas: int, data: Path, tokenizer: Path, snapshot: Path | None) -> dict:
    """One trainer run of 3 iterations; its peak (GiB) from the memory line, the plan's, and the breakdown."""
    extra = TRAINER_VARIANTS[variant]
    flags = trainer_flags(mbs, mbs * gas, ITERATIONS, data, tokenizer, extra, log_interval=LOG_INTERVAL)
    started = time.time()
    done = subprocess.run([sys.executable, __file__, "--child", str(snapshot or ""), str(gas), *flags],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    result = {"name": f"{variant}:{mbs}x{gas}", "seconds": round(time.time() - started, 1),
              "plan_mem_gb": round(plan_gib(mbs, gas, 1, extra), 2)}
    memory = next((r for r in memory_lines(done.stdout) if "max_reserved_mib" in r), None)
    if done.returncode != 0 or memory is None:
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
        return {**result, "error": f"exit {done.returncode}"}
    peak, max_reserved = memory["max_allocated_mib"] / 1024, memory["max_reserved_mib"] / 1024
    result.update(peak_mem_gb=round(peak, 2), max_reserved_gb=round(max_reserved, 2),
                  plan_over_peak=round(result["plan_mem_gb"] / peak - 1, 4))
    if snapshot is not None and snapshot.exists():
        result["breakdown"] = json.loads(snapshot.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="*", type=parse_run)
    parser.add_argument("--snapshot", nargs="*", type=parse_run, default=[], help="runs to record and break down")
    parser.add_argument("--lanes", type=int, default=1,
                        help="runs side by side on the GPU: lane k takes runs k, k + LANES, ... in turn")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    largest = max(mbs * gas for _, mbs, gas in opts.runs)
    results: list[dict] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as tmp:
        data, tokenizer = make_data(Path(tmp), tokens=(ITERATIONS + 2) * largest * (S + 1) * 2)

        def lane(names: list) -> None:
            for variant, mbs, gas in names:
                snapshot = Path(tmp) / f"{variant}-{mbs}x{gas}.json" if (variant, mbs, gas) in opts.snapshot else None
                result = run(variant, mbs, gas, data, tokenizer, snapshot)
                print(json.dumps({k: v for k, v in result.items() if k != "breakdown"}), flush=True)
                with lock:  # written after each run: a call stopped at its time limit keeps what finished
                    results.append(result)
                    if opts.out:
                        Path(opts.out).write_text(json.dumps(results, indent=1))

        with ThreadPoolExecutor(max_workers=opts.lanes) as pool:
            list(pool.map(lane, [opts.runs[k::opts.lanes] for k in range(opts.lanes)]))
    print("SUMMARY")
    for r in results:
        print(f"{r['name']:>18} peak {r.get('peak_mem_gb')} GiB, plan {r['plan_mem_gb']} GiB, "
              f"plan/peak-1 {r.get('plan_over_peak')}, {r['seconds']} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # one run, started by run(): --child SNAPSHOT_PATH_OR_EMPTY GAS TRAINER_FLAGS...
        sys.exit(child(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
    main()
