"""The hourly watchdog behind ``opskit status``, a pipeline: read the run once
(:func:`opskit.monitor.snapshot.read_snapshot`: squeue, the ledger, the new bytes of main_log.txt, the checkpoints,
the disk), run every check on it (:data:`opskit.monitor.checks.CHECKS`, pure), act on the findings
(:data:`opskit.monitor.actions.ACTIONS`: cancel a hung task, exclude a straggler's node), compute the next state
(:func:`next_state`) and save it, and return a :class:`~opskit.monitor.findings.Report`. :func:`status` adds what
``opskit status`` shows besides (the alerts sent, the goodput) as one :class:`Status`. No typer, rich, torch or numpy
here: it runs from cron on login nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

from opskit.fsutil import append_lines
from opskit.monitor.actions import ACTIONS
from opskit.monitor.checks import CHECKS
from opskit.monitor.findings import Finding, Report
from opskit.monitor.pulse import pulse_lines, unreachable_line
from opskit.monitor.snapshot import RunSnapshot, read_snapshot
from opskit.monitor.watch_state import WatchdogState, load_state, save_state
from opskit.run.paths import RunPaths
from opskit.spec.schema import Spec

if TYPE_CHECKING:
    from opskit.monitor.alerts import Outcome


def run_checks(spec: Spec, now: datetime | None = None, users: list[str] | None = None,
               persist: bool = True) -> Report:
    """Every check, once: read -> check -> act -> next state (saved) -> report; the PULSE lines appended to
    main_log.txt with ``watchdog.append_to_main_log``.

    Args:
        now: the check's time (default: now). users: whose jobs squeue lists (default: ``slurm.group``'s members).
        persist: False for a reader that is not the hourly watchdog (``opskit report``): the state, the PULSE lines
            and the actions' changes stay as they were, so the next check still sees what is new.

    Raises:
        ChainError: ``slurm.group`` names no usable Unix group; a bad-node list an action cannot write.
        ``SlurmError``: squeue failed otherwise.
    """
    now = now or datetime.now()
    run = RunPaths.of(spec)
    snap = read_snapshot(spec, load_state(run), now, users)
    findings = [finding for check in CHECKS for finding in check(snap, spec)]
    if not persist:
        return Report(spec.name, spec.job_name, now, _pulse(snap, spec), findings,
                      unreachable=snap.unreachable is not None, main_log=run.main_log,
                      run_missing=snap.run_missing is not None)
    for action in ACTIONS:  # the checks only looked; what the watchdog does happens here, once all are in
        findings = action(findings, snap, spec)
    state_error = save_state(run, next_state(snap, findings))
    pulse = _pulse(snap, spec)
    report = Report(spec.name, spec.job_name, now, pulse, findings, unreachable=snap.unreachable is not None,
                    unknown=("scheduler", "log.hang", "checkpoint.age") if snap.unreachable is not None else (),
                    main_log=run.main_log, run_missing=snap.run_missing is not None,
                    state_error=state_error)
    if spec.watchdog.append_to_main_log and run.main_log.parent.is_dir():
        append_lines(run.main_log, pulse)
    return report


def next_state(snap: RunSnapshot, findings: list[Finding]) -> WatchdogState:
    """The state the next check starts from: the snapshot's (log cursor, measured figures), when a task was last
    seen running, and the newest complete step the findings name."""
    state = snap.state
    return replace(state, last_running=snap.now.timestamp() if snap.running else state.last_running,
                   checkpoint=next((f.data["tag"] for f in findings if f.key == "checkpoint.age"), state.checkpoint))


def _pulse(snap: RunSnapshot, spec: Spec) -> list[str]:
    """BigScience's PULSE / ALERT lines: one per queued job, the ALERT when none; none for a finished run (neither
    running nor an alert); the unreachable line when SLURM did not answer."""
    if snap.unreachable is not None:
        return [unreachable_line(spec.job_name, snap.unreachable, snap.now)]
    if not snap.entries and snap.flags.finished is not None:
        return []
    return pulse_lines(spec.job_name, list(snap.entries), snap.now)


@dataclass
class Status:
    """What ``opskit status`` shows: the watchdog's :class:`Report`, what the alert channels were told (None without
    ``--alert`` / ``--ack``) and the run's goodput (:func:`opskit.history.goodput.summary`; None unless asked)."""

    report: Report
    alerts: Outcome | None = None
    goodput: dict | None = None

    @property
    def exit_code(self) -> int:
        """The report's (0 ok, 1 alert, 2 scheduler unreachable or no run directory); 2 when a channel failed."""
        return 2 if self.alerts and self.alerts.failures else self.report.exit_code

    def as_json(self) -> dict:
        """The report's JSON with the exit code, the alerts' outcome and the goodput (``opskit status --json``)."""
        return {**self.report.as_json(), "exit_code": self.exit_code,
                "alerts": self.alerts.as_json() if self.alerts else None, "goodput": self.goodput}


def status(spec: Spec, alert: bool = False, ack: bool = False, goodput: bool = False) -> Status:
    """Run the checks, then send the alerts (``alert``) or silence them (``ack``: :func:`opskit.monitor.alerts.notify`)
    and, with ``goodput``, account the run's wall clock (the log is read whole).

    Raises:
        as :func:`run_checks`; AlertConfigError: no alert channel, or a malformed setting (``alert``).
        OutputRefusedError: no run directory to keep the alert state in.
    """
    # Imported here: a plain hourly check needs neither the alert channels nor the goodput account (plotting's).
    from opskit.history.goodput import summary
    from opskit.monitor.alerts import notify

    report = run_checks(spec)
    run = RunPaths.of(spec)
    return Status(report, notify(report, spec.watchdog.alerts, run, spec.cli_name, ack=ack) if alert or ack else None,
                  summary(run, spec.watchdog) if goodput else None)


def watch(check: Callable[[], Status], interval_s: float, on_status: Callable[[Status], int],
          sleep=time.sleep) -> int:
    """``check()`` once, or with ``interval_s`` > 0 again every ``interval_s`` seconds until Ctrl-C
    (KeyboardInterrupt), handing each :class:`Status` to ``on_status``.

    Returns:
        what ``on_status`` returned last (``opskit status`` returns its exit code), 0 when interrupted before it.
    """
    code = 0
    try:
        while True:
            code = on_status(check())
            if not interval_s:
                return code
            sleep(interval_s)
    except KeyboardInterrupt:
        return code
