"""``opskit submit``: render a spec into its run directory and start the chained job array (SLURM or local)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from opskit.ckpt.format.universal import Layout
from opskit.ckpt.reshape import resume_layout_note
from opskit.errors import OpskitError
from opskit.fsutil import append_lines, atomic_write_text
from opskit.history.goodput import read_task_logs
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client, local
from opskit.spec.schema import Spec, deepspeed_resume_problem
from opskit.submission.render import RenderedJob, data_files, render_job
from opskit.train import REQUIRED_MODULES


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
    warnings: list[str] = field(default_factory=list)
    """Dry run only: every problem a real submission would refuse (one line each; the script shows an unset
    ``$VAR`` as written)."""
    dry_run: bool = False

    def as_json(self) -> dict:
        """``opskit submit --json``: run directory, job script path and text, the sbatch (or bash) command, job id
        (None for a dry run, the local executor or a ``--keep`` skip), the job it waits for, each local task's exit
        code, notes, warnings and why nothing was submitted."""
        return {"dry_run": self.dry_run, "executor": self.executor, "run": str(self.run.root),
                "script_path": str(self.run.script), "script": self.script, "command": self.command,
                "job_id": self.job_id, "after": self.after, "skipped": self.skipped,
                "local_tasks": [asdict(task) for task in self.local_tasks], "notes": self.notes,
                "warnings": self.warnings}


def data_problems(spec: Spec) -> list[str]:
    """The job would fail minutes later in the queue without its data: each missing file, with the command or step
    that makes it (one line for data ``opskit data prepare`` builds). A path of an unsettled field (an unset
    ``$VAR``: :meth:`Spec.unsettled`) is not looked for."""
    missing = [(field, path) for field, path in data_files(spec) if not spec.unsettled(field) and not path.is_file()]
    if missing and spec.data.prepared_by_opskit:
        return [f"{missing[0][1]} is missing: run `opskit data prepare {shlex.quote(spec.cli_name)}` first"]
    return [f"{path} is missing ({field} of {spec.file or spec.name}): prepare it before submitting "
            f"({_MAKES.get(field, _MAKES['data.data_path'])})" for field, path in missing]


# What makes each kind of data file a spec may read (the hint of data_problems).
_MAKES = {
    "data.data_path": "Megatron's tools/preprocess_data.py writes indexed datasets",
    "data.train_weighted_split_paths_path": "BigScience wrote it with data/catalogue/load_ratios_meg_ds_format.py",
    "data.valid_weighted_split_paths_path": "BigScience wrote it with data/catalogue/load_ratios_meg_ds_format.py",
    "data.vocab_file": "GPT-2's gpt2-vocab.json",
    "data.merge_file": "GPT-2's gpt2-merges.txt",
    "data.tokenizer_name_or_path": "a tokenizer folder saved with transformers' save_pretrained",
}


def trainer_problems(spec: Spec, python: str = sys.executable) -> list[str]:
    """Why the job's trainer would not start or resume (the spec's flags are the trainer's: validated when read):
    the job's Python cannot import it (:func:`job_python_problem`), or the DeepSpeed version's problem with the spec's
    precision, ZeRO stage and pipeline; else nothing."""
    problems = [problem] if (problem := job_python_problem(python)) else []
    if problem := deepspeed_resume_problem(spec):
        problems.append(f"{spec.file or spec.name}: {problem} (or pin parallel.deepspeed_version to the cluster's)")
    return problems


# Run by the job's Python: the first module it cannot find, if any (find_spec imports no module but a parent package).
_FIND_MODULES = """import importlib.util, sys
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name)
    except ImportError:
        found = None
    if found is None:
        print(name)
        break
