"""``opskit sync``: publish a run's logs, TensorBoard events and CodeCarbon CSVs to a target, copying only what changed.

Targets (:mod:`opskit.targets`): ``file:///path``, ``gs://bucket/prefix``, ``hf://[datasets/]org/repo[/path]``.

- A manifest in the run directory (one per target) remembers size, mtime and CRC32C of every file last published.
  A file whose size and mtime match is skipped without being read, so a no-change sync of 10,000 files is a few
  ``stat`` calls and makes no request at all. A file that was touched but whose CRC32C is unchanged is not uploaded.
  An append-only log that grew is uploaded again whole (the Hub and GCS store objects, not appends).
- Changed files are first copied to a snapshot folder; a file whose size or mtime moved during that copy (the
  trainer was writing it) is left for the next sync, so nothing half-written is ever published.
- A lock per (run, target) (``flock`` on a file holding the PID): a sync still running makes the next one skip with a
  message; a lock whose holder died is free again (the kernel drops it with the process). Where the file system has
  no ``flock``, an ``O_EXCL`` PID file, taken over when its process is dead.
- Nothing local is ever deleted. Remote objects that are no longer local are deleted only with ``delete=True``, and
  only those this run published (its manifest lists them); ``delete=True, dry_run=True`` lists them, writing nothing.
- The target may be shared (a folder or bucket holding other people's files, or another run's): a sync writes,
  replaces and deletes only the keys its manifest lists. A new key is entered in the manifest (``pending``) before
  its upload, so an interrupted upload is still this run's; a new key that already exists at the target refuses the
  sync before anything is uploaded (:class:`opskit.fsutil.OutputRefusedError`), and ``--delete`` removes only keys of
  the manifest (then drops them from it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from opskit.errors import OpskitError
from opskit.fsutil import OutputRefusedError, atomic_write_text, process_alive, read_bounded, read_json
from opskit.run.paths import RunPaths
from opskit.targets import check_url, open_target
from opskit.targets.base import Target, TargetOptions, crc32c_of_file

if TYPE_CHECKING:
    from opskit.spec.schema import Spec

# What each kind of sync publishes: (the run's folder, globs under it). Keys at the target are paths under the run.
# The logs go with the run's page (opskit report), where people look.
KINDS: dict[str, tuple[Callable[[RunPaths], Path], tuple[str, ...]]] = {
    "logs": (attrgetter("logs"), ("**/*.txt", "report.html")),
    "tensorboard": (attrgetter("tensorboard"), ("**/*tfevents*",)),
    "codecarbon": (attrgetter("codecarbon"), ("**/*.csv",)),
}


class SyncError(OpskitError, ValueError):
    """A bad target or kind, or uploads that failed after their retries; one line saying what to do."""


class SyncBusy(SyncError):
    """Another sync of the same run to the same target holds the lock."""


@dataclass
class SyncResult:
    """What a sync did. ``copied``: keys published (or, dry run, to publish); ``deferred``: files that changed while
    being read, left for the next sync; ``failed``: key -> reason; ``deleted``: remote keys deleted (or listed)."""

    target: str
    copied: list[str] = field(default_factory=list)
    unchanged: int = 0
    deferred: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    dry_run: bool = False

    def as_json(self) -> dict:
        return {"target": self.target, "copied": self.copied, "unchanged": self.unchanged, "deferred": self.deferred,
                "failed": self.failed, "deleted": self.deleted, "dry_run": self.dry_run}


def kinds_of(kind: str) -> list[str]:
    """``all`` -> every kind; else the one kind.

    Raises:
        SyncError: an unknown kind.
    """
    if kind == "all":
        return list(KINDS)
    if kind not in KINDS:
        raise SyncError(f"sync kind {kind!r}: expected one of {', '.join(KINDS)} or all")
    return [kind]


def candidates(run: RunPaths, kinds: list[str]) -> dict[str, Path]:
    """Key at the target (path relative to the run folder) -> local file, for the chosen kinds."""
    files = {}
    for kind in kinds:
        folder, patterns = KINDS[kinds_of(kind)[0]]
        base = folder(run)
        for path in sorted(p for pattern in patterns for p in base.glob(pattern)) if base.is_dir() else []:
            if path.is_file():
                files[str(path.relative_to(run.root))] = path
    return files


def _key_prefix(run: RunPaths, kind: str) -> str:
    """The keys of one kind at the target start with this (its folder under the run, then ``/``)."""
    return KINDS[kind][0](run).relative_to(run.root).as_posix() + "/"


def load_manifest(path: Path) -> dict[str, dict]:
    """key -> {"size", "mtime_ns", "crc32c"}; an old or unreadable manifest counts as empty (everything re-sent)."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def changed_files(files: dict[str, Path], manifest: dict[str, dict]) -> tuple[dict[str, Path], int]:
    """(files whose size or mtime differ from the manifest, how many match): ``stat`` only, nothing is read."""
    changed = {}
    for key, path in files.items():
        stat = path.stat()
        known = manifest.get(key)
        if not known or known.get("size") != stat.st_size or known.get("mtime_ns") != stat.st_mtime_ns:
            changed[key] = path
    return changed, len(files) - len(changed)


