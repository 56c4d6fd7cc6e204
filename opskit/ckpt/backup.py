"""``opskit ckpt backup`` and ``opskit ckpt verify``: copy checkpoint steps to a target with a CRC32C manifest.

Layout at the target (any :mod:`opskit.targets` target): ``global_stepN/<files>`` as in the checkpoint dir,
``manifests/global_stepN.json`` = ``{"step", "weights_only", "complete", "files": [{"path", "size", "crc32c"}]}``,
and ``latest`` when the step it names is backed up. By default the ZeRO optimizer shards (``*_optim_states.pt``) stay
behind, as BigScience's ``rsync --exclude "zero*pt"`` backups did (weights, args and RNG are enough to convert or to
restart with a fresh optimizer); ``weights_only=False`` copies them too.

Only complete steps (:func:`opskit.ckpt.info.describe_step`, optimizer shards included) are copied: an incomplete
one is reported with its first problem, copies nothing and is not recorded as backed up. Per step: files are hashed
and copied by a thread pool; an object already at the target with the same size and CRC32C is not copied again, so an
interrupted backup resumes where it stopped.

The target may be shared (a folder holding other people's files): a backup writes only its own keys, and replaces
only objects that its manifests list (or that already hold the same bytes). Before anything is copied, an object at
one of its keys that differs and that no manifest of opskit lists, a ``manifests/global_stepN.json`` opskit did not
write, or a ``latest`` naming no step opskit backed up there, refuses the whole backup in one line
(:class:`opskit.fsutil.OutputRefusedError`). The manifest is written with
``complete: false`` first; every object is then re-read from the target and checked against it, and only then is
the manifest marked complete and the step recorded locally in ``<checkpoint dir>/.opskit-backups.json`` (which
``opskit ckpt prune`` reads to know what is safe to delete).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.layout import CheckpointFormatError, latest_state, step_dirs
from opskit.fsutil import OutputRefusedError, atomic_write_text
from opskit.targets import Target, TargetError, crc32c_of_file, open_target

OPTIMIZER_SUFFIX = "_optim_states.pt"
RECORD = ".opskit-backups.json"


@dataclass
class StepBackup:
    """One step's backup: ``copied``/``skipped`` object keys (skipped: already there, same size and CRC32C);
    ``problems``: verification failures (``verified`` only when there are none)."""

    tag: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_total: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.problems


def backup_files(step: Path, weights_only: bool = True) -> list[Path]:
    """The files of a step folder to back up, sorted; without ``*_optim_states.pt`` when ``weights_only``."""
    return sorted(f for f in step.iterdir() if f.is_file() and not f.name.startswith(".")
                  and not (weights_only and f.name.endswith(OPTIMIZER_SUFFIX)))


def backup(checkpoint_dir: str | Path, url: str, steps: list[int] | None = None, weights_only: bool = True,
           workers: int = 4, progress: Callable[[str, int], None] | None = None) -> list[StepBackup]:
    """Back up ``steps`` (default: all) of a run's checkpoint dir to ``url``.

    Args:
        progress: ``progress(key, nbytes)`` after each object is hashed and copied (or found already there).

    Returns:
        One :class:`StepBackup` per step; an incomplete step's has ``problems`` (not verified) and copied nothing.

    Raises:
        CheckpointFormatError: an asked step that does not exist. TargetError: an unusable URL.
        OutputRefusedError: an object at the target that this backup would replace and opskit did not write (see
            the module's docstring); nothing is copied then.
    """
    checkpoint_dir = Path(checkpoint_dir)
    target = open_target(url)
    available = step_dirs(checkpoint_dir)
    chosen = list(available) if steps is None else steps
    missing = [s for s in chosen if s not in available]
    if missing:
        raise CheckpointFormatError(f"{checkpoint_dir / f'global_step{missing[0]}'}: no such checkpoint step")
    latest, _unusable = latest_state(checkpoint_dir)  # an unusable latest is not copied; the steps still are
    _refuse_foreign_objects(target, [available[s] for s in chosen], weights_only,
                            latest if latest in {available[s].name for s in chosen} else None)
    results = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for step in chosen:
            result = _backup_step(available[step], target, weights_only, pool, progress)
            results.append(result)
            if result.verified:
                _record(checkpoint_dir, url, result)
    if latest and any(r.tag == latest and r.verified for r in results) and target.read_text("latest") != latest:
        target.write_text("latest", latest)
    return results


def _refuse_foreign_objects(target: Target, steps: list[Path], weights_only: bool, latest: str | None) -> None:
    """Refuse (before any copy) to replace what opskit did not write: per step, its manifest key when it holds no
    manifest of opskit, and each of its object keys that exists with other bytes and is not in the step's manifest;
    ``latest`` (when this backup would write it) unless it names a step opskit backed up there."""
    for folder in steps:
        manifest_key = f"manifests/{folder.name}.json"
        manifest = _our_manifest(target, folder.name)
        if manifest is None and target.size(manifest_key) is not None:
            _refuse(target, manifest_key)
        listed = {entry["path"] for entry in manifest["files"]} if manifest else set()
        present = set(target.keys(f"{folder.name}/"))
        for path in backup_files(folder, weights_only):
            key = f"{folder.name}/{path.name}"
            if key in present and key not in listed and not _same_bytes(target, key, path):
                _refuse(target, key)
    current = target.read_text("latest")
    if latest and current is not None and current != latest and _our_manifest(target, current.strip()) is None:
        _refuse(target, "latest")


def _our_manifest(target: Target, tag: str) -> dict | None:
    """The step's ``manifests/<tag>.json`` when opskit wrote it (its JSON shape says so), else None."""
    try:
        manifest = json.loads(target.read_text(f"manifests/{tag}.json") or "null")
    except ValueError:
        return None
    ours = isinstance(manifest, dict) and manifest.get("step") == tag and "complete" in manifest \
        and isinstance(manifest.get("files"), list) and all(isinstance(e, dict) and "path" in e
                                                            for e in manifest["files"])
    return manifest if ours else None


def _same_bytes(target: Target, key: str, path: Path) -> bool:
    return target.size(key) == path.stat().st_size and target.crc32c(key) == crc32c_of_file(path)


def _refuse(target: Target, key: str) -> None:
    raise OutputRefusedError(f"{target.url.rstrip('/')}/{key}: exists and was not written by opskit ckpt backup; "
                             "back up to another --to (opskit never replaces what it did not write)")


def _copy_one(path: Path, key: str, target: Target) -> tuple[str, int, str, bool]:
    try:
        crc = crc32c_of_file(path)
        size = path.stat().st_size
        if target.size(key) == size and target.crc32c(key) == crc:
            return key, size, crc, False
        target.put(path, key)
    except OSError as e:
        raise TargetError(f"{target.url}/{key}: copy failed ({e.strerror or e}); run the backup again to resume") \
            from None
    except TargetError as e:  # a remote target's own one-line reason (HTTP status, after its retries)
        raise TargetError(f"{e}; run the backup again to resume") from None
    return key, size, crc, True


def _backup_step(folder: Path, target: Target, weights_only: bool, pool: ThreadPoolExecutor,
                 progress: Callable[[str, int], None] | None) -> StepBackup:
    from opskit.ckpt.info import describe_step

    result = StepBackup(folder.name)
    info = describe_step(folder)
    if not info.complete:
        result.problems.append(f"incomplete, not backed up: {info.problems[0]}")
        return result
    futures = [pool.submit(_copy_one, f, f"{folder.name}/{f.name}", target) for f in backup_files(folder, weights_only)]
    entries = []
    try:
        for future in futures:
            key, size, crc, copied = future.result()
            (result.copied if copied else result.skipped).append(key)
            result.bytes_total += size
            entries.append({"path": key, "size": size, "crc32c": crc})
            if progress:
                progress(key, size)
    finally:
        for future in futures:  # an interruption stops the queue; copies in flight finish atomically
            future.cancel()
    manifest = {"step": folder.name, "weights_only": weights_only, "complete": False, "files": entries}
    manifest_key = f"manifests/{folder.name}.json"
    target.write_text(manifest_key, json.dumps(manifest, indent=1))
    result.problems = verify_manifest(target, manifest)
    if result.verified:
        manifest.update(complete=True, verified_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        target.write_text(manifest_key, json.dumps(manifest, indent=1))
    return result


def verify_manifest(target: Target, manifest: dict) -> list[str]:
    """One line per object of ``manifest`` that is missing at ``target`` or differs in size or CRC32C."""
    problems = []
    for entry in manifest["files"]:
        size = target.size(entry["path"])
        if size is None:
            problems.append(f"{entry['path']}: missing")
        elif size != entry["size"]:
            problems.append(f"{entry['path']}: {size} bytes, manifest says {entry['size']}")
        elif (crc := target.crc32c(entry["path"])) != entry["crc32c"]:
            problems.append(f"{entry['path']}: CRC32C {crc}, manifest says {entry['crc32c']}")
    return problems


def verify(url: str) -> dict[str, list[str]]:
    """Re-check a backup against its manifests: step tag -> problems (empty when the step is intact).

    Raises:
        TargetError: an unusable URL. CheckpointFormatError: no manifests at ``url``.
    """
    target = open_target(url, option="verify")
    keys = [k for k in target.keys("manifests") if k.endswith(".json")]
    if not keys:
        raise CheckpointFormatError(f"{url}: no manifests/*.json (not a backup made by opskit ckpt backup)")
    report = {}
    for key in keys:
        manifest = json.loads(target.read_text(key))
        problems = verify_manifest(target, manifest)
        if not manifest.get("complete"):
            problems.insert(0, f"{key}: backup never completed (interrupted before verification)")
        report[manifest["step"]] = problems
    return report


def _record(checkpoint_dir: Path, url: str, result: StepBackup) -> None:
    path = checkpoint_dir / RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.setdefault(url, {})[result.tag] = {"files": len(result.copied) + len(result.skipped),
                                              "bytes": result.bytes_total,
                                              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True))


def backed_up_steps(checkpoint_dir: str | Path) -> set[str]:
    """Step tags that some verified backup of this checkpoint dir holds (from ``.opskit-backups.json``)."""
    path = Path(checkpoint_dir) / RECORD
    if not path.is_file():
        return set()
    return {tag for steps in json.loads(path.read_text()).values() for tag in steps}
