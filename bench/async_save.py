"""Background checkpoint saves (``--async-save``) against synchronous saves and no saves, side by side in one call.

The 1.3B GPT-2 of bench/trainer_throughput.py (bf16, ZeRO-1, one GPU), run three times as users run it
(``python -m opskit.train``), each ``3 x --save-interval`` iterations logged one by one:

- ``none``: no ``--save``;
- ``sync``: ``--save`` every ``--save-interval`` iterations, synchronous (every rank waits for its files);
- ``async``: the same with ``--async-save``.

Reported per run: the trainer's ``time (ms) | save-checkpoint`` lines (the time training stood still for each save;
the first background save also allocates its pinned host buffers), the ``save-checkpoint-background`` lines (copy to
written and agreed), the bytes of one step, and the seconds per iteration (global batch / the log's samples per
second) over iterations 2..N (``all``) and over the iterations after the first save (``steady``). Older steps are
deleted once ``latest`` has moved past them (a run keeps at most two steps on the disk).

Usage (GPU machine)::

    python bench/async_save.py --out $OUT [--mbs 8 --gas 8 --save-interval 10 --save-dir /tmp/async-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_throughput import S, make_data, trainer_flags  # noqa: E402

from opskit.ckpt.format.layout import read_latest, step_dirs  # noqa: E402
from opskit.logs.grammar import parse_iteration_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCKED = re.compile(r"^time \(ms\) \| save-checkpoint: ([\d.]+)$", re.M)
BACKGROUND = re.compile(r"^time \(ms\) \| save-checkpoint-background: ([\d.]+)$", re.M)
MODES = ("none", "sync", "async")


def prune_behind_latest(save: Path, stop: threading.Event) -> None:
    """Delete every ``global_stepN`` older than the one ``latest`` names, until ``stop``: the disk holds at most the
    step ``latest`` names and the one being written."""
    while not stop.wait(0.5):
        tag = read_latest(save)
        if tag is None:
            continue
        current = int(tag.removeprefix("global_step"))
        for iteration, folder in step_dirs(save).items():
            if iteration < current:
                shutil.rmtree(folder, ignore_errors=True)


def free_gb(folder: Path) -> float:
    return round(shutil.disk_usage(folder).free / 1e9, 1)


def run(mode: str, opts, data: Path, tokenizer: Path, save_root: Path) -> dict:
    """One trainer run of ``mode``; its save and iteration figures."""
    iters = 3 * opts.save_interval
    gbs = opts.mbs * opts.gas
    save = save_root / mode
    extra = []
    if mode != "none":
        extra = ["--save", str(save), "--save-interval", str(opts.save_interval)]
        extra += ["--async-save"] if mode == "async" else []
    free_before = free_gb(save_root)
    stop = threading.Event()
    pruner = threading.Thread(target=prune_behind_latest, args=(save, stop), daemon=True)
    pruner.start()
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "opskit.train",
                           *trainer_flags(opts.mbs, gbs, iters, data, tokenizer, extra, log_interval=1)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.time() - started
    stop.set()
    pruner.join()
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
        shutil.rmtree(save, ignore_errors=True)
        return {"mode": mode, "error": f"exit {done.returncode}", "blocked_ms": BLOCKED.findall(done.stdout),
                "background_ms": BACKGROUND.findall(done.stdout), "free_gb_after": free_gb(save_root)}
    seconds = {r["iteration"]: gbs / r["samples_per_second"]
               for line in done.stdout.splitlines() if (r := parse_iteration_line(line))}
    after_first_save = opts.save_interval + 2
    result = {
        "mode": mode, "iterations": iters, "gbs": gbs, "wall_s": round(wall, 1), "free_gb_before": free_before,
        "s_per_iter_all": round(statistics.mean(s for i, s in seconds.items() if i >= 2), 4),
        "s_per_iter_steady": round(statistics.mean(s for i, s in seconds.items() if i >= after_first_save), 4),
        "blocked_ms": [float(ms) for ms in BLOCKED.findall(done.stdout)],
        "background_ms": [float(ms) for ms in BACKGROUND.findall(done.stdout)],
    }
    if mode != "none":
        last = step_dirs(save)[max(step_dirs(save))]
        result["step_gb"] = round(sum(f.stat().st_size for f in last.iterdir()) / 1e9, 2)
        shutil.rmtree(save)
    return result


def compare(results: dict[str, dict]) -> dict:
    """The ratios the goals name: async's blocked time over sync's (steady: saves after the first), and each run's
    seconds per iteration over the run without saves."""
    none, sync, background = results["none"], results["sync"], results["async"]
    ratios = {
        "async_blocked_steady_over_sync": statistics.median(background["blocked_ms"][1:])
        / statistics.median(sync["blocked_ms"]),
        "async_blocked_first_over_sync": background["blocked_ms"][0] / statistics.median(sync["blocked_ms"]),
    }
    for mode in ("sync", "async"):
        for window in ("all", "steady"):
            ratios[f"{mode}_s_per_iter_{window}_over_none"] = \
                results[mode][f"s_per_iter_{window}"] / none[f"s_per_iter_{window}"]
    return {key: round(value, 4) for key, value in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--gas", type=int, default=8, help="micro-batches per iteration")
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--save-dir", default=None, help="where the steps go (default: a temporary folder)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", default=None, help="a folder for async_save.json")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_root = Path(opts.save_dir or tmp) / "async-save-bench"
        save_root.mkdir(parents=True, exist_ok=True)
        print(f"saving under {save_root} ({free_gb(save_root):.0f} GB free)", flush=True)
        data, tokenizer = make_data(Path(tmp), tokens=(3 * opts.save_interval + 5) * opts.mbs * opts.gas * (S + 1))
        results = {}
        for mode in opts.modes:
            results[mode] = run(mode, opts, data, tokenizer, save_root)
            print(json.dumps(results[mode]), flush=True)
    summary = {"runs": results}
    if set(results) == set(MODES) and not any("error" in r for r in results.values()):
        summary["ratios"] = compare(results)
        print("RATIOS", json.dumps(summary["ratios"]), flush=True)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "async_save.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