def sync(run: RunPaths, kinds: list[str], url: str, dry_run: bool = False, delete: bool = False,
         options: TargetOptions | None = None, target: Target | None = None) -> SyncResult:
    """Publish new or changed files of ``kinds`` from the run to ``url``.

    Args:
        target: an already opened target (tests); default ``open_target(url, options=options)``, opened only when
            there is something to do.

    Raises:
        SyncError: unknown kind; SyncBusy: another sync holds the lock; TargetError: a malformed URL or a failed
            listing/deletion. Upload failures are returned in ``failed`` (what succeeded is kept in the manifest).
        OutputRefusedError: a file to publish under a key that exists at the target and that this run's manifest
            does not list (someone else's); nothing is uploaded then (also in a dry run).
    """
    for kind in kinds:
        kinds_of(kind)
    check_url(url)
    manifest_path = run.sync_manifest(url)
    manifest = load_manifest(manifest_path)
    changed, unchanged = changed_files(candidates(run, kinds), manifest)
    result = SyncResult(url, unchanged=unchanged, dry_run=dry_run)
    if not changed and not delete:
        return result  # nothing new: no lock, no client, no request
    if dry_run:
        target = target or open_target(url, options=options)
        _refuse_foreign(changed, manifest, target, manifest_path)
        result.copied = sorted(changed)
        if delete:
            result.deleted = _extraneous(run, kinds, target, manifest)
        return result
    with run_lock(run.sync_lock(url), url):
        target = target or open_target(url, options=options)
        if changed:
            _refuse_foreign(changed, manifest, target, manifest_path)
            _publish(run, kinds, changed, manifest, manifest_path, target, result)
        if delete:
            result.deleted = _delete_extraneous(run, kinds, target, manifest, manifest_path)
    return result


def sync_spec(spec: Spec, kinds: list[str], to: str | None = None, dry_run: bool = False, delete: bool = False,
              workers: int | None = None, on_busy: Callable[[SyncBusy], None] = lambda busy: None
              ) -> Iterator[SyncResult]:
    """:func:`sync` of a spec's run to ``to``, or else to each of the spec's ``sync.targets`` in turn, with the spec's
    transfer options (``workers`` overrides ``sync.workers``); yields each target's result as it is done. A target
    that another sync holds is skipped: ``on_busy`` gets its :class:`SyncBusy`, the other targets go on.

    Raises:
        SyncError: no ``to`` and no ``sync.targets``; else as :func:`sync` (raised when the target's turn comes).
        SpecError: ``paths.output`` names an unset ``$VAR`` or a file.
    """
    urls = [to] if to else spec.sync.targets
    if not urls:
        raise SyncError(f"{spec.cli_name}: no sync target: give --to URL or set sync.targets in the spec")
    options = TargetOptions(workers=workers or spec.sync.workers, create_repo=spec.sync.create_repo,
                            private=spec.sync.private)
    for url in urls:
        try:
            yield sync(RunPaths.of(spec), kinds, url, dry_run=dry_run, delete=delete, options=options)
        except SyncBusy as busy:
            on_busy(busy)


def _refuse_foreign(changed: dict[str, Path], manifest: dict[str, dict], target: Target, manifest_path: Path) -> None:
    """Refuse to publish over an object this run's manifest does not list: the first new key that already exists
    (one listing per top folder, and only when there are new keys)."""
    new = sorted(key for key in changed if key not in manifest)
    present = {k for folder in sorted({key.split("/")[0] for key in new}) for k in target.keys(folder + "/")}
    for key in new:
        if key in present:
            raise OutputRefusedError(f"{target.url.rstrip('/')}/{key}: exists and was not written by this run's "
                                     f"opskit sync (not in {manifest_path}); sync to another --to (opskit never "
                                     "replaces what it did not write)")


