"""Divergence, the rules both sides share (issue 48): the trainer's check (:mod:`opskit.train.divergence`) and the
job that triages what it reports (:mod:`opskit.allocation.divergence`).

- When to act: a spike by :mod:`opskit.rules.spike_rule` that has not come back inside the band within ``patience``
  iterations, or a NaN/Inf at once (:meth:`SpikeWatch.unrecovered`).
- What the trainer reports: one JSON file per last-stage rank in the step's report folder
  (:data:`REPORT_DIR_ENV`), :func:`write_report` / :func:`read_reports`.
- How a replay is judged: :func:`reproduced`.
- How the job asks for a replay: ``--divergence-replay`` (:class:`Replay`).

Plain Python: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from opskit.fsutil import atomic_write_text, read_json
from opskit.rules.spike_rule import DEFAULT_CONFIG, SpikeConfig

ACTIONS = ("alert", "rollback")
"""``alert``: the trainer prints a warning line and trains on (the watchdog alerts on the log); ``rollback``: it stops
without saving and the job triages (replay, roll back and skip, or a strike for the node)."""

REPORT_DIR_ENV = "OPSKIT_DIVERGENCE_DIR"
"""The folder the job gives each step for the trainer's reports (unset: a trainer run by hand writes none)."""

DETECTED, REPLAYED, DIGEST = "detected", "replayed", "digest"
"""A report's ``event``: the check acted on a spike; a replay reached the spike's iteration (``reproduced`` says how
it came out); the data-parallel replicas' parameter digests differed (``odd``: this rank's replica is one that differs;
``agreed_at``: the last iteration they agreed at)."""


def spike_config(window: int, threshold: float) -> SpikeConfig:
    """The spike rule with the spec's ``watchdog.spike_window`` and ``spike_threshold`` (the watchdog's too); a window
    shorter than the default history needs that many values only."""
    return SpikeConfig(window=window, threshold=threshold, min_history=min(DEFAULT_CONFIG.min_history, window))


@dataclass(frozen=True)
class Replay:
    """What a replay checks: the ``metric`` value the spike had at its first ``iteration`` and the median before it.
    On the command line ``ITERATION:METRIC:VALUE:BASELINE`` (``--divergence-replay 105:lm_loss:9.87:5.12``)."""

    iteration: int
    metric: str
    value: float
    baseline: float

    def flag(self) -> str:
        return f"{self.iteration}:{self.metric}:{self.value!r}:{self.baseline!r}"

    @classmethod
    def parse(cls, text: str) -> Replay:
        """Raises:
            ValueError: not ``ITERATION:METRIC:VALUE:BASELINE`` with a positive iteration and a known metric.
        """
        parts = text.split(":")
        if len(parts) != 4 or not parts[0].isdigit() or int(parts[0]) < 1 or parts[1] not in DEFAULT_CONFIG.metrics:
            raise ValueError(f"expected ITERATION:METRIC:VALUE:BASELINE (metric {' or '.join(DEFAULT_CONFIG.metrics)}"
                             f"), got {text!r}")
        return cls(int(parts[0]), parts[1], float(parts[2]), float(parts[3]))


def reproduced(replay: Replay, value: float | None) -> bool:
    """Whether the replayed ``value`` at ``replay.iteration`` is the spike again: non-finite where the spike was
    non-finite, else nearer the spike's value than the median before it.

    The bound is the midpoint between the two: a spike stands ``threshold`` robust scales (6 by default, at least 6%
    of the median for the lm loss) above the median, while one iteration replayed from the same step on the same layout
    is bitwise the same on CPU and differs by GPU kernels' reduction order, orders of magnitude less (the GPU rows of
    bench/gpu_acceptance.py measure it). A metric the replay did not log (None) is no reproduction.
    """
    if value is None:
        return False
    if not math.isfinite(replay.value):
        return not math.isfinite(value)
    if not math.isfinite(value):
        return True
    return abs(value - replay.value) < abs(value - replay.baseline)


@dataclass(frozen=True)
class Report:
    """One rank's report of one event (spikes: the last stage's ranks and rank 0; digests: the odd replicas and rank
    0). ``metric``, ``first``, ``last``, ``peak``, ``value`` (at ``first``)
    and ``baseline`` describe the spike (``value`` is the replayed one in a replay's report); ``detected_at`` the
    iteration the check acted at; ``local_loss`` this rank's own lm loss at ``first`` before the data-parallel average
    (what names the replica that computed a transient spike)."""

    event: str
    metric: str
    first: int
    last: int
    detected_at: int
    peak: float
    value: float
    baseline: float
    rank: int
    node: str
    local_loss: float | None
    reproduced: bool | None = None
    time: float = 0.0
    odd: bool | None = None
    agreed_at: int | None = None

    @property
    def replay(self) -> Replay:
        return Replay(self.first, self.metric, self.value, self.baseline)


def write_report(folder: Path, report: Report) -> Path:
    """Write ``report`` atomically as ``<event>-<first>-rank<rank>.json`` in ``folder`` (made if missing); NaN and Inf
    as JSON's ``NaN``/``Infinity`` (Python reads them back)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{report.event}-{report.first}-rank{report.rank}.json"
    atomic_write_text(path, json.dumps(asdict(report)) + "\n")
    return path


def read_reports(folder: Path) -> list[Report]:
    """Every report in ``folder``, oldest event first; a file that is not a report (torn, foreign) is passed over."""
    reports = []
    for path in sorted(folder.glob("*-rank*.json")) if folder.is_dir() else []:
        try:
            reports.append(Report(**read_json(path)))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(reports, key=lambda r: (r.time, r.rank))
