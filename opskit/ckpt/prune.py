"""``opskit ckpt prune`` and ``opskit ckpt set-latest``: delete checkpoint steps by keep-rules, move ``latest``.

Keep-rules (a step is kept if any rule keeps it):

- ``last:K``: the K highest steps;
- ``every:N``: steps divisible by N;
- ``steps:100,250``: these steps;
- ``schedule:1-100/10,101-1000/18,1001-/1500``: a save schedule as ranges with their save intervals (a step in
  ``START-END`` is kept when divisible by the interval; Megatron saves when ``iteration % save_interval == 0``).
  ``schedule:tr1-13B`` is the 13B interpretability schedule of the seeds (every 10 steps up to 100, every 18 up to
  1000, then every 1500).

Rules count complete steps only (:func:`opskit.ckpt.format.info.describe_step`): ``last:2`` keeps the two newest steps a
resume can read, however many broken ones lie between. Never deleted (even with ``force``): the step ``latest``
points to, the newest complete step, and an incomplete step newer than every complete one (a save in progress?);
unless ``force``, a step that no backup able to resume it still holds (a ``--with-optim`` backup, checked at the
target: :func:`opskit.ckpt.backup.backup_problem`; a weights-only backup serves convert/inspect, not a resume). With
``force`` such a step is deleted and named in ``PrunePlan.unbacked`` (the CLI warns, one line per step).
A deleted step is first renamed to a hidden name, then removed, so no reader ever sees a half-deleted
``global_stepN``; a step that is a symbolic link (opskit's trainer never writes one) refuses the whole prune. A deleted
step's universal form (``global_stepN_universal``, :mod:`opskit.ckpt.reshape`) goes with it when opskit's marker says
opskit converted it from that step; any other folder of that name is left alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.backup import BackupError, backup_problem
from opskit.ckpt.format.info import describe_step
from opskit.ckpt.format.layout import existing_checkpoint_dir, latest_state, read_latest, step_dirs, write_latest
from opskit.ckpt.format.universal import universal_folders
from opskit.errors import OpskitError

NAMED_SCHEDULES = {"tr1-13B": "1-100/10,101-1000/18,1001-/1500"}


class PruneError(OpskitError, ValueError):
    """A bad keep-rule, or a step that cannot become ``latest``; one line."""


@dataclass(frozen=True)
class KeepRule:
    """One parsed ``--keep`` value; ``text`` is how the user wrote it (used as the reason a step is kept)."""

    text: str
    kind: str
    numbers: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int | None, int], ...] = ()

    def keeps(self, steps: list[int]) -> set[int]:
        if self.kind == "last":
            return set(sorted(steps)[-self.numbers[0]:]) if self.numbers[0] else set()
        if self.kind == "every":
            return {s for s in steps if s % self.numbers[0] == 0}
        if self.kind == "steps":
            return set(self.numbers) & set(steps)
        return {s for s in steps for start, end, every in self.ranges
                if start <= s and (end is None or s <= end) and s % every == 0}


def parse_keep(text: str) -> KeepRule:
    """Parse one keep-rule (module docstring).

    Raises:
        PruneError: naming the rule and the expected forms.
    """
    kind, _, value = text.partition(":")
    bad = PruneError(f"--keep {text!r}: expected last:K, every:N, steps:N[,N...] or "
                     f"schedule:START-END/EVERY[,START-/EVERY...] (or schedule:{'|'.join(NAMED_SCHEDULES)})")
    try:
        if kind in ("last", "every"):
            number = int(value)
            if number < (0 if kind == "last" else 1):
                raise ValueError
            return KeepRule(text, kind, (number,))
        if kind == "steps":
            return KeepRule(text, kind, tuple(int(v) for v in value.split(",")))
        if kind == "schedule":
            ranges = []
            for part in NAMED_SCHEDULES.get(value, value).split(","):
                span, every = part.split("/")
                start, end = span.split("-")
                ranges.append((int(start), int(end) if end else None, int(every)))
                if int(every) < 1:
                    raise ValueError
                if end and int(end) < int(start):
                    raise PruneError(f"--keep {text!r}: the range {span} ends before it starts")
            return KeepRule(text, kind, ranges=tuple(ranges))
    except PruneError:  # already names what is wrong
        raise
    except ValueError:
        raise bad from None
    raise bad


@dataclass
class PrunePlan:
    """``keep``: step -> why (rules, ``latest``); ``delete``: steps to remove; ``protected``: step -> why a step no
    rule keeps is kept anyway (no backup can resume it); ``unbacked``: step -> why no backup can resume a step that
    ``force`` deletes anyway; ``universal``: the universal folders of deleted steps that go with them (module
    docstring); ``dry_run``: whether the deletions were only planned."""

    directory: Path
    keep: dict[int, list[str]] = field(default_factory=dict)
    delete: list[int] = field(default_factory=list)
    protected: dict[int, str] = field(default_factory=dict)
    unbacked: dict[int, str] = field(default_factory=dict)
    universal: list[Path] = field(default_factory=list)
    abandoned: list[Path] = field(default_factory=list)
    """Steps a divergence rollback set aside (:func:`roll_back`) that go too."""
    dry_run: bool = True

    def as_json(self) -> dict:
        return {"dir": str(self.directory), "keep": self.keep, "delete": self.delete, "protected": self.protected,
                "unbacked": self.unbacked, "universal": [str(p) for p in self.universal],
                "abandoned": [str(p) for p in self.abandoned], "dry_run": self.dry_run}


def plan_prune(directory: str | Path, rules: list[KeepRule], force: bool = False,
               abandoned: Iterable[str] = ()) -> PrunePlan:
    """Which steps of a run's checkpoint dir the rules keep, and which would be deleted (module docstring); with
    ``abandoned``, the names of the steps the run's divergence rollbacks set aside (its ``incidents.json``: opskit's
    own record that they are opskit's), those of them still there go too.

    Raises:
        CheckpointFormatError: no such checkpoint dir; ``latest`` is unusable (the step it protects cannot be known).
        PruneError: a step to delete is a symbolic link. BackupError: a corrupt ``.opskit-backups.json`` (without
            ``force``; with it, the record's problem is the warning).
    """
    directory = existing_checkpoint_dir(directory)
    latest = read_latest(directory)
    steps = step_dirs(directory)
    complete = [step for step, folder in steps.items() if describe_step(folder).complete]
    plan = PrunePlan(directory)
    for rule in rules:
        for step in rule.keeps(complete):
            plan.keep.setdefault(step, []).append(rule.text)
    newest_complete = max(complete, default=-1)
    if complete and newest_complete not in plan.keep:
        plan.keep[newest_complete] = ["newest complete step"]
    for step in steps:
        tag = f"global_step{step}"
        if tag == latest:
            plan.keep.setdefault(step, []).append("latest")
        elif step in plan.keep:
            continue
        elif step > newest_complete:
            plan.protected[step] = "incomplete, and newer than every complete step (a save in progress?)"
        else:
            try:
                problem = backup_problem(steps[step])
            except BackupError as e:
                if not force:
                    raise
                problem = str(e)
            if problem and not force:
                plan.protected[step] = f"{problem} (use --force to delete anyway)"
                continue
            if problem:
                plan.unbacked[step] = problem
            plan.delete.append(step)
    plan.keep = dict(sorted(plan.keep.items()))
    _refuse_symlinked_steps(plan)
    plan.universal = _our_universal_folders(directory, plan.delete)
    plan.abandoned = [directory / name for name in abandoned if ABANDONED in name and "/" not in name
                      and (directory / name).is_dir() and not (directory / name).is_symlink()]
    return plan


def _our_universal_folders(directory: Path, steps: list[int]) -> list[Path]:
    """The ``global_stepN_universal`` folders opskit converted from these steps (its marker names the step)."""
    return [path for step, (path, origin) in universal_folders(directory).items()
            if step in steps and not path.is_symlink() and origin and origin.get("step") == f"global_step{step}"]


def _refuse_symlinked_steps(plan: PrunePlan) -> None:
    """Deleting through a link would delete a folder opskit did not write (or, renamed, hide the link)."""
    for step in plan.delete:
        folder = plan.directory / f"global_step{step}"
        if folder.is_symlink():
            raise PruneError(f"{folder}: a symbolic link (to {os.readlink(folder)}), not a step opskit's trainer "
                             "wrote; nothing deleted (remove the link yourself)")


def prune(directory: str | Path, rules: list[KeepRule], dry_run: bool = False, force: bool = False,
          abandoned: Iterable[str] = ()) -> PrunePlan:
    """:func:`plan_prune`, then delete ``plan.delete``, their universal forms and ``plan.abandoned`` (unless
    ``dry_run``)."""
    plan = plan_prune(directory, rules, force, abandoned)
    plan.dry_run = dry_run
    if dry_run:
        return plan
    for folder in [plan.directory / f"global_step{step}" for step in plan.delete] + plan.universal + plan.abandoned:
        hidden = folder.with_name(f".pruning-{folder.name}-{os.getpid()}")
        os.replace(folder, hidden)
        shutil.rmtree(hidden)
    return plan


def set_latest(directory: str | Path, step: int) -> str:
    """Point ``directory/latest`` at ``global_step{step}`` atomically, after checking the step is complete.

    Returns:
        What ``latest`` held before: its tag, None (no ``latest``), or ``unusable (why)`` (replaced: this is how a
        broken ``latest`` is repaired).

    Raises:
        PruneError: no such step, an incomplete one (its first problem named), or ``latest`` is a directory.
    """
    directory = Path(directory)
    folder = _latest_target(directory, step)
    previous, problem = latest_state(directory)
    write_latest(directory, folder.name)
    return f"unusable ({problem})" if problem else previous


def _latest_target(directory: Path, step: int) -> Path:
    """``global_step{step}``, checked as ``latest``'s next target (complete, ``latest`` a file or absent).

    Raises:
        PruneError: naming what is wrong; nothing is changed.
    """
    folder = directory / f"global_step{step}"
    if not folder.is_dir():
        raise PruneError(f"{folder}: no such checkpoint step")
    info = describe_step(folder)
    if info.problems:
        raise PruneError(f"{folder}: incomplete, latest not changed: {info.problems[0]}")
    if (directory / "latest").is_dir():
        raise PruneError(f"{directory / 'latest'}: a directory, not a file opskit may replace; move it away first")
    return folder


ABANDONED = ".abandoned-"
"""``global_stepN.abandoned-<incident>``: a step set aside by a divergence rollback (:func:`roll_back`), no longer a
``global_stepN`` any reader or resume sees; kept for a person to look at, prune may remove it."""


def roll_back(directory: str | Path, step: int, label: str) -> list[str]:
    """Move ``latest`` back to the complete ``global_step{step}``, after setting aside every newer step folder
    (renamed ``global_stepN.abandoned-<label>``, never deleted: a later save of the same iteration would otherwise
    overwrite it). Returns the names set aside.

    Raises:
        PruneError: as :func:`set_latest`; OSError: a rename failed (``latest`` not moved).
    """
    directory = Path(directory)
    folder = _latest_target(directory, step)  # checked once, before anything is renamed
    set_aside = []
    for iteration, newer in sorted(step_dirs(directory).items()):
        if iteration > step:
            target = newer.with_name(f"{newer.name}{ABANDONED}{label}")
            n = 1
            while target.exists():
                n += 1
                target = newer.with_name(f"{newer.name}{ABANDONED}{label}.{n}")
            newer.rename(target)
            set_aside.append(target.name)
    write_latest(directory, folder.name)
    return set_aside
