"""``opskit submit NAME``: render the spec's job and start its chained array (SLURM, or the local executor)."""

from __future__ import annotations

import typer

from opskit.cli._common import SpecName, console, friendly_errors


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
) -> None:
    """Render slurm_templates/ into the run directory and submit a chained job array (--array=1-N%1) after the
    run's running or pending jobs."""
    from opskit.monitor.pulse import wait_until_gone
    from opskit.run.submit import format_command
    from opskit.run.submit import submit as submit_run
    from opskit.slurm.pending import HopelessWatch
    from opskit.spec.load import load_spec

    spec = load_spec(name, {"parallel": {"nodes": nodes}} if nodes else None)

    def on_local_task(task_id: int, job_id: str) -> None:
        console.print(f"local executor: {spec.job_name} task {task_id} ({job_id}_{task_id}) starting")

    def on_written(run) -> None:  # before the local executor's tasks run (it returns when they are done)
        console.print(f"run directory {run.root}")
        console.print(f"main log      {run.main_log}")

    sub = submit_run(spec, array=array, executor=executor, dry_run=dry_run, on_local_task=on_local_task,
                     after=after, begin=begin, keep=keep, yes=yes, on_written=on_written)
    if dry_run and sub.script:
        console.print(sub.script, end="")
    for note in sub.notes:
        console.print(f"{'# ' if dry_run else ''}note: {note}")
    if sub.skipped:
        console.print(sub.skipped)
        for warning in sub.warnings:
            console.print(f"# warning: {warning}")
        return
    if dry_run:
        console.print(f"# would run: {format_command(sub.command)}")
        for warning in sub.warnings:  # what a real submission refuses, all at once
            console.print(f"# warning: {warning}")
        return
    if executor == "local":
        for task in sub.local_tasks:
            console.print(f"task {task.task_id}: exit code {task.exit_code}{' (time limit)' if task.timed_out else ''}"
                          f", output {task.output}")
        if any(t.exit_code for t in sub.local_tasks):
            raise typer.Exit(1)
        return
    console.print(f"submitted {format_command(sub.command)} -> job {sub.job_id}")
    if wait:
        wait_until_gone(spec.job_name, sub.job_id,
                        lambda pulse: [console.print(line) for line in pulse.lines],
                        watch=HopelessWatch(spec.cli_name))
        console.print(f"job {sub.job_id} has left the queue")
