"""``opskit submit``: render a spec into its run directory and start the chained job array (SLURM or local)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

import yaml

from opskit.errors import OpskitError
from opskit.fsutil import atomic_write_text
from opskit.runs import RunPaths
from opskit.slurm import chain, client, local
from opskit.slurm.render import RenderedJob, data_files, render_job
from opskit.spec import Spec, deepspeed_resume_problem


class SubmitError(OpskitError, RuntimeError):
    """The run cannot be submitted (missing data, bad executor); one line with the next step."""


@dataclass
class Submission:
    """What ``submit`` did (or, with ``dry_run``, would do). ``command`` is empty when ``--keep`` found the chain
    stocked (``skipped`` says why)."""

    run: RunPaths
    executor: str
    command: list[str]
    script: str = ""
    """The rendered job script (written to ``run.script`` unless ``dry_run``)."""
    job_id: str | None = None
    local_tasks: list[local.LocalTask] = field(default_factory=list)
    after: str | None = None
    """The spec's running or pending job (array) the new one waits for (``--dependency=afterany:ID``)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know: the chaining, excluded nodes, flags removed with ``--yes``."""
    skipped: str | None = None


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


def check_trainer(spec: Spec) -> None:
    """Refuse a job this DeepSpeed could not resume (the spec's flags are the trainer's: validated when read).

    Raises:
        SubmitError: the DeepSpeed version's problem with the spec's precision, ZeRO stage and pipeline.
    """
    where = spec.file or spec.name
    if problem := deepspeed_resume_problem(spec):
        raise SubmitError(f"{where}: {problem} (or pin parallel.deepspeed_version to the cluster's)")


def check_resume_layout(spec: Spec, run: RunPaths) -> list[str]:
    """What the job does with the checkpoint it resumes from when that was saved on another TP x PP x DP layout
    than the spec's (a changed ``--nodes``, TP or PP): one note (:func:`opskit.ckpt.reshape.resume_layout_note`).

    Raises:
        ReshapeError: a layout change the trainer would refuse at start (e.g. TP of a ZeRO-0 step).
    """
    from opskit.ckpt.reshape import Layout, resume_layout_note

    p = spec.parallel
    note = resume_layout_note(run.checkpoints, Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                      p.data_parallel_size))
    return [note] if note else []


def write_run(spec: Spec, run: RunPaths, job: RenderedJob) -> None:
    """Create (and mark) the run directory, then write the job script, DeepSpeed config and the resolved spec into
    it (atomically).

    Raises:
        OutputRefusedError: ``paths.output`` is a file or a folder opskit did not write (:func:`chain.claim_run_dir`).
    """
    chain.claim_run_dir(run, "submit")
    for folder in (run.slurm_dir, run.logs, run.checkpoints, run.tensorboard):
        folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.script, job.script, mode=0o755)
    atomic_write_text(run.ds_config, job.ds_config)
    atomic_write_text(run.resolved_spec, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))


def check_flags(spec: Spec, run: RunPaths, yes: bool, dry_run: bool) -> list[str]:
    """Refuse a chain whose tasks would exit at start; with ``yes``, remove the finished and stopped flags.

    Returns:
        notes on the flags removed (or that ``dry_run`` would remove).

    Raises:
        SubmitError: the kill switch is on; the finished or stopped flag exists and ``yes`` is False.
    """
    name = shlex.quote(spec.cli_name)
    if run.kill_switch.exists():
        raise SubmitError(f"the kill switch {run.kill_switch} is on, so every task would exit at start: "
                          f"`opskit kill-switch {name} off` first")
    notes = []
    for flag, what in ((run.finished_flag, "the training finished"), (run.stopped_flag, "the chain was stopped")):
        if not flag.exists():
            continue
        if not yes:
            hint = ("raise batch.train_samples to train further" if flag == run.finished_flag else
                    "fix the cause (`opskit nodes list`, the ledger)")
            raise SubmitError(f"{what} ({flag}: {chain.flag_text(flag)}); every task would exit at start: {hint}, "
                              "then submit again with --yes to remove the flag")
        if not dry_run:
            flag.unlink()
        notes.append(f"{'would remove' if dry_run else 'removed'} {flag} ({what}) as --yes asks")
    return notes


