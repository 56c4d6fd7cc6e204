"""``file:///abs/path``: a folder (a mounted share) as a target."""

from __future__ import annotations

import shutil
from pathlib import Path

from opskit.fsutil import atomic_write_text, open_regular, read_bounded, staging_path
from opskit.targets.base import BatchResult, TargetError, TargetOptions, crc32c_of_file, decoded, put_parallel


class FileTarget:
    """A folder (``file:///abs/path``): objects are files, written to a temporary name and renamed into place. The
    folder may hold other files: the callers (backup, sync) decide which keys are theirs to write and delete; folders
    are created with the umask's mode, existing ones are never re-moded."""

    def __init__(self, url: str, root: Path, options: TargetOptions | None = None):
        self.url, self.root, self.options = url, root, options or TargetOptions()

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
        staging = staging_path(destination)
        try:
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(local, staging)
                staging.replace(destination)
            finally:
                staging.unlink(missing_ok=True)
        except OSError as e:  # a full share, a file where a folder should be: the key fails, in one line
            raise TargetError(f"{self.url.rstrip('/')}/{key}: {e.strerror or e}") from None

    def put_batch(self, files: dict[str, Path], message: str) -> BatchResult:
        return put_parallel(self, files, self.options.workers)

    def read_text(self, key: str) -> str | None:
        """The object's text, None when there is none; bounded (:func:`opskit.fsutil.read_bounded`: ``latest`` and
        manifests are small).

        Raises:
            TargetError: a folder, device or FIFO at the key, a file past the bound, unreadable, or not UTF-8.
        """
        try:
            data = read_bounded(self._path(key))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TargetError(f"{self.url.rstrip('/')}/{key}: {e.strerror or e}") from None
        return decoded(self.url, key, data)

    def read_from(self, key: str, offset: int) -> bytes | None:
        """The object's bytes from ``offset`` (whole: a checkpoint file being restored), None when there is none.

        Raises:
            TargetError: a folder, device or FIFO at the key (``/dev/zero`` would never end), or unreadable.
        """
        try:
            with open_regular(self._path(key)) as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TargetError(f"{self.url.rstrip('/')}/{key}: {e.strerror or e}") from None

    def folder_problem(self) -> str | None:
        """Why the target's root cannot hold a backup (it exists and is no folder: ``file:///dev/null``), or None."""
        if self.root.exists() and not self.root.is_dir():
            return f"{self.root} exists and is not a folder"
        parent = next((p for p in self.root.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            return f"{parent} is not a folder"
        return None

    def delete(self, keys: list[str], message: str) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def write_text(self, key: str, text: str) -> None:
        self._path(key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self._path(key), text)

    def keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()
                      and not p.name.startswith("."))
