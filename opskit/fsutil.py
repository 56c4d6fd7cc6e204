"""Atomic file-system writes, and the rule for outputs: nothing half-written is ever visible under its final name,
and nothing opskit did not write itself is deleted, replaced or re-moded.

Ownership: a folder opskit writes as a command's output carries :data:`MARKER` (``.opskit``, one JSON line naming the
command); a file output carries its own marker where its format allows (a PNG text chunk, a YAML comment), checked by
the writer's ``ours`` test. An existing non-empty target is refused in one line unless ``force`` is given *and* the
marker says opskit wrote it (:func:`claim_dir`, :func:`claim_file`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from opskit.errors import OpskitError

MARKER = ".opskit"


class OutputRefusedError(OpskitError):
    """An output target that exists and is not opskit's to replace (or ``--force`` was not given)."""


def staging_path(path: Path) -> Path:
    """Hidden per-process temporary name next to ``path`` (same file system, so the rename is atomic)."""
    return path.with_name(f".{path.name}-{os.getpid()}")


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    staging = staging_path(path)
    try:
        staging.write_text(text, encoding="utf-8")
        if mode is not None:
            staging.chmod(mode)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def write_marker(folder: Path, what: str) -> None:
    """Mark ``folder`` as written by opskit's ``what`` (e.g. ``"ckpt convert"``): ``<folder>/.opskit``."""
    atomic_write_text(Path(folder) / MARKER, json.dumps({"written_by": "opskit", "command": what,
                                                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


def has_marker(folder: Path) -> bool:
    """True when ``folder/.opskit`` is a marker opskit wrote (a readable JSON object with ``written_by: opskit``)."""
    try:
        return json.loads((Path(folder) / MARKER).read_bytes()).get("written_by") == "opskit"
    except (OSError, ValueError, AttributeError):
        return False


def claim_dir(target: Path, force: bool, flag: str = "--out") -> None:
    """Check that ``target`` may become (or be replaced by) an output folder of opskit.

    Allowed: a missing path, an empty folder, or -- with ``force`` -- a folder carrying opskit's :data:`MARKER`.

    Raises:
        OutputRefusedError: ``target`` is a file or another non-folder, a non-empty folder without the marker (even
            with ``force``: opskit did not write it), or a marked folder without ``force``; a target named ``.``,
            ``..`` or ``/``, or below a file. ``flag`` names the option the user can change in the message.
    """
    target = Path(target)
    _refuse_unnamed(target, flag)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_dir():
        raise OutputRefusedError(f"{target}: exists and is not a folder; {flag} must name a new or empty folder")
    if not any(target.iterdir()):
        return
    if not has_marker(target):
        raise OutputRefusedError(f"{target}: exists and holds files opskit did not write; choose another {flag} "
                                 "(opskit never deletes what it did not write)")
    if not force:
        raise OutputRefusedError(f"{target}: exists (written by opskit earlier); --force replaces it")


def _refuse_unnamed(target: Path, flag: str) -> None:
    """An output must have a name of its own (not ``.``, ``..`` or ``/``, which cannot be renamed into place) and a
    parent that is a folder (or will be one)."""
    if target.name in ("", ".", ".."):
        raise OutputRefusedError(f"{flag} {target}: names an existing folder by '.', '..' or '/'; give the output "
                                 f"its own name (e.g. {flag} {target / 'out'})")
    parent = next(p for p in target.parents if p.exists() or p.is_symlink() or p == p.parent)
    if not parent.is_dir():
        raise OutputRefusedError(f"{parent}: is not a folder; {flag} {target} cannot be created inside it")


def claim_file(target: Path, force: bool, ours: Callable[[Path], bool], flag: str = "--out") -> None:
    """Check that the file ``target`` may be written: it is missing, or ``force`` is given and ``ours(target)``
    says opskit wrote it (the format's own marker).

    Raises:
        OutputRefusedError: ``target`` is a folder or other non-file, a file opskit did not write, or one it wrote
            without ``force``; a target named ``.``, ``..`` or ``/``, or below a file.
    """
    target = Path(target)
    _refuse_unnamed(target, flag)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_file():
        raise OutputRefusedError(f"{target}: exists and is not a regular file; {flag} must name a file")
    if not ours(target):
        raise OutputRefusedError(f"{target}: exists and was not written by opskit; choose another {flag} "
                                 "(opskit never replaces what it did not write)")
    if not force:
        raise OutputRefusedError(f"{target}: exists (written by opskit earlier); --force replaces it")


def replace_dir(staging: Path, target: Path) -> None:
    """Rename the finished folder ``staging`` to ``target``, which :func:`claim_dir` allowed: missing, empty (its
    mode is kept), or opskit's own (moved aside, then removed). ``staging`` gets the usual mode for a new folder
    (0777 less the umask; ``tempfile.mkdtemp`` makes it 0700).
    """
    staging, target = Path(staging), Path(target)
    umask = os.umask(0)
    os.umask(umask)
    if target.is_dir() and not any(target.iterdir()):
        staging.chmod(target.stat().st_mode & 0o7777)
        os.replace(staging, target)  # rename(2) replaces an empty folder
        return
    staging.chmod(0o777 & ~umask)
    if not target.exists():
        os.replace(staging, target)
        return
    if not has_marker(target):  # claim_dir refused this already; never remove what opskit did not write
        raise OutputRefusedError(f"{target}: exists and holds files opskit did not write; not replaced")
    old = target.with_name(f".{target.name}-old-{os.getpid()}")
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
