"""``opskit submit``: render a spec into its run directory and start the chained job array (SLURM or local)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from opskit.fsutil import atomic_write_text
from opskit.runs import RunPaths, data_paths
from opskit.slurm import client, local
from opskit.slurm.render import render_job
from opskit.spec import Spec


class SubmitError(RuntimeError):
    """The run cannot be submitted (missing data, bad executor); one line with the next step."""


@dataclass
class Submission:
    run: RunPaths
    executor: str
    command: list[str]
    job_id: str | None = None
    local_tasks: list[local.LocalTask] = field(default_factory=list)


def check_data(spec: Spec) -> None:
    """The job would fail minutes later in the queue without its data: refuse now."""
    tokenizer_dir, data_prefix = data_paths(spec)
    missing = [p for p in (tokenizer_dir / "tokenizer.json", Path(f"{data_prefix}.bin"), Path(f"{data_prefix}.idx"))
               if not p.is_file()]
    if missing:
        raise SubmitError(f"{missing[0]} is missing: run `opskit data prepare {shlex.quote(spec.cli_name)}` first")


def render_run(spec: Spec) -> RunPaths:
    """Write the job script, DeepSpeed config and the resolved spec into the run directory (atomically)."""
    run = RunPaths.of(spec)
    for folder in (run.slurm_dir, run.logs, run.checkpoints, run.tensorboard):
        folder.mkdir(parents=True, exist_ok=True)
    job = render_job(spec, run)
    atomic_write_text(run.script, job.script, mode=0o755)
    atomic_write_text(run.ds_config, job.ds_config)
    atomic_write_text(run.resolved_spec, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return run


def submit(spec: Spec, array: int | None = None, executor: str = "slurm", dry_run: bool = False,
           on_local_task=None) -> Submission:
    """Render and submit ``array`` chained tasks (default: the spec's ``slurm.array``).

    Args:
        executor: ``slurm`` (sbatch) or ``local`` (bash, tasks run here one after another; returns when done).
        dry_run: render and return the command without running it.
        on_local_task: progress callback for the local executor, ``(task_id, job_id)``.

    Raises:
        SubmitError: missing data or unknown executor. ``client.SlurmError`` when sbatch fails.
    """
    if executor not in ("slurm", "local"):
        raise SubmitError(f"--executor {executor}: expected 'slurm' or 'local'")
    check_data(spec)
    tasks = array or spec.slurm.array
    run = render_run(spec)
    if executor == "local":
        submission = Submission(run, executor, ["bash", str(run.script)])
        if not dry_run:
            submission.local_tasks = local.run_array(
                run.script, spec.job_name, tasks, spec.slurm.time_minutes * 60, spec.slurm.signal_margin_secs,
                run.slurm_dir, on_start=on_local_task)
        return submission
    command = client.sbatch_command(run.script, array=tasks)
    submission = Submission(run, executor, command)
    if not dry_run:
        submission.job_id = client.sbatch(run.script, array=tasks)
    return submission


def format_command(command: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in command)
