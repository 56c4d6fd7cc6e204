"""End-to-end time of ``opskit logs parse|plot|spikes`` and ``opskit status`` on a 1-million-line tr11-style
main_log.txt, each a new process as a user runs it, next to ``grep -c iteration`` on the same file in the same run
(issue 19, goal 5: parse >= 500,000 lines/s, plot and spikes <= 2 s, status <= 0.5 s).

The log (``generate``) imitates tr11-176B-ml's main_log.txt as ``srun ... | tee -a`` wrote it: ``[opskit]`` job
headers and the launcher's startup lines at each job start, ``[default7]:`` iteration lines in the 2022 format (real
values' shapes: lm loss around 2.2, lr 5.3E-05, GBS 2048 x seq 2048), each followed by the ``time (ms)`` line of
Megatron's timers, DeepSpeed ``[Rank 0] step=`` lines, checkpoint saves every 100 iterations, a validation block every
1000, NCCL warnings, iterations skipped by fp16 overflow (no ``lm loss`` field, as Megatron prints them), a NaN loss,
an unknown field now and then, lines cut inside a value or garbled by another rank, a byte that is not UTF-8, and a
restart: the chain resumes from the last checkpoint and iterations go back (a new segment).

    PYTHONPATH=. python bench/logs.py [--lines 1000000] [--rounds 5] [--file /tmp/opskit-logs-bench.txt]
        [--opskit /path/to/other/checkout]   # the same commands run from another checkout (e.g. the code before)
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ITERATION = ("[default7]: iteration {it:8d}/  115311 | consumed samples: {samples:12d} | consumed tokens: "
             "{tokens:12d} | elapsed time per iteration (s): {t:.2f} | learning rate: {lr:.3E} | global batch size: "
             " 2048 | {loss}grad norm: {gn:.3f} | num zeros: 0.0 | number of skipped iterations: {skip:3d} | number of "
             "nan iterations: {nan:3d} | samples per second: {sps:.3f} | TFLOPs: {tflops:.2f} |")
STARTUP = ["[opskit] 2022-04-12 {hour:02d}:00:02 job {job} (array task 1270_{task}) nodes jean-zay-iam[01-48]: start",
           "using world size: 384, data-parallel-size: 8, tensor-model-parallel size: 4, pipeline-model-parallel size: "
           "12",
           "[default0]:[2022-04-12 {hour:02d}:01:10,118] [INFO] [engine.py:1093:_configure_optimizer] Using "
           "DeepSpeed Optimizer param name adam as basic optimizer",
           "[default0]: > loading checkpoint from /gpfsscratch/rech/six/commun/checkpoints/tr11-176B-ml at iteration "
           "{it}",
           "[default0]:  successfully loaded checkpoint from /gpfsscratch/rech/six/commun/checkpoints/tr11-176B-ml at "
           "iteration {it}",
           "[default0]:[after model, optimizer, and learning rate scheduler are built] datetime: 2022-04-12 "
           "{hour:02d}:05:31 ",
           "[default7]:[Rank 380] (after {it1} iterations) memory (MB) | allocated: 29633.96 | max allocated: "
           "53466.13 | reserved: 61730.00 | max reserved: 61730.00"]


def generate(path: Path, lines: int, seed: int = 0) -> dict:
    """Write ``lines`` lines to ``path``; returns counts of what was written (``iterations``: whole iteration lines)."""
    rng = random.Random(seed)
    out: list[str] = []
    counts = dict.fromkeys(("iterations", "validation", "cut", "skipped", "restarts"), 0)
    it, job, restarted = 31000, 1274, False

    def start_job(at: int) -> None:
        nonlocal job
        job += 1
        out.extend(line.format(hour=job % 24, job=job, task=job - 1270, it=at, it1=at + 1) for line in STARTUP)

    start_job(it)
    while len(out) < lines:
        it += 1
        t = rng.gauss(105.8, 0.4)
        skip = 1 if rng.random() < 0.002 else 0
        loss = "" if skip else ("lm loss: nan | " if rng.random() < 1e-5 else
                                f"lm loss: {2.3 - it / 1e6 + rng.gauss(0, 0.015):.6E} | ")
        samples = it * 2048
        line = ITERATION.format(it=it, samples=samples, tokens=samples * 2048, t=t, lr=6e-5 * (1 - it / 4e5),
                                loss=loss, gn=abs(rng.gauss(0.22, 0.03)), skip=skip, nan=0, sps=2048 / t,
                                tflops=15640 / t)
        counts["skipped"] += skip
        if rng.random() < 2e-4:  # cut inside a value (the job was killed mid-write)
            line = line[:line.index("consumed tokens: ") + rng.randrange(18, 30)]
            counts["cut"] += 1
        elif rng.random() < 2e-4:  # another rank's output inside the line
            at = rng.randrange(60, len(line) - 40)
            line = line[:at] + "[default3]:NCCL WARN Call to ibv_reg_mr failed" + line[at:]
            counts["cut"] += 1
        elif rng.random() < 1e-4:  # a field this parser does not know (kept under "extra")
            line = line.replace("| num zeros:", "| moe loss: 1.250000E-02 | num zeros:")
            counts["iterations"] += 1
        else:
            counts["iterations"] += 1
        out += [line, "[default7]:time (ms)"]
        if it % 10 == 0:
            out.append(f"[default0]:[2022-04-12 10:{it % 60:02d}:00,{it % 1000:03d}] [INFO] [logging.py:68:log_dist] "
                       f"[Rank 0] step={it}, skipped=0, lr=[{6e-5:.6e}, {6e-5:.6e}], mom=[(0.9, 0.95), (0.9, 0.95)]")
        if it % 100 == 0:
            out += [f"[default0]:saving checkpoint at iteration {it:7d} to /gpfsscratch/rech/six/commun/checkpoints/"
                    "tr11-176B-ml",
                    "[default0]:[2022-04-12 10:00:00,000] [INFO] [engine.py:3263:_save_zero_checkpoint]"
                    f" zero checkpoint saved /gpfsscratch/checkpoints/global_step{it}/bf16_zero_pp_rank_0_mp_rank_00_"
                    "optim_states.pt", f"[default0]:  successfully saved checkpoint at iteration {it:7d} to "
                    "/gpfsscratch/rech/six/commun/checkpoints/tr11-176B-ml",
                    "[default0]:time (ms) | save-checkpoint: 40123.45"]
        if it % 1000 == 0:
            text = f" validation loss at iteration {it} | lm loss value: 2.342049E+00 | lm loss PPL: 1.040253E+01 | "
            out += ["[default7]:" + "-" * (len(text) + 1), "[default7]:" + text, "[default7]:" + "-" * (len(text) + 1)]
            counts["validation"] += 1
        if rng.random() < 0.001:
            out.append("[default3]:NCCL WARN Call to ibv_reg_mr failed")
        if rng.random() < 1e-5:
            out.append("[default5]:caf\udce9 au lait")  # a latin-1 byte: not UTF-8
        if not restarted and len(out) > lines // 2 and it % 100 == 37:  # killed, resumed from the last save
            restarted, it = True, it - 37
            counts["restarts"] += 1
            start_job(it)
    data = "\n".join(out[:lines]) + "\n"
    path.write_bytes(data.encode("utf-8", errors="surrogateescape"))
    return counts


def median_wall(cmd: list[str], rounds: int, env: dict, out: Path) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (user + system, all threads) of ``rounds`` runs of ``cmd``, a new
    process each, run in the checkout under test (``python -m`` puts the working folder first on sys.path), its
    standard output written to the file ``out`` as a user's ``> out`` would (read back by this process instead, the
    200 MB of a jsonl parse cost the command ~0.1 s on the 2-core development VM: 2.05 -> 1.93 s)."""
    times, cpus = [], []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        with out.open("wb") as stdout:
            done = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, env=env, check=False,
                                  cwd=env["PYTHONPATH"])
        times.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr.decode()[-2000:]}")
    return statistics.median(times), statistics.median(cpus)


