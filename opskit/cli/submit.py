"""``opskit submit NAME``: render the spec's job and start its chained array (SLURM, or the local executor)."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors, progress_console


@friendly_errors
def submit(
    name: SpecName,
    array: int = typer.Option(None, "--array", min=1, help="Tasks in the chain (default: the spec's slurm.array)."),
    after: str = typer.Option(None, "--after", help="Also wait for this job id (--dependency=afterany:JOBID)."),
    begin: str = typer.Option(None, "--begin", help="sbatch --begin, e.g. now+2hours (prefer the automatic "
                                                   "dependency: the scheduler ignores a --begin job until then)."),
    nodes: int = typer.Option(None, "--nodes", min=1, help="Override parallel.nodes (the spec is checked again)."),
    keep: int = typer.Option(None, "--keep", min=1, help="Submit only when fewer than K tasks are queued (cron)."),
    yes: bool = typer.Option(False, "--yes", help="Remove a finished or stopped flag left by an earlier chain."),
    executor: str = typer.Option("slurm", "--executor", help="slurm (sbatch) or local (bash, here, one by one)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the script and the sbatch command; write and submit "
                                                         "nothing."),
    wait: bool = typer.Option(False, "--wait", help="Stay until the whole chain has ended, printing PULSE lines."),
    json_output: JsonOutput = False,
) -> None:
    """Render slurm_templates/ into the run directory and submit a chained job array (--array=1-N%1) after the
    run's running or pending jobs. JSON (--json): what was submitted (or, --dry-run, would be): run, script, command,
    job_id, local task exit codes, notes, warnings; progress and --wait's PULSE lines go to stderr then."""
    from opskit.monitor.pulse import wait_until_gone
    from opskit.slurm.pending import HopelessWatch
    from opskit.spec.load import load_spec
    from opskit.submission.submit import submit as submit_run

    spec = load_spec(name, {"parallel": {"nodes": nodes}} if nodes else None)
    out = progress_console(json_output)

    def on_local_task(task_id: int, job_id: str) -> None:
        out.print(f"local executor: {spec.job_name} task {task_id} ({job_id}_{task_id}) starting")

    def on_written(run) -> None:  # before the local executor's tasks run (it returns when they are done)
        out.print(f"run directory {run.root}")
        out.print(f"main log      {run.main_log}")

    sub = submit_run(spec, array=array, executor=executor, dry_run=dry_run, on_local_task=on_local_task,
                     after=after, begin=begin, keep=keep, yes=yes, on_written=on_written)
    emit(sub, json_output, _render)
    if any(task.exit_code for task in sub.local_tasks):
        raise typer.Exit(1)
    if wait and sub.job_id:
        wait_until_gone(spec.job_name, sub.job_id, lambda pulse: [out.print(line) for line in pulse.lines],
                        watch=HopelessWatch(spec.cli_name))
        out.print(f"job {sub.job_id} has left the queue")


def _render(sub) -> None:
    """The dry run's script and command, or what was submitted; notes, and warnings as ``# warning:`` lines."""
    from opskit.submission.submit import format_command

    if sub.dry_run and sub.script:
        console.print(sub.script, end="")
    for note in sub.notes:
        console.print(f"{'# ' if sub.dry_run else ''}note: {note}")
    if sub.skipped or sub.dry_run:
        console.print(sub.skipped or f"# would run: {format_command(sub.command)}")
        for warning in sub.warnings:  # a dry run's: what a real submission refuses, all at once
            console.print(f"# warning: {warning}")
    elif sub.executor == "local":
        for task in sub.local_tasks:
            console.print(f"task {task.task_id}: exit code {task.exit_code}{' (time limit)' if task.timed_out else ''}"
                          f", output {task.output}")
    else:
        console.print(f"submitted {format_command(sub.command)} -> job {sub.job_id}")
