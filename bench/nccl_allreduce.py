"""The tensor-parallel all-reduce alone: NCCL all-reduce time and bus bandwidth over a TP group of one host's GPUs,
at the message sizes of the layout benches (MBS 2 x seq 2048 x hidden 4096 in bf16 = 32 MiB), under NCCL's default
protocol choice and under each protocol forced (``NCCL_PROTO``), to tell a slow link from a slow protocol choice.

Usage (a host with 2+ GPUs)::

    python bench/nccl_allreduce.py --gpus 2 --out DIR

Bus bandwidth is NCCL-tests' definition for all-reduce: ``bytes / time * 2 (n - 1) / n``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIZES_MIB = (1, 8, 32, 128)


def worker(sizes: list[int], iters: int) -> None:
    """One rank of the torchrun job: time ``iters`` all-reduces per size after a warm-up; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rows = []
    for mib in sizes:
        x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
        bus = mib * 2**20 / (ms / 1e3) * 2 * (world - 1) / world / 1e9
        rows.append({"mib": mib, "ms": round(ms, 4), "bus_gb_s": round(bus, 1)})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def run(gpus: int, iters: int, env: dict[str, str]) -> list[dict]:
    """The worker under torchrun with ``env`` added; its rank-0 rows."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), __file__,
                           "--worker", "--iters", str(iters)], capture_output=True, text=True,
                          env=dict(os.environ, **env))
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"worker exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(list(SIZES_MIB), args.iters)
        return
    result = {name: run(args.gpus, args.iters, env) for name, env in (
        ("default", {}), ("Simple", {"NCCL_PROTO": "Simple"}), ("LL128", {"NCCL_PROTO": "LL128"}),
        ("LL", {"NCCL_PROTO": "LL"}))}
    text = json.dumps({"gpus": args.gpus, **result}, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nccl_allreduce.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