def _publish(run: RunPaths, kinds: list[str], changed: dict[str, Path], manifest: dict[str, dict],
             manifest_path: Path, target: Target, result: SyncResult) -> None:
    with tempfile.TemporaryDirectory(prefix=".sync-snapshot-", dir=run.root) as folder:
        snapshots = {}
        for key, path in changed.items():
            snapshot = _snapshot(path, Path(folder) / key)
            if snapshot is None:
                result.deferred.append(key)
                continue
            entry, copy = snapshot
            if manifest.get(key, {}).get("crc32c") == entry["crc32c"]:  # touched, same bytes: nothing to send
                manifest[key] = entry
                result.unchanged += 1
            else:
                snapshots[key] = (entry, copy)
        if snapshots:
            for key in snapshots:  # claimed before the upload: an interrupted one is still this run's key
                manifest.setdefault(key, {"pending": True})
            atomic_write_text(manifest_path, json.dumps(manifest, indent=0, sort_keys=True))
            message = (f"opskit sync {'+'.join(kinds)}: {len(snapshots)} file(s) at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
            batch = target.put_batch({key: copy for key, (_, copy) in snapshots.items()}, message)
            for key in batch.done:
                manifest[key] = snapshots[key][0]
            result.copied, result.failed = sorted(batch.done), batch.failed
    atomic_write_text(manifest_path, json.dumps(manifest, indent=0, sort_keys=True))


def _snapshot(path: Path, copy: Path) -> tuple[dict, Path] | None:
    """Copy ``path`` to ``copy`` and return (manifest entry, copy), or None when the file changed during the copy."""
    copy.parent.mkdir(parents=True, exist_ok=True)
    before = path.stat()
    shutil.copyfile(path, copy)
    after = path.stat()
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) \
            or copy.stat().st_size != after.st_size:
        return None
    return {"size": after.st_size, "mtime_ns": after.st_mtime_ns, "crc32c": crc32c_of_file(copy)}, copy


def _extraneous(run: RunPaths, kinds: list[str], target: Target, manifest: dict[str, dict]) -> list[str]:
    """Keys this run published (its manifest) under the kinds' folders that are no longer local but still at the
    target; nothing else at the target is ever a candidate."""
    local = candidates(run, kinds)
    folders = tuple(_key_prefix(run, kind) for kind in kinds)
    remote = {k for folder in folders for k in target.keys(folder)}
    return sorted(k for k in manifest if k.startswith(folders) and k not in local and k in remote)


def _delete_extraneous(run: RunPaths, kinds: list[str], target: Target, manifest: dict[str, dict],
                       manifest_path: Path) -> list[str]:
    """Delete the remote keys this run published that are no longer local; they leave the manifest."""
    keys = _extraneous(run, kinds, target, manifest)
    if keys:
        target.delete(keys, f"opskit sync: delete {len(keys)} file(s) no longer in the run")
        for key in keys:
            del manifest[key]
        atomic_write_text(manifest_path, json.dumps(manifest, indent=0, sort_keys=True))
    return keys


@contextmanager
def run_lock(path: Path, url: str) -> Iterator[None]:
    """Hold ``path`` (``flock``, PID written in it) for one sync; on a file system without ``flock`` (some Lustre and
    NFS mounts) a ``path.pid`` file created with ``O_EXCL`` instead, taken over when its process is dead.

    Raises:
        SyncBusy: a live process holds it (its PID in the message).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SyncBusy(f"another sync to {url} is still running (PID {holder}, lock {path}); skipped") from None
    except OSError:
        os.close(fd)
        with _pid_file_lock(path.with_name(path.name + ".pid"), url):
            yield
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing releases the flock


@contextmanager
def _pid_file_lock(path: Path, url: str) -> Iterator[None]:
    """``O_EXCL`` lock file holding ``host pid``; one whose process is gone (same host) is stale and replaced."""
    host = socket.gethostname()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            try:
                holder = read_bounded(path, 4096).decode(errors="replace").split()
            except OSError:
                holder = []  # gone meanwhile, or garbage: taken over below
            if len(holder) == 2 and holder[1].isdigit() and (holder[0] != host or process_alive(int(holder[1]))):
                raise SyncBusy(f"another sync to {url} is still running (PID {holder[1]} on {holder[0]}, lock "
                               f"{path}); skipped") from None
            path.unlink(missing_ok=True)  # its process is dead (or the file is garbage): take it over
    else:
        raise SyncBusy(f"another sync to {url} took the lock {path} at the same moment; skipped")
    try:
        os.write(fd, f"{host} {os.getpid()}\n".encode())
        os.close(fd)
        yield
    finally:
        path.unlink(missing_ok=True)
