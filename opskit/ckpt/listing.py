"""``opskit ckpt list`` and ``ckpt inspect``: a checkpoint dir's steps (size, layout, dtype, complete or not, consumed
samples and tokens, which one ``latest`` names) and its universal folders with what each was converted from; one
step's (or universal folder's) contents."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.info import StepInfo, inspect_step, list_steps
from opskit.ckpt.format.layout import latest_state, resolve_step_dir
from opskit.ckpt.format.universal import universal_folders, universal_origin


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


@dataclass(frozen=True)
class Inspection:
    """What ``ckpt inspect`` shows: a universal folder's origin, or a step's report
    (:func:`opskit.ckpt.format.info.inspect_step`)."""

    path: str
    universal: dict | None = None
    """The origin of a ``global_stepN_universal`` folder (:func:`opskit.ckpt.format.universal.universal_origin`)."""
    step: dict | None = None

    @property
    def usable(self) -> bool:
        """A universal folder, a complete step, or a weights-only backup's copy of one."""
        return self.step is None or self.step["complete"] or self.step["weights_only_backup"]

    def as_json(self) -> dict:
        return {"path": self.path, "universal": self.universal} if self.step is None else self.step


def inspect_checkpoint(path: str) -> Inspection:
    """The :class:`Inspection` of a universal folder, a ``global_stepN`` folder, or a checkpoint dir (its
    ``latest``).

    Raises:
        CheckpointFormatError: no such step, or no readable ``mp_rank_00_model_states.pt``.
    """
    if (origin := universal_origin(Path(path))) is not None:
        return Inspection(path, universal=origin)
    step = inspect_step(resolve_step_dir(path))
    return Inspection(step["path"], step=step)
