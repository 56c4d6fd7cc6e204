"""Is the training running or scheduled? BigScience's slurm-status pulse, from one ``squeue`` call.

Lines keep BigScience's wording, which on-call people grep for: ``[%Y-%m-%d %H:%M:%S] PULSE: ...`` and
``***ALERT: NAME is not RUNNING or SCHEDULED! ...***`` (reference section 1.1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from opskit.slurm.client import QueueEntry, SchedulerUnreachable, squeue
from opskit.slurm.pending import HopelessWatch, PendingForever


@dataclass(frozen=True)
class Pulse:
    """The outcome of one check. ``alert`` is True when the job is neither running nor scheduled; ``unreachable``
    when SLURM did not answer (then nothing is known about the job, and no alert is raised)."""

    lines: list[str]
    alert: bool
    unreachable: bool = False


def _preamble(now: datetime) -> str:
    return f"[{now:%Y-%m-%d %H:%M:%S}] PULSE:"


def alert_line(job_name: str, now: datetime) -> str:
    """BigScience's ALERT line for a job that is neither running nor scheduled."""
    return f"{_preamble(now)} ***ALERT: {job_name} is not RUNNING or SCHEDULED! Alert the on-call person***"


def unreachable_line(job_name: str, error: Exception, now: datetime) -> str:
    """The PULSE line when SLURM did not answer: nothing is known, so no ALERT."""
    return f"{_preamble(now)} {job_name}: scheduler unreachable, job state unknown ({error})"


def describe(entry: QueueEntry, now: datetime) -> str:
    """One PULSE line for a queue entry of the watched job."""
    pre = _preamble(now)
    where = f"({entry.job_id} on '{entry.partition}' partition"
    if entry.state == "RUNNING":
        return f"{pre} {entry.name} is running for {entry.time_used} since {entry.start_time} {where} ({entry.reason})"
    if entry.state == "PENDING" and entry.start_time in ("N/A", "Unknown", ""):
        if entry.reason == "(JobArrayTaskLimit)":
            return (f"{pre} {entry.name} is waiting for the previous Job Array job to finish before scheduling a "
                    f"new one {where})")
        if entry.reason == "(Dependency)":
            return (f"{pre} {entry.name} is waiting for the previous job to finish before scheduling a new one "
                    f"using the dependency mechanism {where})")
        return f"{pre} {entry.name} is waiting to be scheduled {where})"
    if entry.state == "PENDING":
        start = datetime.strptime(entry.start_time, "%Y-%m-%dT%H:%M:%S")
        remaining = (start - now.replace(microsecond=0))
        return f"{pre} {entry.name} is scheduled to start in {remaining} (at {entry.start_time}) {where})"
    return f"{pre} {entry.name} is unknown - fix me: (at {entry.start_time}) {where}) ({entry.reason})"


def check(job_name: str, users: list[str] | None = None, now: datetime | None = None) -> Pulse:
    """PULSE lines for every queue entry named exactly ``job_name``, or the ALERT line when there is none: by name,
    as BigScience's slurm-status. ``opskit status`` looks at the run's jobs instead
    (:func:`opskit.monitor.watchdog.run_checks`, :func:`opskit.run.chain.run_jobs`)."""
    now = now or datetime.now()
    try:
        entries = [e for e in squeue(users) if e.name == job_name]
    except SchedulerUnreachable as e:
        return Pulse([unreachable_line(job_name, e, now)], alert=False, unreachable=True)
    return Pulse(pulse_lines(job_name, entries, now), alert=not entries)


def pulse_lines(job_name: str, entries: list[QueueEntry], now: datetime) -> list[str]:
    """One PULSE line per queue entry of ``job_name``, or the ALERT line when there is none."""
    return [describe(e, now) for e in entries] or [alert_line(job_name, now)]


def wait_until_gone(job_name: str, job_id: str, on_pulse, interval_s: float = 5.0, timeout_s: float | None = None,
                    sleep=None, watch: HopelessWatch | None = None) -> bool:
    """Poll until no queue entry of array/job ``job_id`` named ``job_name`` is left (the chain has ended).

    Args:
        on_pulse: called with a :class:`Pulse` whenever a task's state or pending reason changes.
        timeout_s: give up after this long.
        watch: says when a task is pending on a reason that never clears (default: a :class:`HopelessWatch`
            naming no spec).

    Returns:
        True when the chain ended, False on timeout.

    Raises:
        PendingForever: a task has been pending on such a reason for ``watch.grace_s`` (it is left queued).
    """
    sleep = sleep or time.sleep
    watch = watch or HopelessWatch()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    previous = None
    while deadline is None or time.monotonic() < deadline:
        try:
            entries = [e for e in squeue() if e.name == job_name and e.array_id == job_id]
        except SchedulerUnreachable:
            entries = None  # keep waiting: a slow controller is not an ended chain
        if entries == []:
            return True
        if entries:
            key = [(e.job_id, e.state, e.reason) for e in entries]
            if key != previous:
                now = datetime.now()
                on_pulse(Pulse([describe(e, now) for e in entries], alert=False))
                previous = key
            if stuck := watch.check(entries):
                raise PendingForever(stuck)
        sleep(interval_s)
    return False
