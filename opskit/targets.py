"""Where opskit copies files to: one small interface shared by ``opskit sync`` and ``opskit ckpt backup``.

A target stores objects under string keys (``logs/main_log.txt``, ``global_step100/layer_01-model_00-model_states.pt``)
and can say an object's size and CRC32C. ``file:///abs/path`` (a mounted share) is implemented here; ``gs://bucket/prefix``
(google-cloud-storage, whose objects carry a CRC32C already) and ``hf://`` plug in as further classes and a branch in
:func:`open_target`.

CRC32C is written as Google Cloud Storage writes it (base64 of the big-endian 32-bit value), so a manifest made here
can be checked against GCS object metadata without reading the objects.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from opskit.fsutil import atomic_write_text, staging_path

CHUNK = 8 * 1024 * 1024


class TargetError(ValueError):
    """A target URL that is malformed or whose scheme is not implemented; one line."""


class Target(Protocol):
    """What a copy needs from a destination. Keys use ``/``; ``put`` and ``write_text`` are atomic (a reader never
    sees a half-written object under its key)."""

    url: str

    def size(self, key: str) -> int | None: ...

    def crc32c(self, key: str) -> str | None: ...

    def put(self, local: Path, key: str) -> None: ...

    def read_text(self, key: str) -> str | None: ...

    def write_text(self, key: str, text: str) -> None: ...

    def keys(self, prefix: str = "") -> list[str]: ...


def crc32c_of_file(path: str | Path) -> str:
    """CRC32C of a file's bytes, base64 of the big-endian value (GCS's ``crc32c`` object field), read in 8 MB
    chunks."""
    try:
        import google_crc32c
    except ImportError:
        raise TargetError("CRC32C needs the google-crc32c package: pip install 'opskit[backup]'") from None
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode()


class FileTarget:
    """A folder (``file:///abs/path``): objects are files, written to a temporary name and renamed into place."""

    def __init__(self, url: str, root: Path):
        self.url, self.root = url, root

    def _path(self, key: str) -> Path:
        return self.root / key

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def crc32c(self, key: str) -> str | None:
        path = self._path(key)
        return crc32c_of_file(path) if path.is_file() else None

    def put(self, local: Path, key: str) -> None:
        destination = self._path(key)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_path(destination)
        try:
            shutil.copy2(local, staging)
            staging.replace(destination)
        finally:
            staging.unlink(missing_ok=True)

    def read_text(self, key: str) -> str | None:
        path = self._path(key)
        return path.read_text() if path.is_file() else None

    def write_text(self, key: str, text: str) -> None:
        self._path(key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self._path(key), text)

    def keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()
                      and not p.name.startswith("."))


def open_target(url: str, option: str = "--to") -> Target:
    """The target for ``url``.

    Raises:
        TargetError: malformed URL, or a scheme not implemented yet (gs://, hf://), naming ``option``.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost") and parsed.path.startswith("/"):
        return FileTarget(url, Path(parsed.path))
    if parsed.scheme in ("gs", "hf"):
        raise TargetError(f"{option} {url}: {parsed.scheme}:// targets are not implemented yet; expected "
                          "file:///absolute/path")
    raise TargetError(f"{option} {url}: expected file:///absolute/path (hf:// and gs:// targets are not implemented "
                      "yet)")
