"""Wall time of a whole hourly ``opskit status NAME`` run (new process, one squeue call, main_log.txt already seen:
its offset saved) side by side with a bare ``squeue`` call and an empty Python start (issue 7: < 0.5 s).

The run directory holds a ~100 MB main_log.txt in tr11's format (bench/log_parse.py's generator) and a checkpoint;
a job of the run (the spec's name and the run's comment) sleeps in the local SLURM's queue meanwhile, so squeue has a
row to report.

    python bench/status_speed.py [--mb 100] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml
from log_parse import generate  # bench/ is on sys.path when run as a script

from opskit.run.chain import job_comment
from opskit.run.paths import RunPaths
from opskit.slurm.client import SQUEUE_FORMAT

REPO = Path(__file__).resolve().parents[1]
OPSKIT = [sys.executable, "-m", "opskit.cli.app"]


# As installed on a login node: bytecode cached (pip compiles it; PYTHONDONTWRITEBYTECODE=1 here would make every run
# compile opskit from source, ~60 ms).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False, env=ENV)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        name = f"opskit-bench-{uuid.uuid4().hex[:6]}"
        raw = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
        raw.update(name="bench")
        raw["paths"]["output"] = str(tmp / "run")
        raw["slurm"]["job_name"] = name
        spec = tmp / "bench.yaml"
        spec.write_text(yaml.safe_dump(raw))
        log = tmp / "run" / "logs" / "main_log.txt"
        log.parent.mkdir(parents=True)
        generate(log, int(args.mb * 1e6 / 180))
        (tmp / "run" / "checkpoints" / "global_step100").mkdir(parents=True)
        (tmp / "run" / "checkpoints" / "latest").write_text("global_step100")
        comment = job_comment(RunPaths((tmp / "run").resolve()))
        job = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--comment={comment}", "--time=10", "-o",
                              "/dev/null", "--wrap", "sleep 600"], capture_output=True, text=True,
                             check=True).stdout.strip()
        try:
            started = time.perf_counter()
            subprocess.run([*OPSKIT, "status", str(spec)], capture_output=True, check=False, env=ENV)
            first = time.perf_counter() - started
            rows = [("python -c pass", wall([sys.executable, "-c", "pass"], args.repeat)),
                    ("squeue (bare)", wall(["squeue", "-h", "-o", SQUEUE_FORMAT], args.repeat)),
                    ("opskit status NAME", wall([*OPSKIT, "status", str(spec)], args.repeat)),
                    ("opskit status NAME --json", wall([*OPSKIT, "status", str(spec), "--json"], args.repeat))]
        finally:
            subprocess.run(["scancel", job], capture_output=True, check=False)
        print(f"main_log.txt: {log.stat().st_size / 1e6:.0f} MB; first run (reads it all): {first:.2f} s; "
              f"then {args.repeat} runs each, new processes, on {os.cpu_count()} cores (load {os.getloadavg()[0]:.1f})")
        base = statistics.median(rows[1][1])
        print(f"{'command':28} {'median s':>9} {'min s':>7} {'x squeue':>9}")
        for label, times in rows:
            print(f"{label:28} {statistics.median(times):9.3f} {min(times):7.3f} "
                  f"{statistics.median(times) / base:9.1f}")


if __name__ == "__main__":
    main()
