"""``opskit ckpt list``: a checkpoint dir's steps (size, layout, dtype, complete or not, consumed samples and tokens,
which one ``latest`` names) and its universal folders with what each was converted from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.info import StepInfo, list_steps
from opskit.ckpt.format.layout import latest_state
from opskit.ckpt.format.universal import universal_folders


@dataclass(frozen=True)
class CheckpointListing:
    """What ``ckpt list`` shows of one checkpoint dir."""

    directory: Path
    latest: str | None
    """The step ``latest`` names, None when there is none or it is unusable (then :attr:`latest_problem` says why)."""
    latest_problem: str | None
    steps: list[StepInfo]
    """Every ``global_stepN``, ascending (:func:`opskit.ckpt.format.info.describe_step`)."""
    universal: dict[int, tuple[Path, dict | None]]
    """Iteration -> (``global_stepN_universal`` folder, its origin or None for an unmarked one)."""

    def as_json(self) -> dict:
        return {"dir": str(self.directory), "latest": self.latest, "latest_problem": self.latest_problem,
                "steps": [s.as_json() for s in self.steps],
                "universal": [{"step": step, "path": str(path), "origin": origin}
                              for step, (path, origin) in self.universal.items()]}


def list_checkpoint(directory: str | Path) -> CheckpointListing:
    """The :class:`CheckpointListing` of a run's checkpoint dir.

    Raises:
        CheckpointFormatError: when ``directory`` has no ``global_stepN`` folders.
    """
    directory = Path(directory)
    latest, steps = list_steps(directory)
    return CheckpointListing(directory, latest, latest_state(directory)[1], steps, universal_folders(directory))
