"""``opskit submit``: render a spec into its run directory and start the chained job array (SLURM or local)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import yaml

from opskit.fsutil import atomic_write_text
from opskit.runs import RunPaths
from opskit.slurm import client, local
from opskit.slurm.render import data_files, render_job, trainer_args, trainer_rejections
from opskit.spec import Spec, deepspeed_resume_problem, installed_deepspeed_version


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
    """The job would fail minutes later in the queue without its data: refuse now.

    Raises:
        SubmitError: the first missing file, with the command or step that makes it.
    """
    missing = [(field, path) for field, path in data_files(spec) if not path.is_file()]
    if not missing:
        return
    field, path = missing[0]
    if spec.data.prepared_by_opskit:
        raise SubmitError(f"{path} is missing: run `opskit data prepare {shlex.quote(spec.cli_name)}` first")
    how = _MAKES.get(field, "Megatron's tools/preprocess_data.py writes indexed datasets")
    raise SubmitError(f"{path} is missing ({field} of {spec.file or spec.name}): prepare it before submitting ({how})")


# What makes each kind of data file a spec may read (the hint of check_data's refusal).
_MAKES = {
    "data.train_weighted_split_paths_path": "BigScience wrote it with data/catalogue/load_ratios_meg_ds_format.py",
    "data.valid_weighted_split_paths_path": "BigScience wrote it with data/catalogue/load_ratios_meg_ds_format.py",
    "data.vocab_file": "GPT-2's gpt2-vocab.json",
    "data.merge_file": "GPT-2's gpt2-merges.txt",
    "data.tokenizer_name_or_path": "a tokenizer folder saved with transformers' save_pretrained",
}


def check_trainer(spec: Spec, run: RunPaths) -> None:
    """Refuse a job that opskit's trainer or this DeepSpeed would reject or could not resume.

    Raises:
        SubmitError: the trainer's flag problems (unknown flags, refused combinations), or the DeepSpeed version's.
    """
    where = spec.file or spec.name
    if problems := trainer_rejections(trainer_args(spec, run)):
        raise SubmitError(f"{where}: opskit's trainer would exit at once on this job: {'; '.join(problems)}; "
                          "remove those settings from the spec (megatron_args holds the verbatim flags)")
    version = spec.parallel.deepspeed_version or installed_deepspeed_version()
    if version and (problem := deepspeed_resume_problem(spec, version)):
        raise SubmitError(f"{where}: {problem} (or pin parallel.deepspeed_version to the cluster's)")


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
        SubmitError: missing data, a job the trainer would refuse, unknown executor. ``client.SlurmError`` when
            sbatch fails. ``SpecError`` for a ``$VAR`` of the spec that is not set here.
    """
    if executor not in ("slurm", "local"):
        raise SubmitError(f"--executor {executor}: expected 'slurm' or 'local'")
    check_data(spec)
    check_trainer(spec, RunPaths.of(spec))
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
