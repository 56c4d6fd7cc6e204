"""Where the trainer makes its host wait for the GPU (issue 33): every synchronizing CUDA call (``.item()``, a
blocking copy, ...) counted by call site, per rank. Run the trainer through it under torchrun::

    torchrun --nproc_per_node 4 bench/sync_points.py --out DIR -- <python -m opskit.train flags>

Each rank writes ``DIR/syncs-rank-N.txt``: the call sites (the innermost frames outside torch) with how often each
synchronized, most frequent first. A site that fires once per micro-batch shows ``m * iterations`` times, one at
build time once: the per-micro-batch ones drain the GPU's queue, so the GPU waits for the host's next launches, and
TP ranks whose hosts resume at different times wait for each other in their all-reduces.

It uses ``torch.cuda.set_sync_debug_mode("warn")``: syncs made by explicit ``torch.cuda.synchronize()`` or
``Stream.synchronize()`` are not reported.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch

TORCH_FILES = os.sep + "torch" + os.sep


def _call_site(depth: int = 4) -> str:
    """The innermost ``depth`` frames outside torch, warnings and this file, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if TORCH_FILES not in f.filename and "warnings" not in f.filename and __file__ not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-depth:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("trainer_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.trainer_flags[1:] if args.trainer_flags[:1] == ["--"] else args.trainer_flags
    counts: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            counts[_call_site()] += 1

    def report() -> None:
        rank = os.environ.get("RANK", "0")
        lines = [f"{n:6d}  {site}" for site, n in counts.most_common()]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"syncs-rank-{rank}.txt").write_text("\n".join(lines) + "\n")

    warnings.simplefilter("always")
    warnings.showwarning = record
    atexit.register(report)
    if torch.cuda.is_available():  # on a CPU: the run, and an empty table
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["opskit.train", *flags]
    runpy.run_module("opskit.train", run_name="__main__")


if __name__ == "__main__":
    main()