"""


def job_python_problem(python: str) -> str | None:
    """Why ``python`` (the job script's interpreter: this one, as rendered) cannot start the trainer, one line, or
    None: opskit's trainer package and each module it needs (:data:`opskit.train.REQUIRED_MODULES`) looked up by
    that Python in a subprocess (``importlib.util.find_spec``: nothing is imported, ~0.1 s). Without the check, a
    wheel installed without its ``train`` extra submits cleanly and every task fails at start."""
    try:
        done = subprocess.run([python, "-c", _FIND_MODULES, "opskit.train", *REQUIRED_MODULES], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the job's Python {python} does not run here ({e})"
    if done.returncode != 0:
        return f"the job's Python {python} exits {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
    if missing := done.stdout.strip():
        return (f"the job's Python {python} cannot import {missing}: every task would fail at start; pip install "
                "'opskit[train]' there (torch first: the README says which build)")
    return None


def check_resume_layout(spec: Spec, run: RunPaths) -> list[str]:
    """What the job does with the checkpoint it resumes from when that was saved on another TP x PP x DP layout
    than the spec's (a changed ``--nodes``, TP or PP): one note (:func:`opskit.ckpt.reshape.resume_layout_note`).

    Raises:
        ReshapeError: a layout change the trainer would refuse at start (e.g. TP of a ZeRO-0 step).
    """
    p = spec.parallel
    note = resume_layout_note(run.checkpoints, Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                      p.data_parallel_size))
    return [note] if note else []


def recovery_problems(spec: Spec, run: RunPaths, executor: str) -> list[str]:
    """In-job recovery settings that cannot work: under SLURM, more nodes with the spares than the partition has (the
    tasks would pend for ever); an in-job timeout no longer than the longest save in the run's log (the watchdog would
    stop every step that saves)."""
    problems = []
    s, nodes = spec.slurm, spec.parallel.nodes
    if executor == "slurm" and s.spare_nodes:
        try:
            have = len(client.partition_nodes(s.partition))
        except client.SlurmError:
            have = None  # the queue's own answer comes at sbatch
        if have is not None and have < nodes + s.spare_nodes:
            problems.append(f"slurm.spare_nodes {s.spare_nodes}: the job would ask for {nodes + s.spare_nodes} nodes "
                            f"(parallel.nodes {nodes} + spares) and partition {s.partition or '(all)'} has {have}")
    try:
        saves = [seconds for task in read_task_logs(run.main_log).tasks for seconds in task.saves]
    except OSError:
        saves = []
    timeout = spec.watchdog.in_job_timeout_s
    if saves and max(saves) >= timeout:
        problems.append(f"watchdog.in_job_timeout_mins: {timeout / 60:g} min is shorter than a save of this run "
                        f"({max(saves):.0f} s in {run.main_log}): the in-job watchdog would call it a hang; set "
                        f"it above {max(saves) / 60 * 1.5:.1f}")
    return problems


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


def check_flags(spec: Spec, run: RunPaths, yes: bool) -> tuple[dict[Path, str], list[str]]:
    """The flags that would make every task exit at start.

    Returns:
        (the finished and stopped flags ``yes`` removes -> what each means, the problems: the kill switch is on; a
        finished or stopped flag exists and ``yes`` is False).
    """
    name = shlex.quote(spec.cli_name)
    problems = []
    if run.kill_switch.exists():
        problems.append(f"the kill switch {run.kill_switch} is on, so every task would exit at start: "
                        f"`opskit kill-switch {name} off` first")
    removable = {}
    for flag, what in ((run.finished_flag, "the training finished"), (run.stopped_flag, "the chain was stopped")):
        if not flag.exists():
            continue
        if yes:
            removable[flag] = what
            continue
        hint = ("raise batch.train_samples to train further" if flag == run.finished_flag else
                "fix the cause (`opskit nodes list`, the ledger)")
        problems.append(f"{what} ({flag}: {chain.flag_text(flag)}); every task would exit at start: {hint}, then "
                        "submit again with --yes to remove the flag")
    return removable, problems


def submit(spec: Spec, array: int | None = None, executor: str = "slurm", dry_run: bool = False,
           on_local_task=None, after: str | None = None, begin: str | None = None, keep: int | None = None,
           yes: bool = False, on_written: Callable[[RunPaths], None] | None = None) -> Submission:
    """Render and submit ``array`` chained tasks (default: the spec's ``slurm.array``) after the run's running or
    pending jobs (:func:`chain.run_jobs`), so that two trainings of one run directory never overlap.

    The spec is rendered as :meth:`Spec.with_placeholders` (an unset ``$VAR`` stays literal in the script) and every
    check runs: missing data, what this DeepSpeed cannot resume, a ``paths.output`` opskit may not write, a
    checkpoint the spec's layout cannot load, a flag that would make every task exit, a bad ``bad-nodes.txt``. A dry
    run returns them as ``warnings`` with the script; a real submission refuses them all at once, before asking the
    queue, writing or submitting anything. Checks of a real path are skipped where an unset ``$VAR`` already explains
    it.

    Args:
        executor: ``slurm`` (sbatch) or ``local`` (bash, tasks run here one after another; returns when done).
        dry_run: check and render in memory, and return the script and command: nothing is written (not even the
            run directory) and nothing submitted.
        on_local_task: progress callback for the local executor, ``(task_id, job_id)``.
        on_written: called with the run once its directory is written, before anything runs or is submitted (the
            local executor returns only when its tasks are done: where they write is told first).
        after: a job id the new array must also wait for (``afterany``).
        begin: sbatch's ``--begin`` (``now+2hours``).
        keep: submit only when fewer than ``keep`` tasks of the spec are running or pending.
        yes: remove a finished or stopped flag left by an earlier chain.

    Raises:
        SubmitError: an unknown executor or a bad ``after`` (at once); else, not for a dry run, every problem above:
            one problem as its own line, more as ``cannot submit NAME: N problems`` and one line each.
            ``ChainError`` for an unknown ``slurm.group`` or a run directory no job comment can carry.
            ``client.SlurmError`` when squeue or sbatch fail.
    """
    if executor not in ("slurm", "local"):
        raise SubmitError(f"--executor {executor}: expected 'slurm' or 'local'")
    if after is not None and not re.fullmatch(r"\d+(_\d+)?", after):
        raise SubmitError(f"--after {after}: expected a SLURM job id such as 1234 or 1234_2")
    spec = spec.with_placeholders()
    run = RunPaths.of(spec)
    problems = [*data_problems(spec), *trainer_problems(spec)]
    notes: list[str] = []
    removable: dict[Path, str] = {}
    exclude: list[str] = []
    if not spec.unsettled("paths.output"):
        notes += _collect(problems, lambda: [note] if (note := chain.claim_run_dir(run, "submit", write=False)) else [])
        notes += _collect(problems, lambda: check_resume_layout(spec, run))
        removable, flag_problems = check_flags(spec, run, yes)
        problems += flag_problems
        problems += recovery_problems(spec, run, executor)
        if executor == "slurm":
            exclude = sorted(_collect(problems, lambda: list(chain.read_bad_nodes(run))))
    job = render_job(spec, run, exclude=exclude)
    problems = [*spec.problems, *problems]  # the unset variables are all known once the script is rendered
    if problems and not dry_run:
        raise SubmitError(problems[0] if len(problems) == 1 else
                          f"cannot submit {spec.name}: {len(problems)} problems" + "".join(f"\n  - {p}"
                                                                                          for p in problems))
    for flag, what in removable.items():
        if not dry_run:
            flag.unlink()
        notes.append(f"{'would remove' if dry_run else 'removed'} {flag} ({what}) as --yes asks")
    tasks = array or spec.slurm.array
    if executor == "local":
        submission = Submission(run, executor, ["bash", str(run.script)], job.script, notes=notes, warnings=problems,
                                dry_run=dry_run)
        if not dry_run:
            write_run(spec, run, job)
            if on_written:
                on_written(run)
            log_submission(run, "local", tasks)
            submission.local_tasks = local.run_array(
                run.script, spec.job_name, tasks, spec.slurm.time_minutes * 60, spec.slurm.signal_margin_secs,
                run.slurm_dir, on_start=on_local_task)
        return submission
    # A run directory still named by an unset $VAR has no jobs here (a real submission has refused it above).
    queue = None if spec.unsettled("paths.output") else _queue(spec, run, dry_run, notes)
    if keep is not None and queue is not None and queue.tasks >= keep:
        return Submission(run, executor, [], notes=notes, warnings=problems, dry_run=dry_run,
                          skipped=f"{queue.tasks} task(s) of {spec.job_name} running or pending (--keep {keep}): "
                                  "nothing submitted")
    last = queue.last_job if queue is not None else None
    waits = [job for job in (last, after) if job]
    if last:
        notes.append(f"{spec.job_name} already has {queue.tasks} task(s) running or pending (job {last}): the new "
                     f"array waits for them (--dependency=afterany:{last}), so two trainings never overlap")
    if exclude:
        notes.append(f"excluding bad node(s) {','.join(exclude)} ({run.bad_nodes}; `opskit nodes clear` when "
                     "repaired)")
    dependency = "afterany:" + ":".join(waits) if waits else None
    command = client.sbatch_command(run.script, array=tasks, dependency=dependency, begin=begin)
    submission = Submission(run, executor, command, job.script, after=last, notes=notes, warnings=problems,
                            dry_run=dry_run)
    if not dry_run:
        write_run(spec, run, job)
        if on_written:
            on_written(run)
        submission.job_id = client.sbatch(run.script, array=tasks, dependency=dependency, begin=begin)
        log_submission(run, submission.job_id, tasks)
    return submission


def log_submission(run: RunPaths, job_id: str, tasks: int) -> None:
    """``[opskit] DATE submitted job J (N tasks)`` in main_log.txt, where the job script's lines go: the goodput
    account's wall clock starts at a run's first one (opskit.history.goodput)."""
    run.logs.mkdir(parents=True, exist_ok=True)
    line = f"[opskit] {datetime.now():%Y-%m-%d %H:%M:%S} submitted job {job_id} ({tasks} tasks)"
    append_lines(run.main_log, [line])


def _collect(problems: list[str], check: Callable[[], list[str]]) -> list[str]:
    """``check()``'s notes; its refusal (an :class:`OpskitError`, one line) is appended to ``problems`` instead."""
    try:
        return check()
    except OpskitError as e:
        problems.append(str(e))
        return []


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
