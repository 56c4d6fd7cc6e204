"""Atomic file-system writes, and the rule for outputs: nothing half-written is ever visible under its final name,
and nothing opskit did not write itself is deleted, replaced or re-moded.

Ownership: a folder opskit writes as a command's output carries :data:`MARKER` (``.opskit``, one JSON line naming the
command; for a folder a command writes whole, also the entries it wrote and what it was made from); a file output
carries its own marker where its format allows (a PNG text chunk, a YAML comment), checked by the writer's ``ours``
test. An existing non-empty target is refused in one line unless ``force`` is given *and* the
marker says opskit wrote it (:func:`claim_dir`, :func:`claim_file`); a folder is replaced only by the command that
wrote it, and only while it holds nothing beyond the entries its marker lists.

Reading a run's files (logs, ledger, state, manifests, flags, heartbeats): :func:`open_regular` refuses what is not a
regular file (``/dev/zero`` never ends, a FIFO never answers), :func:`read_bounded` and :func:`read_json` read at most
:data:`MAX_SMALL_FILE` bytes of a file that opskit writes small, :func:`bounded_lines` streams a large one holding at
most :data:`MAX_LINE` bytes of any line: time linear in the bytes read, memory bounded whatever the content.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from opskit.errors import OpskitError

MARKER = ".opskit"
MAX_LINE = 1 << 20
"""Bytes a line of a run's text file may have (its newline not counted): no line opskit, the job script or the trainer
writes comes near it; a longer one (a sparse hole, binary data) is garbage, skipped unread past this cap."""
MAX_SMALL_FILE = 16 << 20
"""Bytes a small file of a run may have (JSON state, manifests, markers, flags, ``latest``, the bad-node list): the
largest opskit writes (a backup manifest of tr11's ~1,000 files) holds ~150 KB; a larger one is not opskit's."""


class UnreadableFileError(OpskitError, OSError):
    """A file opskit reads that is not a regular file (a folder, device, FIFO or socket), or larger than its reader's
    bound: ``filename`` names it and ``strerror`` says why (the CLI prints ``<file>: <why>``). An ``OSError``, so
    every reader that takes an unreadable file in its stride takes this one too."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _kind(mode: int) -> str:
    """What a non-regular file is, for a message."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading bytes, when it is a regular file (symbolic links followed). The test is made on the
    opened file (``fstat``), so nothing can swap it in between, and the open does not wait on a FIFO (``O_NONBLOCK``,
    cleared once the file is known to be regular).

    Raises:
        FileNotFoundError: no such file. UnreadableFileError: a folder, device, FIFO or socket. OSError: unreadable.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFileError(errno.EINVAL, f"{_kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | Path, limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of the regular file ``path``, refused past ``limit`` bytes (read: ``limit`` + 1 at most).

    Raises:
        FileNotFoundError: no such file. UnreadableFileError: not a regular file, or more than ``limit`` bytes.
        OSError: unreadable.
    """
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFileError(errno.EFBIG, f"more than {limit:,} bytes, larger than any such file opskit writes",
                                  str(path))
    return data


def parse_json(text: str | bytes) -> object:
    """``json.loads``, with nesting too deep for the parser (``[[[[...``: a RecursionError) a ValueError as any other
    text that is not JSON.

    Raises:
        ValueError: not JSON (json.JSONDecodeError, UnicodeDecodeError, or nested too deep).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("not JSON: nested too deep") from None


def read_json(path: str | Path, limit: int = MAX_SMALL_FILE) -> object:
    """The JSON value in the small file ``path`` (:func:`read_bounded`, :func:`parse_json`).

    Raises:
        FileNotFoundError, UnreadableFileError, OSError: as :func:`read_bounded`. ValueError: not JSON.
    """
    return parse_json(read_bounded(path, limit))


def bounded_lines(f: BinaryIO, max_line: int = MAX_LINE) -> Iterator[str]:
    """The lines of the binary file ``f`` from its position on, as text (bad bytes replaced, newline kept), skipping
    any line longer than ``max_line`` bytes unheld (read in ``max_line`` pieces up to its end). Memory: one line of at
    most ``max_line`` bytes; time: linear in the bytes read."""
    while line := f.readline(max_line + 1):
        if len(line) > max_line and not line.endswith(b"\n"):
            while (rest := f.readline(max_line)) and not rest.endswith(b"\n"):
                pass
            continue
        yield line.decode("utf-8", errors="replace")


class OutputRefusedError(OpskitError):
    """An output target that exists and is not opskit's to replace (or ``--force`` was not given)."""


def staging_path(path: Path) -> Path:
    """Hidden per-process temporary name next to ``path`` (same file system, so the rename is atomic)."""
    return path.with_name(f".{path.name}-{os.getpid()}")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, which ``kill -0`` still finds, counts as dead): the test
    of whether a lock or a hidden staging folder named after its writer's pid is stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; ``mode`` default: an existing
    file's mode is kept (a new file gets the umask's)."""
    path = Path(path)
    staging = staging_path(path)
    if mode is None and path.is_file():
        mode = path.stat().st_mode & 0o7777
    try:
        staging.write_text(text, encoding="utf-8")
        if mode is not None:
            staging.chmod(mode)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def append_lines(path: Path, lines: Iterable[str]) -> None:
    """Append ``lines`` (each ended with a newline here) to ``path`` in one O_APPEND write, creating it (0644): other
    writers' lines (a rank's output, another task's ledger record) never interleave with them mid-line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
    finally:
        os.close(fd)


