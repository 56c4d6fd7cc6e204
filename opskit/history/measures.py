"""What a run's own history says about its save interval: the measured mean time between failures, save cost and
iteration time, and the interval that loses the least (:mod:`opskit.rules.reliability`), next to the spec's.

From files the run already writes: the job script's ``[opskit] DATE TIME job J (array task T) nodes N: ...`` lines
(each task's first and last give its running time), Megatron's ``time (ms) | save-checkpoint: X`` lines (what a save
stopped training; BigScience's logs have them too), the iteration lines' ``elapsed time per iteration``, and the
ledger's task outcomes (``FAILED``, ``NODE_FAIL`` and ``TIMEOUT`` lose the work since the last save: failures).
The log is streamed once, line by line (:func:`opskit.history.goodput.read_task_logs`, the goodput account's reading);
it keeps a tuple per iteration line (100k lines, 38 MB of log: read in 0.9 s).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from opskit.history.goodput import RESTARTED, positive_seconds, read_task_logs
from opskit.logs.parse import LogFormatError, read_tail, timeline
from opskit.rules.reliability import lost_fraction, optimal_save_interval
from opskit.run import chain
from opskit.run.paths import RunPaths

RECENT_ITERATIONS = 100


@dataclass(frozen=True)
class SaveIntervalAdvice:
    """The run's measured figures and Young/Daly's interval (iterations), next to the spec's; None where the history
    holds no such figure (no failure yet, no save, no iteration). ``lost_*`` are shares of wall time (0.0115 is
    1.15%); ``notes`` say in one line each what could not be measured."""

    tasks: int
    hours_run: float
    failures: int
    mtbf_hours: float | None
    save_seconds: float | None
    iteration_seconds: float | None
    spec_interval: int | None
    optimal_interval: int | None
    lost_at_spec: float | None
    lost_at_optimal: float | None
    notes: list[str]

    def as_json(self) -> dict:
        return asdict(self)


def save_interval_advice(run: RunPaths, spec_interval: int | None,
                         ledger: list[chain.TaskOutcome] | None = None) -> SaveIntervalAdvice:
    """The :class:`SaveIntervalAdvice` of a run from its log and ``ledger`` (default: the run's, read here).

    Raises:
        ChainError: reading the ledger here, a line that is not a record (naming the file and line).
    """
    tasks = read_task_logs(run.main_log).tasks if run.main_log.exists() else []
    hours = sum((task.last_seen - task.start).total_seconds() for task in tasks) / 3600
    saves = [seconds for task in tasks for seconds in task.saves]
    ledger = chain.read_ledger(run) if ledger is None else ledger
    # a training step the job restarted inside its allocation lost its work as a failed task does
    failures = sum(row.state in chain.FAILURES for row in ledger) + sum(t.end_state == RESTARTED for t in tasks)
    iteration = _iteration_seconds(run.main_log)
    notes = []
    if not tasks:
        notes.append(f"{run.main_log}: no task of this run has started (no [opskit] job lines)")
    if not failures:
        notes.append(f"no failure in {hours:.1f} h of running: the mean time between failures is not known yet")
    if not saves:
        notes.append(f"{run.main_log}: no 'time (ms) | save-checkpoint' line: no save measured yet")
    if iteration is None:
        notes.append(f"{run.main_log}: no iteration line: the iteration time is not known yet")
    save_s = statistics.median(saves) if saves else None
    return advise(len({task.task for task in tasks}), hours, failures, save_s, iteration, spec_interval, notes)


def advise(tasks: int, hours: float, failures: int, save_s: float | None, iteration_s: float | None,
           spec_interval: int | None, notes: list[str] = ()) -> SaveIntervalAdvice:
    """The advice from measured figures (seconds; None: not measured): the MTBF (``hours`` of running over
    ``failures``), Young/Daly's interval in whole iterations (at least 1) and the share of wall time lost at it and
    at ``spec_interval``, where the MTBF, ``save_s`` and ``iteration_s`` all exist."""
    mtbf_s = hours * 3600 / failures if failures and hours > 0 else None
    save_s, iteration_s = (s if positive_seconds(s) else None for s in (save_s, iteration_s))
    optimal = lost_spec = lost_best = None
    if mtbf_s and save_s and iteration_s:
        optimal = max(round(optimal_save_interval(save_s, mtbf_s) / iteration_s), 1)
        lost_best = lost_fraction(optimal * iteration_s, save_s, mtbf_s)
        lost_spec = lost_fraction(spec_interval * iteration_s, save_s, mtbf_s) if spec_interval else None
    return SaveIntervalAdvice(tasks, round(hours, 2), failures, mtbf_s and round(mtbf_s / 3600, 2),
                              save_s and round(save_s, 2), iteration_s and round(iteration_s, 3), spec_interval,
                              optimal, lost_spec, lost_best, list(notes))


def _iteration_seconds(log: Path) -> float | None:
    """The median ``elapsed time per iteration`` of the last :data:`RECENT_ITERATIONS` iteration lines."""
    try:
        records = timeline(read_tail(log, RECENT_ITERATIONS).records)
    except (OSError, LogFormatError):
        return None
    times = [t for r in records if positive_seconds(t := r.get("elapsed_time_per_iteration_s"))]
    return statistics.median(times) if times else None
