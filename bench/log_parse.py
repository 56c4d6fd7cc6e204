"""Parsing speed of ``opskit.logs.parse`` on a generated 1-million-line Megatron log, side by side with
``grep -c iteration`` and with the per-line parser (what ``read_from`` uses for reads under 16 MiB) on the same file
(issue 6: >= 500_000 lines/s). Both opskit paths' records are checked equal first. Also timed: the columnar reads
that ``opskit logs parse`` (``read_from(..., columnar=True)``, every field) and ``opskit logs plot`` / ``spikes``
(the same with ``fields=``) make since issue 19, whose common iteration lines stay polars columns (no dict each);
their iteration rows are checked to be as many as the records. End-to-end command times: bench/logs.py.

The log imitates tr11-176B-ml's main_log.txt (seed 004): ``[default7]:`` iteration lines in the 2022 format with
small noise, each followed by the ``time (ms)`` line Megatron's timers print (seed 003 shows it after the 13B's
line), a DeepSpeed ``step=`` line every 10 iterations, checkpoint save lines every 100, a validation block every
1000, a NCCL warning now and then; every 5000th iteration line is cut inside its lm loss value.

    python bench/log_parse.py [--lines 1000000] [--repeat 3] [--file /tmp/opskit-bench.log]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import time
from pathlib import Path

from opskit.logs import parse
from opskit.logs.parse import read_from

ITERATION = ("[default7]: iteration {it:8d}/  600000 | consumed samples: {samples:12d} | consumed tokens: {tokens:12d} "
             "| elapsed time per iteration (s): {t:.2f} | learning rate: {lr:.3E} | global batch size:  2048 | "
             "lm loss: {loss:.6E} | grad norm: {gn:.3f} | num zeros: 0.0 | number of skipped iterations:   0 | "
             "number of nan iterations:   0 | samples per second: {sps:.3f} | TFLOPs: {tflops:.2f} |")


def generate(path: Path, lines: int, seed: int = 0) -> int:
    """Write ``lines`` lines; returns how many are whole iteration lines."""
    rng = random.Random(seed)
    out, whole, it = [], 0, 12000
    while len(out) < lines:
        it += 1
        t = rng.gauss(105.5, 0.4)
        line = ITERATION.format(it=it, samples=it * 2048, tokens=it * 2048 * 2048, t=t, lr=6e-5 * (1 - it / 2e5),
                                loss=2.3 + rng.gauss(0, 0.02), gn=abs(rng.gauss(0.2, 0.03)), sps=2048 / t,
                                tflops=15640 / t)
        if it % 5000 == 0:
            line = line[:line.index("lm loss: ") + rng.randrange(10, 20)]  # cut inside a value
        else:
            whole += 1
        out += [line, "[default7]:time (ms)"]  # Megatron's timers.log after every iteration line (section 2.3)
        if it % 10 == 0:
            out.append(f"[default0]:[2022-04-12 10:{it % 60:02d}:00,{it % 1000:03d}] [INFO] [logging.py:68:log_dist] "
                       f"[Rank 0] step={it}, skipped=0, lr=[{6e-5:.6e}], mom=[(0.9, 0.95)]")
        if it % 100 == 0:
            out += [f"[default0]:saving checkpoint at iteration {it:7d} to /gpfsscratch/checkpoints/tr11-176B-ml",
                    f"[default0]:[2022-04-12 10:00:00,000] [INFO] [engine.py:3263:_save_zero_checkpoint] zero "
                    f"checkpoint saved /gpfsscratch/checkpoints/global_step{it}/bf16_zero_pp_rank_0_states.pt",
                    f"[default0]:  successfully saved checkpoint at iteration {it:7d} to /gpfsscratch/checkpoints",
                    "[default0]:time (ms) | save-checkpoint: 40123.45"]
        if it % 1000 == 0:
            text = f" validation loss at iteration {it} | lm loss value: 2.342049E+00 | lm loss PPL: 1.040253E+01 | "
            out += ["[default7]:" + "-" * (len(text) + 1), "[default7]:" + text, "[default7]:" + "-" * (len(text) + 1)]
        if rng.random() < 0.001:
            out.append("[default3]:NCCL WARN Call to ibv_reg_mr failed")
    path.write_text("\n".join(out[:lines]) + "\n")
    return whole


def per_line(path: Path) -> parse.LogChunk:
    """``read_from`` as it reads a small increment: line by line in Python, no polars (the side-by-side baseline)."""
    saved, parse._BULK_MIN = parse._BULK_MIN, float("inf")
    try:
        return read_from(path)
    finally:
        parse._BULK_MIN = saved


def best_of(repeat: int, run) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) over ``repeat`` runs; CPU time counts this process and its children
    (grep), so that other jobs on a shared machine weigh less on the figure."""
    walls, cpus = [], []
    for _ in range(repeat):
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu + after.ru_utime + after.ru_stime - children.ru_utime
                    - children.ru_stime)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--file", type=Path, default=Path("/tmp/opskit-bench.log"))
    args = parser.parse_args()
    whole = generate(args.file, args.lines)
    chunk = read_from(args.file)
    assert len(chunk.iterations) == whole, (len(chunk.iterations), whole)
    baseline = per_line(args.file)
    assert json.dumps([baseline.records, baseline.skipped]) == json.dumps([chunk.records, chunk.skipped])
    fields = ("lm_loss", "grad_norm", "consumed_tokens")  # what `opskit logs plot` / `spikes` read
    assert [r["lm_loss"] for r in read_from(args.file, fields=fields).iterations] == [r["lm_loss"] for r in
                                                                                   chunk.iterations]
    for columnar in (read_from(args.file, columnar=True), read_from(args.file, fields=fields, columnar=True)):
        rows = sum(table.height for table in columnar.tables) + len(columnar.iterations)
        assert (rows, columnar.skipped) == (whole, chunk.skipped), (rows, columnar.skipped)
    full = best_of(args.repeat, lambda: read_from(args.file))
    some = best_of(args.repeat, lambda: read_from(args.file, fields=fields))
    columns = best_of(args.repeat, lambda: read_from(args.file, columnar=True))
    some_columns = best_of(args.repeat, lambda: read_from(args.file, fields=fields, columnar=True))
    python = best_of(args.repeat, lambda: per_line(args.file))
    grep = best_of(args.repeat, lambda: subprocess.run(["grep", "-c", "iteration", str(args.file)], check=False,
                                                       capture_output=True))
    size_mb = args.file.stat().st_size / 1e6
    print(f"{args.lines:,} lines ({size_mb:.0f} MB, {whole:,} iteration records, {chunk.skipped} cut lines counted, "
          f"{len(chunk.records) - whole} validation records); best of {args.repeat}; load average before: "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'':52s} {'wall s':>7s} {'lines/s':>12s} {'CPU s':>7s} {'lines/CPU s':>12s} {'x grep':>7s}"
          f" {'x per-line':>10s}")
    for label, (wall, cpu) in ((f"opskit, fields={','.join(fields)}", some), ("opskit, every field", full),
                               ("opskit columnar, every field (logs parse)", columns),
                               ("opskit columnar, fields= (logs plot, spikes)", some_columns),
                               ("opskit, every field, per-line parser (baseline)", python),
                               ("grep -c iteration", grep)):
        print(f"{label:52s} {wall:7.3f} {args.lines / wall:12,.0f} {cpu:7.3f} {args.lines / cpu:12,.0f} "
              f"{wall / grep[0]:7.1f} {python[0] / wall:10.2f}")


if __name__ == "__main__":
    main()
