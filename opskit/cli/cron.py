"""``opskit cron install|status|uninstall NAME``: the run's hourly status and sync, by crontab or SLURM."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors, print_lines

app = typer.Typer(help="Hourly `opskit status` (and sync) of a run: user crontab, or a self-resubmitting SLURM job.",
                  no_args_is_help=True)


@app.command("install")
@friendly_errors
def install(
    name: SpecName,
    sync_to: str = typer.Option(None, "--sync-to", help="Also `opskit sync all NAME --to URL` every hour."),
    via: str = typer.Option(None, "--via", help="crontab or slurm (default: crontab where it exists)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the crontab line, or the job script and the sbatch "
                                                         "command; write and submit nothing."),
    json_output: JsonOutput = False,
) -> None:
    """Install the hourly jobs (run from the current directory, where trainings/ is). JSON: dry_run, installed (the
    record: method, commands, crontab_line or job_name, script and job_ids), script and command (--dry-run)."""
    from opskit.spec.load import load_spec
    from opskit.upkeep import cron

    if dry_run:
        emit(cron.plan_install(load_spec(name), sync_to=sync_to, method=via), json_output, _render_plan)
    else:
        emit(cron.install(load_spec(name), sync_to=sync_to, method=via), json_output, _render_installed)


def _render_plan(plan) -> None:
    from opskit.submission.submit import format_command

    if plan.script is None:
        console.print(f"# would add to the crontab: {plan.installed.crontab_line}")
    else:
        console.print(plan.script, end="")
        console.print(f"# would write {plan.installed.script} and run: {format_command(plan.command)}")


def _render_installed(installed) -> None:
    if installed.method == "crontab":
        console.print(f"added to the crontab: {installed.crontab_line}")
    else:
        console.print(f"submitted {installed.job_name} (job {installed.job_ids[0]}): runs now, then resubmits "
                      f"itself every hour ({installed.script})")


@app.command("status")
@friendly_errors
def status(
    name: SpecName,
    json_output: JsonOutput = False,
) -> None:
    """Next run of the hourly jobs; exit 1 with a WARNING when the installed cron is gone."""
    from opskit.spec.load import load_spec
    from opskit.upkeep import cron

    result = cron.status(load_spec(name))
    emit(result, json_output, lambda status: print_lines(status.lines))
    if not result.ok:
        raise typer.Exit(1)


@app.command("uninstall")
@friendly_errors
def uninstall(
    name: SpecName,
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed; remove nothing."),
    json_output: JsonOutput = False,
) -> None:
    """Remove exactly what install added. JSON: ``{"dry_run", "removed": [what, ...]}``."""
    from opskit.spec.load import load_spec
    from opskit.upkeep import cron

    removed = cron.uninstall(load_spec(name), dry_run=dry_run)
    emit({"dry_run": dry_run, "removed": removed}, json_output,
         lambda done: print_lines(f"{'would remove' if dry_run else 'removed'} {item}" for item in removed))
