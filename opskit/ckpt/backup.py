"""``opskit ckpt backup``, ``verify`` and ``restore``: copy checkpoint steps to a target with a CRC32C manifest, and
back.

Layout at the target (any :mod:`opskit.targets` target): ``global_stepN/<files>`` as in the checkpoint dir,
``manifests/global_stepN.json`` = ``{"step", "source": {"dir", "host"}, "weights_only", "complete", "files":
[{"path", "size", "crc32c"}], "left_out": [names of the step's files not copied]}``, and ``latest`` when the step it
names is backed up. By default the ZeRO optimizer shards (``*_optim_states.pt``) stay behind (``left_out``), as
BigScience's ``rsync --exclude "zero*pt"`` backups did (weights, args and RNG are enough to convert or to restart with
a fresh optimizer); ``weights_only=False`` copies them too.

Only complete steps (:func:`opskit.ckpt.format.info.describe_step`, optimizer shards included) whose files pass ``ckpt
check``'s CRC-32 rule (:func:`opskit.ckpt.check.crc_problem`: bytes flipped inside tensor data) are copied: an
incomplete or corrupt one is reported with its first problem, copies nothing and is not recorded as backed up. Per
step: files are CRC-32-checked, then hashed and copied, by a thread pool; an object already at the target with the same
size and CRC32C is not copied again, so an interrupted backup resumes where it stopped.

A file:// target must be a second copy: the filesystem root, the checkpoint dir itself, a folder inside it or one
holding it is refused in one line before anything is written (pruning the source would delete such a "backup").

What each kind serves: a weights-only backup (the default) holds what ``ckpt convert``/``inspect`` read, not a
resume; a ``--with-optim`` backup holds every file of the step, so it can resume it, and only such a backup lets
``opskit ckpt prune`` delete the local step (:func:`backup_problem`). ``ckpt convert``/``inspect``/``check`` read a
weights-only backup's step folder in place (a file:// backup, or a copy of one with its ``manifests``) when its
manifest says it left out exactly the optimizer shards missing there
(:func:`opskit.ckpt.format.info.weights_only_copy`); the step stays incomplete for everything else (``list``,
``set-latest``, the trainer's resume), and ``restore`` refuses it.

The target may be shared (a folder holding other people's files): a backup writes only its own keys, and replaces
only objects that its manifests list (or that already hold the same bytes). Before anything is copied, an object at
one of its keys that differs and that no manifest of opskit lists, a ``manifests/global_stepN.json`` opskit did not
write, or a ``latest`` naming no step opskit backed up there, refuses the whole backup in one line
(:class:`opskit.fsutil.OutputRefusedError`). Each manifest names its ``source`` (the resolved checkpoint dir and the
host that backed it up): a step at the same key whose manifest names another checkpoint dir is refused the same way,
whatever its bytes (two runs' ``global_step40`` are different checkpoints); a manifest of an older opskit, naming no
source, is adopted only when every object it would replace holds the same bytes. The manifest is written with
``complete: false`` first; every object is then re-read from the target and checked against it, and only then is
the manifest marked complete and the step recorded locally in ``<checkpoint dir>/.opskit-backups.json`` (which
``opskit ckpt prune`` reads to know where to look: :func:`backup_problem` then checks at the target that the step's
manifest is still there, complete, names this checkpoint dir, lists every file of the step, and that every object it
lists exists with its size).

``opskit ckpt restore`` (:func:`restore`) copies a step back from a verified manifest into a hidden folder beside
where it belongs, checks it as ``backup`` checked it (sizes and CRC32C against the manifest, complete, CRC-32s), and
only then renames it to ``global_stepN``; it never replaces a step that is there.

``opskit ckpt verify`` re-checks every step folder at the target: one with a manifest against it, one without (an
interrupted first backup, a copy made by something else) as unverifiable, and a ``latest`` naming no step there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.check import crc_problem
from opskit.ckpt.format.info import describe_step
from opskit.ckpt.format.layout import STEP_DIR, CheckpointFormatError, existing_checkpoint_dir, latest_state, step_dirs
from opskit.ckpt.format.manifest import MANIFEST_SHAPE, is_manifest
from opskit.errors import OpskitError
from opskit.fsutil import OutputRefusedError, atomic_write_text, read_json
from opskit.targets import open_target
from opskit.targets.base import Target, TargetError, crc32c_of_file
from opskit.targets.file import FileTarget

OPTIMIZER_SUFFIX = "_optim_states.pt"
RECORD = ".opskit-backups.json"


class BackupError(OpskitError):
    """Backup metadata opskit cannot read (a corrupt ``.opskit-backups.json``); one line naming the file."""


@dataclass
class StepBackup:
    """One step's backup: ``copied``/``skipped`` object keys (skipped: already there, same size and CRC32C);
    ``problems``: verification failures (``verified`` only when there are none)."""

    tag: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_total: int = 0
    problems: list[str] = field(default_factory=list)
    unrecorded: str | None = None  # why a verified step is not in the checkpoint dir's record (a read-only dir)

    @property
    def verified(self) -> bool:
        return not self.problems

    def as_json(self) -> dict:
        return {"step": self.tag, "copied": self.copied, "skipped": self.skipped, "bytes": self.bytes_total,
                "verified": self.verified, "problems": self.problems, "unrecorded": self.unrecorded}


def backup_files(step: Path, weights_only: bool = True) -> list[Path]:
    """The files of a step folder to back up, sorted; without ``*_optim_states.pt`` when ``weights_only``."""
    return sorted(f for f in step.iterdir() if f.is_file() and not f.name.startswith(".")
                  and not (weights_only and f.name.endswith(OPTIMIZER_SUFFIX)))


def parse_steps(text: str | None) -> list[int] | None:
    """``--steps 1000,2000`` -> ``[1000, 2000]``; None (all steps) for None or "".

    Raises:
        BackupError: anything but comma-separated whole numbers.
    """
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise BackupError(f"--steps {text}: expected comma-separated step numbers, e.g. 1000,2000") from None


def backup(checkpoint_dir: str | Path, url: str, steps: list[int] | None = None, weights_only: bool = True,
           workers: int = 4, progress: Callable[[str, int], None] | None = None) -> list[StepBackup]:
    """Back up ``steps`` (default: all) of a run's checkpoint dir to ``url``.

    Args:
        progress: ``progress(key, nbytes)`` after each object is hashed and copied (or found already there).

    Returns:
        One :class:`StepBackup` per step; an incomplete step's has ``problems`` (not verified) and copied nothing.

    Raises:
        CheckpointFormatError: no such checkpoint dir, or an asked step that does not exist. TargetError: an
            unusable URL. BackupError: a corrupt ``.opskit-backups.json``.
        OutputRefusedError: an object at the target that this backup would replace and opskit did not write, or
            another checkpoint dir's step at the same key (see the module's docstring); a file:// target that is no
            second copy (:func:`overlap_problem`); nothing is copied then.
    """
    checkpoint_dir = existing_checkpoint_dir(checkpoint_dir)
    target = open_target(url)
    if problem := overlap_problem(checkpoint_dir, target):
        raise OutputRefusedError(f"--to {url}: {problem}; back up to a folder outside it (a copy there is no second "
                                 "copy: pruning the checkpoint dir would delete it)")
    if isinstance(target, FileTarget) and (problem := target.folder_problem()):
        raise OutputRefusedError(f"--to {url}: {problem}; back up to a folder (new or existing)")
    read_record(checkpoint_dir)  # a corrupt record is refused before anything is copied, not after
    available = step_dirs(checkpoint_dir)
    chosen = list(available) if steps is None else steps
    missing = [s for s in chosen if s not in available]
    if missing:
        raise CheckpointFormatError(f"{checkpoint_dir / f'global_step{missing[0]}'}: no such checkpoint step")
    latest, _unusable = latest_state(checkpoint_dir)  # an unusable latest is not copied; the steps still are
    source = source_of(checkpoint_dir)
    _refuse_foreign_objects(target, [available[s] for s in chosen], weights_only, source,
                            latest if latest in {available[s].name for s in chosen} else None)
    results = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for step in chosen:
            result = _backup_step(available[step], target, weights_only, source, pool, progress)
            results.append(result)
            if result.verified:
                result.unrecorded = _record(checkpoint_dir, url, result)
    if latest and any(r.tag == latest and r.verified for r in results) and target.read_text("latest") != latest:
        target.write_text("latest", latest)
    return results


def overlap_problem(checkpoint_dir: Path, target: Target) -> str | None:
    """Why ``target`` is no second copy of ``checkpoint_dir`` (one line), or None: a file:// target that is the
    filesystem root, the checkpoint dir itself, inside it, or a folder holding it (symbolic links resolved). Other
    targets are never local folders."""
    if not isinstance(target, FileTarget):
        return None
    root, source = target.root.resolve(), Path(checkpoint_dir).resolve()
    if root == Path(root.anchor):
        return "the filesystem root"
    if root == source:
        return f"the checkpoint dir {source} itself"
    if root.is_relative_to(source):
        return f"inside the checkpoint dir {source}"
    if source.is_relative_to(root):
        return f"holds the checkpoint dir {source}"
    return None


def restore_dir_problem(checkpoint_dir: str | Path, target: Target) -> str | None:
    """Why a step of ``target`` may not be restored into ``checkpoint_dir`` (one line), or None: the filesystem
    root, or (file://) the backup's own folder, a folder inside it or one holding it (symbolic links resolved): the
    restored step would land among the backup's objects, where a later backup or verify takes it for one."""
    directory = Path(checkpoint_dir).resolve()
    if directory == Path(directory.anchor):
        return "the filesystem root"
    if not isinstance(target, FileTarget):
        return None
    root = target.root.resolve()
    if directory.is_relative_to(root):
        return f"inside the backup {root}"
    if root.is_relative_to(directory):
        return f"holds the backup {root}"
    return None


def source_of(checkpoint_dir: Path) -> dict:
    """What a manifest records as its source: the resolved checkpoint dir (what identifies the run's steps) and the
    host that backed it up (informational: the same shared dir is backed up from any node)."""
    return {"dir": str(Path(checkpoint_dir).resolve()), "host": socket.gethostname()}


def _refuse_foreign_objects(target: Target, steps: list[Path], weights_only: bool, source: dict,
                            latest: str | None) -> None:
    """Refuse (before any copy) to replace what opskit did not write, or another run's step: per step, its manifest
    key when it holds no manifest of opskit or one naming another source, and each of its object keys that exists
    with other bytes and is not in the step's manifest (in no manifest at all when that one names no source);
    ``latest`` (when this backup would write it) unless it names a step opskit backed up there."""
    for folder in steps:
        manifest_key = f"manifests/{folder.name}.json"
        manifest = _our_manifest(target, folder.name)
        if manifest is None and target.size(manifest_key) is not None:
            _refuse(target, manifest_key)
        legacy = manifest is not None and "source" not in manifest
        if manifest is not None and not legacy and manifest["source"]["dir"] != source["dir"]:
            raise OutputRefusedError(f"{target.url.rstrip('/')}/{manifest_key}: holds {folder.name} of another "
                                     f"checkpoint dir ({manifest['source']['dir']}); back up to another --to "
                                     "(a backup replaces only its own checkpoint dir's steps)")
        listed = {entry["path"] for entry in manifest["files"]} if manifest and not legacy else set()
        present = set(target.keys(f"{folder.name}/"))
        for path in backup_files(folder, weights_only):
            key = f"{folder.name}/{path.name}"
            if key in present and key not in listed and not _same_bytes(target, key, path):
                if legacy:
                    raise OutputRefusedError(
                        f"{target.url.rstrip('/')}/{key}: differs from {path}, and {manifest_key} names no source "
                        "(written by an older opskit, maybe from another run); back up to another --to")
                _refuse(target, key)
    current = target.read_text("latest")
    if latest and current is not None and current != latest and _our_manifest(target, current.strip()) is None:
        _refuse(target, "latest")


def _our_manifest(target: Target, tag: str) -> dict | None:
    """The step's ``manifests/<tag>.json`` when opskit wrote it (its JSON shape says so), else None (also when it is
    unreadable: not JSON, not text)."""
    try:
        manifest = json.loads(target.read_text(f"manifests/{tag}.json") or "null")
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None
    return manifest if is_manifest(manifest, tag) else None


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


def _backup_step(folder: Path, target: Target, weights_only: bool, source: dict, pool: ThreadPoolExecutor,
                 progress: Callable[[str, int], None] | None) -> StepBackup:
    result = StepBackup(folder.name)
    info = describe_step(folder)
    if not info.complete:
        result.problems.append(f"incomplete, not backed up: {info.problems[0]}")
        return result
    files = backup_files(folder, weights_only)
    # All of the step's CRC-32s before any copy: a corrupt step leaves no objects behind at the target.
    needed = set(info.files)
    corrupt = [p for p, _ in pool.map(crc_problem, [f for f in files if f in needed]) if p]
    if corrupt:
        result.problems.append(f"corrupt, not backed up: {corrupt[0]}")
        return result
    futures = [pool.submit(_copy_one, f, f"{folder.name}/{f.name}", target) for f in files]
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
    manifest = {"step": folder.name, "source": source, "weights_only": weights_only, "complete": False,
                "files": entries, "left_out": [f.name for f in backup_files(folder, False) if f not in files]}
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


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: step tag -> problems (empty when the step is intact), ascending by step, and
    ``"latest"`` -> problems when ``latest`` names no step of the backup."""

    steps: dict[str, list[str]]

    @property
    def ok(self) -> bool:
        return not any(self.steps.values())

    def as_json(self) -> dict[str, list[str]]:
        return self.steps


def verify(url: str) -> Verification:
    """Re-check a backup: every manifest and every ``global_stepN`` folder at ``url`` (one without a manifest is
    unverifiable: a problem; at a file:// target, one that is a symbolic link, a file or empty too), and ``latest``
    (a folder, not text, or naming no step of the backup: a problem) (:class:`Verification`).

    Raises:
        TargetError: an unusable URL. CheckpointFormatError: neither manifests nor step folders at ``url``.
    """
    target = open_target(url, option="verify")
    keys = [k for k in target.keys("manifests") if k.endswith(".json")]
    folders = {top for k in target.keys() if (top := k.split("/", 1)[0]) != k and STEP_DIR.match(top)}
    hidden = _unlisted_step_folders(target)
    if not keys and not folders and not hidden:
        raise CheckpointFormatError(f"{url}: no manifests/*.json (not a backup made by opskit ckpt backup)")
    report = dict(hidden)
    for tag in folders - {Path(k).stem for k in keys} - set(hidden):
        report[tag] = [f"{tag}/: no manifests/{tag}.json, cannot be verified (an interrupted first backup, or not "
                       "copied by opskit ckpt backup): back it up again"]
    for key in keys:
        tag = Path(key).stem
        manifest = _our_manifest(target, tag)
        if manifest is None:
            report[tag] = [f"{key}: not a manifest of opskit ckpt backup ({MANIFEST_SHAPE})"]
            continue
        problems = verify_manifest(target, manifest)
        if not manifest.get("complete"):
            problems.insert(0, f"{key}: backup never completed (interrupted before verification)")
        report[tag] = report.get(tag, []) + problems
    report = dict(sorted(report.items(), key=lambda item: (len(item[0]), item[0])))  # global_step5 before ..10
    if problem := _latest_problem(target, report):
        report["latest"] = [problem]
    return Verification(report)


def _latest_problem(target: Target, steps: dict[str, list[str]]) -> str | None:
    """Why the backup's ``latest`` is unusable (not a file, not text, naming no step of ``steps``), or None (also
    when there is none)."""
    try:
        latest = (target.read_text("latest") or "").strip()
    except TargetError as e:
        return f"latest: {e}"
    if latest and latest not in steps:
        return f"latest: names {latest[:40]!r}, which is no step of this backup"
    return None


def _unlisted_step_folders(target: Target) -> dict[str, list[str]]:
    """file:// only: the ``global_stepN`` entries the object listing does not show as copies, with why: a symbolic
    link (its files are another folder's, which pruning or a move takes away), an empty folder, or a file."""
    if not isinstance(target, FileTarget) or not target.root.is_dir():
        return {}
    found = {}
    for entry in sorted(target.root.iterdir()):
        if not STEP_DIR.match(entry.name):
            continue
        if entry.is_symlink():
            found[entry.name] = [f"{entry.name}/: a symbolic link to {os.readlink(entry)}, not a copy: back the step "
                                 "up again"]
        elif not entry.is_dir():
            found[entry.name] = [f"{entry.name}: a file, not a step folder"]
        elif not any(entry.iterdir()):
            found[entry.name] = [f"{entry.name}/: empty (an interrupted first backup?): back the step up again"]
    return found


def read_record(checkpoint_dir: str | Path) -> dict[str, dict[str, dict]]:
    """``<checkpoint dir>/.opskit-backups.json``: URL -> step tag -> ``{files, bytes, verified_at}`` ({} when absent).

    Raises:
        BackupError: the file is not that (not JSON, not text, another shape, a folder).
    """
    path = Path(checkpoint_dir) / RECORD
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        record = read_json(path)
    except (OSError, ValueError):
        record = None
    if not (isinstance(record, dict) and all(isinstance(steps, dict) and all(isinstance(s, dict) for s in
                                                                               steps.values())
                                             for steps in record.values())):
        raise BackupError(f"{path}: expected a JSON object {{url: {{global_stepN: {{files, bytes, verified_at}}}}}} "
                          "as opskit ckpt backup writes it; move it away and back up again")
    return record


def _record(checkpoint_dir: Path, url: str, result: StepBackup) -> str | None:
    """Add the verified step to the checkpoint dir's record; why it could not (one line), or None. A read-only
    checkpoint dir is backed up all the same: the manifests at the target are the backup's truth, the record only
    tells ``prune`` where to look, and nothing can be pruned from a folder that cannot be written."""
    path = checkpoint_dir / RECORD
    record = read_record(checkpoint_dir)
    record.setdefault(url, {})[result.tag] = {"files": len(result.copied) + len(result.skipped),
                                              "bytes": result.bytes_total,
                                              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True))
    except OSError as e:
        return f"not recorded in {path} ({e.strerror}): prune will not count this backup"
    return None


def backup_problem(folder: Path) -> str | None:
    """Why the step ``folder`` may not be deleted for want of a backup that can resume it (one line), or None when a
    backup recorded in its checkpoint dir's ``.opskit-backups.json`` still holds all of it: the target is a second
    copy (:func:`overlap_problem`), its manifest is there, complete, names this checkpoint dir, lists every file of
    the step (optimizer shards included: a weights-only backup cannot resume the step), and every object it lists
    exists with the listed size (sizes only, no read: ``opskit ckpt verify`` is the full CRC32C check). An unreachable
    target holds nothing.

    Raises:
        BackupError: a corrupt ``.opskit-backups.json``.
    """
    urls = [url for url, steps in read_record(folder.parent).items() if folder.name in steps]
    if not urls:
        return "not backed up"
    problems = []
    for url in urls:
        try:
            problem = _held_problem(open_target(url, option="backup"), folder)
        except TargetError as e:
            problem = f"unreachable ({e})"
        if problem is None:
            return None
        problems.append(f"backup {url}: {problem}")
    return "; ".join(problems)


def _held_problem(target: Target, folder: Path) -> str | None:
    if overlap := overlap_problem(folder.parent, target):
        return f"no second copy (the target is {overlap})"
    manifest_key = f"manifests/{folder.name}.json"
    manifest = _our_manifest(target, folder.name)
    if manifest is None:
        return f"{manifest_key} missing or not a manifest of opskit ckpt backup"
    if not manifest["complete"]:
        return f"{manifest_key}: backup never completed"
    source = manifest.get("source", {}).get("dir")
    if source != source_of(folder.parent)["dir"]:
        return f"{manifest_key} names {f'another checkpoint dir ({source})' if source else 'no source (older opskit)'}"
    listed = {entry["path"]: entry["size"] for entry in manifest["files"]}
    for path in backup_files(folder, weights_only=False):
        key = f"{folder.name}/{path.name}"
        if key not in listed and manifest.get("weights_only") is not False and path.name.endswith(OPTIMIZER_SUFFIX):
            return "weights only (no optimizer states): serves convert/inspect, cannot resume the step; back it up " \
                   "with --with-optim"
        if listed.get(key) != path.stat().st_size:
            return f"{key} not in the backup as it is here"
    for key, size in listed.items():
        found = target.size(key)
        if found != size:
            return f"{key}: missing" if found is None else f"{key}: {found} bytes, manifest says {size}"
    return None


def _rename_step(staging: Path, final: Path) -> None:
    """Rename the restored ``staging`` folder to ``final``, never over a step (another restore of the same step
    that finished first: rename(2) refuses a non-empty folder).

    Raises:
        OutputRefusedError: ``final`` exists by now.
    """
    try:
        os.replace(staging, final)
    except OSError:
        if final.exists() or final.is_symlink():
            raise OutputRefusedError(f"{final}: exists (another restore put it there meanwhile); restore never "
                                     "replaces a step") from None
        raise


@dataclass
class Restored:
    """What :func:`restore` wrote: the step folder, its file count and bytes, and ``latest`` of the checkpoint dir
    (unchanged by a restore; the trainer resumes from the step only when ``latest`` names it)."""

    step: Path
    files: int
    bytes_total: int
    latest: str | None

    def as_json(self) -> dict:
        return {"step": str(self.step), "files": self.files, "bytes": self.bytes_total, "latest": self.latest}


def restore(url: str, checkpoint_dir: str | Path, step: int | None = None) -> Restored:
    """Copy one backed-up step from ``url`` to ``<checkpoint_dir>/global_stepN`` (created, with its parents, when
    missing), verified and resumable (module docstring); ``step`` None: the one the backup's ``latest`` names.
    Objects are read one at a time, whole, into memory (the target interface reads bytes).

    Raises:
        TargetError: an unusable URL, a failed read. CheckpointFormatError: no such step at the backup (or no
            ``latest`` to follow), a manifest that is not opskit's or fails verification, or a restored copy that is
            not a complete, CRC-intact step; a weights-only backup that left files out (its optimizer shards);
            nothing is left behind then. OutputRefusedError: ``global_stepN`` exists locally (or another restore
            put it there meanwhile); ``checkpoint_dir`` is the filesystem root, or the backup's own folder, inside
            it or holding it (:func:`restore_dir_problem`).
    """
    target = open_target(url, option="restore")
    if problem := restore_dir_problem(checkpoint_dir, target):
        raise OutputRefusedError(f"{checkpoint_dir}: {problem}; restore into the run's checkpoint dir")
    tag = f"global_step{step}" if step is not None else (target.read_text("latest") or "").strip()
    if not STEP_DIR.match(tag):
        raise CheckpointFormatError(f"{url.rstrip('/')}/latest: missing or not a global_stepN tag; give --step N")
    manifest = _our_manifest(target, tag)
    if manifest is None:
        raise CheckpointFormatError(f"{url.rstrip('/')}/manifests/{tag}.json: missing or not a manifest of opskit ckpt "
                                    f"backup ({MANIFEST_SHAPE}); nothing restored")
    problems = ([] if manifest["complete"] else ["backup never completed"]) + verify_manifest(target, manifest)
    if problems:
        raise CheckpointFormatError(f"{url.rstrip('/')}: {tag} fails verification ({problems[0]}); nothing restored")
    left_out = manifest.get("left_out", ["its optimizer states"] if manifest.get("weights_only") else [])
    if left_out:  # an older manifest does not say what a weights-only backup left out: assume the shards
        raise CheckpointFormatError(f"{url.rstrip('/')}/manifests/{tag}.json: a weights-only backup (without "
                                    f"{left_out[0]}{', ...' if len(left_out) > 1 else ''}): it serves convert/inspect, "
                                    "not a resume; restore from a --with-optim backup; nothing restored")
    directory = Path(checkpoint_dir)
    final = directory / tag
    if final.exists() or final.is_symlink():
        raise OutputRefusedError(f"{final}: exists; restore never replaces a step (move it away first)")
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".{tag}.restoring-{os.getpid()}"
    staging.mkdir()
    try:
        for entry in manifest["files"]:
            local = staging / Path(entry["path"]).name
            local.write_bytes(target.read_from(entry["path"], 0) or b"")
            if local.stat().st_size != entry["size"] or crc32c_of_file(local) != entry["crc32c"]:
                raise CheckpointFormatError(f"{url.rstrip('/')}/{entry['path']}: changed while it was restored (size "
                                            "or CRC32C differs from the manifest); nothing restored, run it again")
        info = describe_step(staging)
        why = info.problems[0] if info.problems else next(
            (p for p, _ in map(crc_problem, info.files) if p), None)
        if why:
            raise CheckpointFormatError(f"{final}: the restored copy is not a complete step: "
                                        f"{why.replace(str(staging), str(final))}; nothing restored")
        _rename_step(staging, final)
    finally:
        if staging.exists():  # this restore's own folder (made above with its pid)
            shutil.rmtree(staging)
    latest, _ = latest_state(directory)
    return Restored(final, len(manifest["files"]), sum(e["size"] for e in manifest["files"]), latest)
