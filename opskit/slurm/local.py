"""The local executor: runs a rendered job script with bash, task after task, as SLURM would run an ``--array=1-N%1``.

For machines without SLURM (laptops, CI without root). It sets the SLURM variables the script reads, plus
``OPSKIT_LOCAL=1`` so the script launches torchrun directly instead of through ``srun``, and enforces the time limit the
way SLURM does: SIGUSR1 to the batch shell ``signal_margin`` seconds before the limit, SIGTERM at the limit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalTask:
    task_id: int
    exit_code: int
    timed_out: bool
    output: Path


def run_array(script: Path, job_name: str, tasks: int, time_limit_s: float, signal_margin_s: float,
              output_dir: Path, on_start=None) -> list[LocalTask]:
    """Run ``tasks`` array tasks of ``script`` one after another; stops early when a task fails.

    Args:
        on_start: optional ``on_start(task_id, job_id)`` callback, e.g. to print progress.

    Returns:
        One :class:`LocalTask` per task that ran.
    """
    job_id = f"local{os.getpid()}"
    results = []
    for task_id in range(1, tasks + 1):
        if on_start:
            on_start(task_id, job_id)
        result = _run_task(script, job_name, job_id, task_id, time_limit_s, signal_margin_s, output_dir)
        results.append(result)
        if result.exit_code != 0:
            break
    return results


def _run_task(script: Path, job_name: str, job_id: str, task_id: int, time_limit_s: float, signal_margin_s: float,
              output_dir: Path) -> LocalTask:
    env = dict(os.environ, OPSKIT_LOCAL="1", SLURM_JOB_ID=f"{job_id}_{task_id}", SLURM_ARRAY_JOB_ID=job_id,
               SLURM_ARRAY_TASK_ID=str(task_id), SLURM_JOB_NAME=job_name, SLURM_NNODES="1", SLURM_PROCID="0",
               SLURM_JOB_NODELIST=socket.gethostname())
    output = output_dir / f"{job_name}-{job_id}_{task_id}.out"
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output, "ab") as out:
        proc = subprocess.Popen(["bash", str(script)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        signalled, timed_out = False, False
        started = time.monotonic()
        while proc.poll() is None:
            elapsed = time.monotonic() - started
            if not signalled and elapsed >= time_limit_s - signal_margin_s:
                proc.send_signal(signal.SIGUSR1)  # only the batch shell, like --signal=B:USR1
                signalled = True
            if elapsed >= time_limit_s:
                os.killpg(proc.pid, signal.SIGTERM)
                timed_out = True
                proc.wait()
                break
            time.sleep(0.5)
    return LocalTask(task_id, proc.returncode, timed_out, output)
