"""``opskit sync``: publish a run's logs and TensorBoard events to a target, copying only what changed.

Targets (:mod:`opskit.targets`): ``file:///path`` (a mounted share). A manifest in the run directory remembers
(size, mtime) of every file last published per target, so an unchanged file is never copied again; each copy goes to
a temporary name beside its destination and is renamed into place, so readers never see a half-written file. Nothing
local is deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from opskit.fsutil import atomic_write_text
from opskit.runs import RunPaths
from opskit.targets import FileTarget, TargetError, open_target

# What each kind of sync publishes: (folder of the run, glob under it).
KINDS = {
    "logs": ("logs", "**/*.txt"),
    "tensorboard": ("tensorboard", "**/*tfevents*"),
}


class SyncError(ValueError):
    """A bad target or kind; one line saying what was expected."""


@dataclass(frozen=True)
class SyncResult:
    copied: list[str]
    unchanged: int
    target: Path


def file_target(url: str) -> FileTarget:
    """The ``file:///abs/path`` target of ``url``.

    Raises:
        SyncError: for other schemes or a relative path.
    """
    try:
        target = open_target(url)
    except TargetError as e:
        raise SyncError(str(e)) from None
    return target


def _candidates(run: RunPaths, kinds: list[str]) -> dict[str, Path]:
    """Relative path in the target -> local file, for the chosen kinds."""
    files = {}
    for kind in kinds:
        if kind not in KINDS:
            raise SyncError(f"sync kind {kind!r}: expected one of {', '.join(KINDS)} or all")
        folder, pattern = KINDS[kind]
        base = run.root / folder
        for path in sorted(base.glob(pattern)) if base.is_dir() else []:
            if path.is_file():
                files[str(path.relative_to(run.root))] = path
    return files


def sync(run: RunPaths, kinds: list[str], url: str, dry_run: bool = False) -> SyncResult:
    """Copy new or changed files of ``kinds`` from the run to ``url``.

    An append-only log that grew is copied again whole; a file whose size and mtime match the manifest is skipped.
    """
    target = file_target(url)
    manifest_path = run.root / f".sync-manifest-{_slug(url)}.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    copied, unchanged = [], 0
    for relative, path in _candidates(run, kinds).items():
        stat = path.stat()
        signature = [stat.st_size, stat.st_mtime_ns]
        if manifest.get(relative) == signature and target.size(relative) is not None:
            unchanged += 1
            continue
        copied.append(relative)
        if not dry_run:
            target.put(path, relative)
            manifest[relative] = signature
    if copied and not dry_run:
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True))
    return SyncResult(copied, unchanged, target.root)


def _slug(url: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in url).strip("_")[-80:]