def status_run(tmp: Path, log: Path) -> tuple[Path, Path]:
    """A spec whose run folder's main_log.txt is ``log`` (hard-linked) and a checkpoint; (spec, run folder)."""
    import yaml

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "opskit/spec/presets/tiny.yaml").read_text())
    raw.update(name="bench")
    raw["paths"]["output"] = str(tmp / "run")
    raw["slurm"]["job_name"] = f"opskit-bench-{uuid.uuid4().hex[:6]}"
    spec = tmp / "bench.yaml"
    spec.write_text(yaml.safe_dump(raw))
    main_log = tmp / "run" / "logs" / "main_log.txt"
    main_log.parent.mkdir(parents=True)
    os.link(log, main_log) if log.stat().st_dev == main_log.parent.stat().st_dev else main_log.write_bytes(
        log.read_bytes())
    (tmp / "run" / "checkpoints" / "global_step31000").mkdir(parents=True)
    (tmp / "run" / "checkpoints" / "latest").write_text("global_step31000")
    return spec, tmp / "run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--file", type=Path, default=Path("/tmp/opskit-logs-bench.txt"))
    parser.add_argument("--opskit", type=Path, default=Path(__file__).resolve().parents[1],
                        help="checkout whose code runs (PYTHONPATH)")
    parser.add_argument("--only", nargs="*", help="labels to run (grep, jsonl, csv, plot, spikes, status)")
    args = parser.parse_args()
    counts = generate(args.file, args.lines)
    # As installed: bytecode cached (PYTHONDONTWRITEBYTECODE=1 would compile opskit from source in every run).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(args.opskit.resolve()), COLUMNS="100")
    opskit = [sys.executable, "-m", "opskit.cli.app"]
    log = str(args.file)
    with tempfile.TemporaryDirectory() as tmp:
        spec, run = status_run(Path(tmp), args.file)
        plot, out = str(Path(tmp) / "loss.png"), Path(tmp) / "stdout"
        commands = {
            "grep": ["grep", "-c", "iteration", log],
            "jsonl": [*opskit, "logs", "parse", log, "--format", "jsonl"],
            "csv": [*opskit, "logs", "parse", log, "--format", "csv"],
            "plot": [*opskit, "logs", "plot", log, "--out", plot, "--force"],
            "spikes": [*opskit, "logs", "spikes", log],
            # status: a first run (no watchdog state: it reads what it needs of the log), then the hourly run
            "status": [*opskit, "status", str(spec), "--json"],
        }
        rows = []
        for label, cmd in commands.items():
            if args.only and label not in args.only and label != "grep":
                continue
            if label == "status":
                (run / "watchdog" / "state.json").unlink(missing_ok=True)
                median_wall(cmd, 1, env, out)  # warm the bytecode cache
                firsts = []
                for _ in range(args.rounds):
                    (run / "watchdog" / "state.json").unlink(missing_ok=True)
                    firsts.append(median_wall(cmd, 1, env, out))
                walls, cpus = zip(*firsts, strict=True)
                rows.append(("status (first run, no state)", statistics.median(walls), statistics.median(cpus)))
                rows.append(("status (hourly: state saved)", *median_wall(cmd, args.rounds, env, out)))
                continue
            median_wall(cmd, 1, env, out)  # warm: page cache, bytecode
            rows.append((label, *median_wall(cmd, args.rounds, env, out)))
            if label == "grep":
                grep = rows[-1][1]
    print(f"{args.lines:,} lines, {args.file.stat().st_size / 1e6:.0f} MB ({counts}); {args.opskit}; median of "
          f"{args.rounds} rounds; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'command':32} {'median s':>9} {'lines/s':>11} {'x grep':>7} {'CPU s':>7}")
    for label, seconds, cpu in rows:
        print(f"{label:32} {seconds:9.3f} {args.lines / seconds:11,.0f} {seconds / grep:7.1f} {cpu:7.3f}")


if __name__ == "__main__":
    main()
