"""What the watchdog reports: :class:`Finding` (one fact, a stable key, a severity) and :class:`Report` (one run's
findings and PULSE lines). Apart from the checks that make them (:mod:`opskit.monitor.checks`), so that the alert
channels (:mod:`opskit.monitor.alerts`) and the CLI read them without the orchestrator."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

SEVERITIES = ("ok", "warn", "alert")


@dataclass(frozen=True)
class Finding:
    """One fact about the training. ``key`` is stable across runs (``log.hang``); ``data`` holds the numbers."""

    key: str
    severity: str
    message: str
    data: dict = field(default_factory=dict)

    @property
    def check(self) -> str:
        return self.key.split(".", 1)[0]


@dataclass
class Report:
    """Everything one run found. ``unknown``: findings keys (prefixes) that could not be checked this time (SLURM
    did not answer), so an alert on them is neither confirmed nor resolved."""

    name: str
    job_name: str
    time: datetime
    pulse_lines: list[str]
    findings: list[Finding]
    unreachable: bool = False
    unknown: tuple[str, ...] = ()
    main_log: Path | None = None
    run_missing: bool = False
    """The run directory does not exist here: nothing of the run could be seen (finding ``run.missing``)."""
    state_error: str | None = None
    """Why the watchdog state could not be saved (the next run reads the log again from where it last could)."""

    @property
    def severity(self) -> str:
        return max((f.severity for f in self.findings), key=SEVERITIES.index, default="ok")

    @property
    def alerts(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "alert"]

    @property
    def exit_code(self) -> int:
        """0 ok (warnings included), 1 alert, 2 scheduler unreachable or no run directory to look at."""
        return 2 if self.unreachable or self.run_missing else 1 if self.severity == "alert" else 0

    def as_json(self) -> dict:
        return {"name": self.name, "job_name": self.job_name, "time": self.time.isoformat(timespec="seconds"),
                "severity": self.severity, "alert": self.severity == "alert", "unreachable": self.unreachable,
                "exit_code": self.exit_code, "lines": self.pulse_lines, "findings": [asdict(f) for f in self.findings]}
