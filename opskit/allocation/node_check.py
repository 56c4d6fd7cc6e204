"""The per-node half of ``opskit preflight``: run once on every node (``srun --ntasks-per-node=1``), it writes
``<out>/<node>.json``: the devices it sees, a fixed GEMM timed on each (on a CPU node, the CPU), the free disk at the
run's checkpoint folder, GPU Xid lines of the kernel log where readable, and an all-reduce with each of its two
neighbours in the ring of the step's nodes (gloo on CPUs, NCCL on GPUs). ``opskit.allocation.preflight`` reads the files
and decides.

``python -m opskit.allocation.node_check OUT_DIR CHECKPOINT_DIR PORT [--gemm-only]``; the step's first node hosts the
rendezvous at PORT; ``--gemm-only`` times the GEMM alone (a node measured again).
Test-only (``OPSKIT_TEST_FAULT``, :mod:`opskit.train.fault`): ``slow_gemm:NODE[:factor=F]`` makes the node's GEMM F
(3) times slower, ``allreduce_fail:NODE`` makes its all-reduces fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from opskit.logs.crash import expand_nodelist
from opskit.train.fault import fault_here, node_name

GEMM_SIZE = {"cuda": 8192, "cpu": 512}
"""Square matrices multiplied (bf16 on a GPU, fp32 on a CPU): a few ms per product."""
GEMM_SECONDS = 1.0
"""Time each device spends multiplying (after one warm-up product), in ``GEMM_WINDOWS`` windows."""
GEMM_WINDOWS = 20
ALLREDUCE_TIMEOUT_S = 15
"""Seconds a pair waits for its other node (to connect, then in the all-reduce): a dead neighbour costs this, twice."""
XID = re.compile(r"NVRM: Xid \(.*")


def gemm_tflops(device: str) -> float:
    """TFLOP/s of square products on ``device`` (``cuda:N`` or ``cpu``), 2 n^3 FLOPs each: the best of
    ``GEMM_WINDOWS`` windows over ``GEMM_SECONDS`` (a node that shares its cores, or a GPU its clock, at some moment
    still shows what it can do; a slow one is slow in every window)."""
    import torch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    n = GEMM_SIZE[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up, and the kernels chosen
    fault = fault_here()
    factor = float(fault[1].get("factor", "3")) if fault and fault[0] == "slow_gemm" else 1.0
    best = 0.0
    for _ in range(GEMM_WINDOWS):
        products, started = 0, time.perf_counter()
        while time.perf_counter() - started < GEMM_SECONDS / GEMM_WINDOWS:
            c = a @ b
            products += 1
        c.sum().item()
        elapsed = time.perf_counter() - started
        if factor > 1:
            time.sleep(elapsed * (factor - 1))
        best = max(best, 2 * n**3 * products / (elapsed * factor) / 1e12)
    return best


def free_gb(folder: Path) -> float:
    """Free GB (1e9 bytes) on the file system of ``folder`` (or of its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free / 1e9


def xid_lines() -> list[str] | None:
    """GPU Xid lines of the kernel log, None when it cannot be read (dmesg restricted)."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [m.group(0)[:200] for m in XID.finditer(done.stdout)]


def allreduces(port: int) -> list[dict]:
    """This node's all-reduces with its two neighbours in the ring of the step's nodes (node i hosts the pair
    (i, i+1) at ``port + i``; with two nodes, one pair): one record per pair, ``{"peer", "ok", "seconds"|"error"}``.
    A node whose every pair fails, while other pairs succeed, is the broken one (``opskit.allocation.preflight``)."""
    rank = int(os.environ["SLURM_PROCID"])
    nodes = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])  # in srun's task order: node i is SLURM_PROCID i
    pairs = sorted({tuple(sorted((i, (i + 1) % len(nodes)))) for i in range(len(nodes))} - {(0, 0)})
    mine = [(a, b) for a, b in pairs if rank in (a, b)]
    results: dict[tuple[int, int], dict] = {}
    threads = [threading.Thread(target=lambda pair=pair: results.__setitem__(pair, _pair_allreduce(
        nodes, pair, rank, port))) for pair in mine]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [{"peer": nodes[b if a == rank else a], **results[(a, b)]} for a, b in mine]


def _pair_allreduce(nodes: list[str], pair: tuple[int, int], rank: int, port: int) -> dict:
    """One all-reduce of a 4 MiB tensor between the two nodes of ``pair`` (a process group of their own: a store on
    the pair's first node at ``port`` + its index), or the error."""
    import torch
    import torch.distributed as dist

    host = pair[0] if (pair[0] + 1) % len(nodes) == pair[1] else pair[1]  # the ring's "i" of (i, i+1)
    started = time.perf_counter()
    try:
        if (fault := fault_here()) and fault[0] == "allreduce_fail":
            raise RuntimeError("test fault: this node's network is down")
        timeout = timedelta(seconds=ALLREDUCE_TIMEOUT_S)
        store = dist.TCPStore(nodes[host], port + host, 2, rank == host, timeout=timeout)
        cuda = torch.cuda.is_available()
        me = 0 if rank == host else 1
        group = (dist.ProcessGroupNCCL(store, me, 2) if cuda else dist.ProcessGroupGloo(store, me, 2, timeout))
        tensor = torch.ones(1 << 20, device="cuda" if cuda else "cpu")
        group.allreduce([tensor]).wait()
        ok = float(tensor[0]) == 2
    except Exception as e:  # noqa: BLE001 - recorded: the preflight names the node, it does not crash
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return {"ok": ok, "seconds": round(time.perf_counter() - started, 3)}


def check(out: Path, checkpoints: Path, port: int, gemm_only: bool = False) -> dict:
    """This node's record (also written to ``out/<node>.json``); ``gemm_only``: the devices and the timed GEMM alone
    (a node measured again), no Xid lines nor all-reduces."""
    import torch

    # the CPUs SLURM gave this task, not the host's: nodes sharing a host would otherwise time each other
    torch.set_num_threads(int(os.environ.get("SLURM_CPUS_ON_NODE") or torch.get_num_threads()))
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    record = {"node": node_name(), "devices": len(devices) if devices != ["cpu"] else 0,
              "gemm_tflops": {d: round(gemm_tflops(d), 4) for d in devices},
              "free_gb": round(free_gb(checkpoints), 1), "xid": None if gemm_only else xid_lines(),
              "allreduce": [] if gemm_only else allreduces(port)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{record['node']}.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    record = check(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), gemm_only=sys.argv[4:] == ["--gemm-only"])
    sys.exit(0 if all(pair["ok"] for pair in record["allreduce"]) else 1)