def write_marker(folder: Path, what: str, entries: Iterable[str] | None = None, source: dict | None = None,
                 digests: str | None = None) -> None:
    """Mark ``folder`` as written by opskit's ``what`` (e.g. ``"ckpt convert"``): ``<folder>/.opskit``.

    Args:
        entries: for a folder the command writes whole, the relative paths of the files it wrote (``--force`` may
            replace the folder only while it holds nothing else); None for a folder whose contents grow (a run
            directory), which is never replaced.
        source: what the folder was made from (JSON-able), for the command's own up-to-date test.
        digests: ``"sha256"``: also record each entry's size (bytes) and SHA-256 (``files``), which
            :func:`damaged_entries` checks: a folder that is reused rather than rebuilt must prove its bytes intact,
            not only present; ``"size"``: the sizes alone (a folder of terabytes, where hashing would cost more than
            rebuilding: a deleted or truncated file is still told).
    """
    marker = {"written_by": "opskit", "command": what, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if entries is not None:
        marker["entries"] = sorted(entries)
        if digests not in (None, "size", "sha256"):
            raise ValueError(f"digests={digests!r}: expected None, 'size' or 'sha256'")
        if digests:
            marker["files"] = {name: {"size": (Path(folder) / name).stat().st_size,
                                      **({"sha256": file_sha256(Path(folder) / name)} if digests == "sha256" else {})}
                               for name in marker["entries"]}
    if source is not None:
        marker["source"] = source
    atomic_write_text(Path(folder) / MARKER, json.dumps(marker) + "\n")


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 8 MiB blocks.

    Raises:
        OSError: the file is unreadable.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def damaged_entries(folder: Path, marker: dict) -> list[str] | None:
    """The entries of ``folder`` whose bytes are not those ``marker`` recorded (:func:`write_marker` with
    ``digests``), each as ``"name (why)"``: missing, another size, or another SHA-256 (read only where the sizes
    agree and one was recorded); [] when all hold, None when the marker records no digests (an older opskit's:
    nothing to prove)."""
    files = marker.get("files")
    if not isinstance(files, dict) or set(files) != set(marker.get("entries") or ()):
        return None
    folder, damaged, same_size = Path(folder), [], []
    for name, recorded in sorted(files.items()):
        path = folder / name
        if not isinstance(recorded, dict) or path.is_symlink() or not path.is_file():
            damaged.append(f"{name} (missing)")
        elif (size := path.stat().st_size) != recorded.get("size"):
            damaged.append(f"{name} ({size} bytes, {recorded.get('size')} written)")
        else:
            same_size.append((name, path, recorded))
    for name, path, recorded in same_size:  # the cheap test first: a damaged folder is told without hashing it all
        if "sha256" not in recorded:
            continue
        try:
            if file_sha256(path) != recorded.get("sha256"):
                damaged.append(f"{name} (bytes changed: SHA-256 differs)")
        except OSError as e:
            damaged.append(f"{name} (unreadable: {e.strerror})")
    return damaged


def folder_entries(folder: Path) -> list[str]:
    """Relative paths of the files below ``folder`` (the marker excluded): what :func:`write_marker` lists."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if not p.is_dir() and p.relative_to(folder) != Path(MARKER))


def read_marker(folder: Path) -> dict | None:
    """The marker opskit wrote in ``folder`` (a JSON object with ``written_by: opskit``), else None."""
    try:
        marker = read_json(Path(folder) / MARKER)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == "opskit" else None


def has_marker(folder: Path, command: str | None = None) -> bool:
    """True when ``folder/.opskit`` is a marker opskit wrote (and, given ``command``, that command wrote it)."""
    marker = read_marker(folder)
    return marker is not None and (command is None or marker.get("command") == command)


def unlisted_entries(folder: Path, marker: dict) -> list[str]:
    """Paths below ``folder`` that ``marker`` does not list (folders named once, not their contents); every path
    when the marker lists none (a growing folder, or a marker of an older opskit)."""
    folder = Path(folder)
    listed = set(marker.get("entries") or ())
    listed_dirs = {str(parent) for entry in listed for parent in Path(entry).parents}
    extra: list[str] = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if relative == Path(MARKER) or any(str(p) in extra for p in relative.parents):
            continue
        if str(relative) not in (listed_dirs if path.is_dir() and not path.is_symlink() else listed):
            extra.append(str(relative))
    return extra


def brief(names: list[str], most: int = 5) -> str:
    """The first ``most`` of ``names``, comma-separated, and how many more there are: what one refusal line names."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def claim_dir(target: Path, force: bool, flag: str = "--out", command: str | None = None) -> None:
    """Check that ``target`` may become (or be replaced by) an output folder of opskit's ``command``.

    Allowed: a missing path, an empty folder, or -- with ``force`` -- a folder whose :data:`MARKER` says ``command``
    wrote it and which holds nothing beyond the entries the marker lists (``command`` None: any marker, for callers
    that only add files).

    Raises:
        OutputRefusedError: ``target`` is a file or another non-folder, a non-empty folder without the marker (even
            with ``force``: opskit did not write it), a marked folder without ``force``, one another command wrote,
            or one holding entries its marker does not list (named: they would be lost); a target named ``.``,
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
    marker = read_marker(target)
    if marker is None:
        raise OutputRefusedError(f"{target}: exists and holds files opskit did not write; choose another {flag} "
                                 "(opskit never deletes what it did not write)")
    if command is not None and marker.get("command") != command:
        raise OutputRefusedError(f"{target}: written by `opskit {marker.get('command')}`, not `opskit {command}`; "
                                 f"choose another {flag} (opskit never replaces another command's folder)")
    if not force:
        raise OutputRefusedError(f"{target}: exists (written by opskit earlier); --force replaces it")
    if command is not None and (extra := unlisted_entries(target, marker)):
        raise OutputRefusedError(f"{target}: holds entries opskit did not write ({brief(extra)}); --force would delete "
                                 f"them: move them away or choose another {flag}")


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
    mode is kept), or opskit's own folder holding only the entries its marker lists (moved aside, then removed).
    ``staging`` gets the usual mode for a new folder (0777 less the umask; ``tempfile.mkdtemp`` makes it 0700).
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
    marker = read_marker(target)  # claim_dir refused anything else already; never remove what opskit did not write
    if marker is None or "entries" not in marker or unlisted_entries(target, marker):
        raise OutputRefusedError(f"{target}: exists and holds files opskit did not write; not replaced")
    old = target.with_name(f".{target.name}-old-{os.getpid()}")
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