def submit(spec: Spec, array: int | None = None, executor: str = "slurm", dry_run: bool = False,
           on_local_task=None, after: str | None = None, begin: str | None = None, keep: int | None = None,
           yes: bool = False) -> Submission:
    """Render and submit ``array`` chained tasks (default: the spec's ``slurm.array``) after the run's running or
    pending jobs (:func:`chain.run_jobs`), so that two trainings of one run directory never overlap.

    Args:
        executor: ``slurm`` (sbatch) or ``local`` (bash, tasks run here one after another; returns when done).
        dry_run: check and render in memory, and return the script and command: nothing is written (not even the
            run directory) and nothing submitted.
        on_local_task: progress callback for the local executor, ``(task_id, job_id)``.
        after: a job id the new array must also wait for (``afterany``).
        begin: sbatch's ``--begin`` (``now+2hours``).
        keep: submit only when fewer than ``keep`` tasks of the spec are running or pending.
        yes: remove a finished or stopped flag left by an earlier chain.

    Raises:
        SubmitError: missing data, a job the trainer would refuse, a flag that would make every task exit, an
            unknown executor. ``ReshapeError``: the checkpoint to resume from cannot be loaded on the spec's layout
            (:func:`check_resume_layout`). ``OutputRefusedError``: ``paths.output`` is not opskit's
            (:func:`chain.claim_run_dir`). ``ChainError`` for an unknown ``slurm.group`` or a bad
            ``bad-nodes.txt``. ``client.SlurmError`` when squeue or sbatch fail. ``SpecError`` for an unset ``$VAR``
            of the spec.
    """
    if executor not in ("slurm", "local"):
        raise SubmitError(f"--executor {executor}: expected 'slurm' or 'local'")
    if after is not None and not re.fullmatch(r"\d+(_\d+)?", after):
        raise SubmitError(f"--after {after}: expected a SLURM job id such as 1234 or 1234_2")
    check_data(spec)
    run = RunPaths.of(spec)
    check_trainer(spec)
    notes = [note] if (note := chain.claim_run_dir(run, "submit", write=False)) else []
    notes += check_resume_layout(spec, run)
    notes += check_flags(spec, run, yes, dry_run)
    tasks = array or spec.slurm.array
    if executor == "local":
        job = render_job(spec, run)
        submission = Submission(run, executor, ["bash", str(run.script)], job.script, notes=notes)
        if not dry_run:
            write_run(spec, run, job)
            submission.local_tasks = local.run_array(
                run.script, spec.job_name, tasks, spec.slurm.time_minutes * 60, spec.slurm.signal_margin_secs,
                run.slurm_dir, on_start=on_local_task)
        return submission
    queue = _queue(spec, run, dry_run, notes)
    if keep is not None and queue is not None and queue.tasks >= keep:
        return Submission(run, executor, [], notes=notes,
                          skipped=f"{queue.tasks} task(s) of {spec.job_name} running or pending (--keep {keep}): "
                                  "nothing submitted")
    last = queue.last_job if queue is not None else None
    waits = [job for job in (last, after) if job]
    if last:
        notes.append(f"{spec.job_name} already has {queue.tasks} task(s) running or pending (job {last}): the new "
                     f"array waits for them (--dependency=afterany:{last}), so two trainings never overlap")
    exclude = sorted(chain.read_bad_nodes(run))
    if exclude:
        notes.append(f"excluding bad node(s) {','.join(exclude)} ({run.bad_nodes}; `opskit nodes clear` when "
                     "repaired)")
    job = render_job(spec, run, exclude=exclude)
    dependency = "afterany:" + ":".join(waits) if waits else None
    command = client.sbatch_command(run.script, array=tasks, dependency=dependency, begin=begin)
    submission = Submission(run, executor, command, job.script, after=last, notes=notes)
    if not dry_run:
        write_run(spec, run, job)
        submission.job_id = client.sbatch(run.script, array=tasks, dependency=dependency, begin=begin)
    return submission


def _queue(spec: Spec, run: RunPaths, dry_run: bool, notes: list[str]) -> chain.Queue | None:
    """The run's running and pending jobs (one squeue call, for the users of ``slurm.group`` when set). A dry run
    goes on without SLURM, with a note; a real submission does not."""
    try:
        return chain.run_queue(run, spec.job_name, spec.slurm.group)
    except client.SchedulerUnreachable as e:
        if not dry_run:
            raise
        notes.append(f"SLURM did not answer, so the dependency on running jobs is unknown ({e})")
        return None


def format_command(command: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in command)
