"""``opskit status NAME [--alert] [--ack] [--json] [--watch N] [--page]``: the hourly watchdog
(opskit.monitor.watchdog.status; with --alert or --page it refreshes the run's page, opskit.report).

Exit code: 0 ok (warnings included), 1 alert, 2 scheduler unreachable, a spec or alert setting error, or a channel that
failed to send.
"""

from __future__ import annotations

import typer

from opskit.cli._common import SpecName, console, emit, err_console, friendly_errors

_STYLE = {"ok": "green", "warn": "yellow", "alert": "bold red"}


@friendly_errors(exit_code=2)
def status(
    name: SpecName,
    alert: bool = typer.Option(False, "--alert", help="Send alerts (e-mail, webhook, command; once per change)."),
    ack: bool = typer.Option(False, "--ack", help="Silence the current alerts until something changes."),
    json_output: bool = typer.Option(False, "--json", help="Every finding as JSON."),
    watch: float = typer.Option(0, "--watch", min=0, help="Check again every N seconds (Ctrl-C stops)."),
    page: bool = typer.Option(False, "--page", help="Refresh the run's page (`opskit report`); on with --alert."),
) -> None:
    """Is the training running or scheduled, and healthy? PULSE / ALERT lines, then every finding: scheduler, log
    health, checkpoints, disk, progress. Exit 0 ok, 1 alert, 2 SLURM unreachable or a configuration/channel error."""
    from opskit.monitor import watchdog
    from opskit.spec.load import load_spec

    spec = load_spec(name)

    def check() -> watchdog.Status:
        found = watchdog.status(spec, alert, ack, goodput=json_output)
        if alert or page:
            from opskit.report.page import refresh_run_page

            if problem := refresh_run_page(name, found.report):
                err_console.print(f"warning: {problem}", markup=False)
        return found

    raise typer.Exit(watchdog.watch(check, watch, lambda found: _render(found, json_output)))


def _render(found, json_output: bool) -> int:
    """Print one :class:`opskit.monitor.watchdog.Status` and return its exit code."""
    report, outcome = found.report, found.alerts
    if report.state_error:  # the checks stand; only the next run rereads what this one read
        err_console.print(f"warning: watchdog state not saved: {report.state_error}")
    for failure in outcome.failures if outcome else ():
        err_console.print(f"error: alert not sent: {failure}")
    emit(found, json_output, _print_status)
    return found.exit_code


def _print_status(found) -> None:
    """One :class:`opskit.monitor.watchdog.Status` for a person: the pulse lines, the findings table, what was sent."""
    report, outcome = found.report, found.alerts
    for line in report.pulse_lines:
        console.print(line)
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{report.name} at {report.time:%Y-%m-%d %H:%M:%S}", title_justify="left")
    for column in ("severity", "check", "finding"):
        table.add_column(column, overflow="fold")
    for f in report.findings:
        # Text, not markup: a finding quotes log lines, whose "[default0]:" rich would take for a style tag.
        table.add_row(Text(f.severity, style=_STYLE[f.severity]), Text(f.key), Text(f.message))
    console.print(table, soft_wrap=False)
    if outcome:
        sent = ", ".join(f"{kind} via {channel}" for channel, kind in outcome.sent)
        console.print("alerts: " + ("acknowledged: silent until something changes" if outcome.acked else
                                    sent or ("silenced (--ack)" if outcome.silenced else "nothing new to send")))
