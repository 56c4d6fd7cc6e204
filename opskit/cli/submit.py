"""``opskit submit NAME``: render the spec's job and start its chained array (SLURM, or the local executor)."""

from __future__ import annotations

import typer

from opskit.cli._common import console, friendly_errors


@friendly_errors
def submit(
    name: str = typer.Argument(..., help="Spec name, unique prefix or YAML path."),
    array: int = typer.Option(None, "--array", min=1, help="Tasks in the chain (default: the spec's slurm.array)."),
    executor: str = typer.Option("slurm", "--executor", help="slurm (sbatch) or local (bash, here, one by one)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Render and print the script and command only."),
    wait: bool = typer.Option(False, "--wait", help="Stay until the whole chain has ended, printing PULSE lines."),
) -> None:
    """Render slurm_templates/ into the run directory and submit a chained job array (--array=1-N%1)."""
    from opskit import status
    from opskit.spec import load_spec
    from opskit.submit import format_command
    from opskit.submit import submit as submit_run

    spec = load_spec(name)

    def on_local_task(task_id: int, job_id: str) -> None:
        console.print(f"local executor: {spec.job_name} task {task_id} ({job_id}_{task_id}) starting")

    sub = submit_run(spec, array=array, executor=executor, dry_run=dry_run, on_local_task=on_local_task)
    if dry_run:
        console.print(sub.run.script.read_text(), markup=False)
        console.print(f"# would run: {format_command(sub.command)}", markup=False)
        return
    console.print(f"run directory {sub.run.root}")
    console.print(f"main log      {sub.run.main_log}")
    if executor == "local":
        for task in sub.local_tasks:
            console.print(f"task {task.task_id}: exit code {task.exit_code}{' (time limit)' if task.timed_out else ''}"
                          f", output {task.output}")
        if any(t.exit_code for t in sub.local_tasks):
            raise typer.Exit(1)
        return
    console.print(f"submitted {format_command(sub.command)} -> job {sub.job_id}")
    if wait:
        status.wait_until_gone(spec.job_name, sub.job_id,
                               lambda pulse: [console.print(line, markup=False) for line in pulse.lines])
        console.print(f"job {sub.job_id} has left the queue")
