"""Where opskit copies files to: one small interface shared by ``opskit sync``, ``opskit ckpt backup/verify`` and
``opskit logs tail --remote``.

A target stores objects under string keys (``logs/main_log.txt``, ``global_step100/layer_01-model_00-model_states.pt``)
and can say an object's size and CRC32C. ``file:///abs/path`` (a mounted share) is implemented here,
``gs://bucket/prefix`` in :mod:`opskit.targets.gcs` and ``hf://[datasets/]org/repo[/path]`` in
:mod:`opskit.targets.hf`; both import their client library only when opened (the hourly sync stays light).

Network failures, HTTP 429 and 5xx are retried with exponential back-off (:func:`with_retries`); whatever still fails
becomes a one-line :class:`TargetError` with secrets scrubbed out (:func:`scrub`).

CRC32C is written as Google Cloud Storage writes it (base64 of the big-endian 32-bit value), so a manifest made here
can be checked against GCS object metadata without reading the objects.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlparse

from opskit.fsutil import atomic_write_text, staging_path

CHUNK = 8 * 1024 * 1024


class TargetError(ValueError):
    """A malformed target URL, or a transfer that failed (after its retries); one line, secrets scrubbed.
    ``status``: the HTTP status of the failed request, when there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TargetOptions:
    """How a target is used: ``workers`` parallel transfers (gs://, file://); ``create_repo`` (hf://: create the
    repository when missing, ``private`` or public); ``retries`` attempts after the first and the first back-off in
    seconds (doubled each time) for network errors, 429 and 5xx."""

    workers: int = 8
    create_repo: bool = False
    private: bool = True
    retries: int = 4
    backoff_s: float = 2.0


@dataclass
class BatchResult:
    """What :meth:`Target.put_batch` did: keys published, and key -> one-line reason for those that were not."""

    done: list[str]
    failed: dict[str, str]


class Target(Protocol):
    """What a copy needs from a destination. Keys use ``/``; ``put``, ``put_batch`` and ``write_text`` are atomic per
    object (a reader never sees a half-written object under its key)."""

    url: str

    def size(self, key: str) -> int | None: ...

    def crc32c(self, key: str) -> str | None: ...

    def put(self, local: Path, key: str) -> None: ...

    def put_batch(self, files: dict[str, Path], message: str) -> BatchResult: ...

    def read_text(self, key: str) -> str | None: ...

    def read_from(self, key: str, offset: int) -> bytes | None: ...

    def write_text(self, key: str, text: str) -> None: ...

    def keys(self, prefix: str = "") -> list[str]: ...

    def delete(self, keys: list[str], message: str) -> None: ...


_T = TypeVar("_T")
# (pattern, replacement): an HF token's shape, and the value after bearer/token/authorization.
_TOKEN_PATTERNS = ((re.compile(r"hf_[A-Za-z0-9]{8,}"), "***"),
                   (re.compile(r"(?i)\b(bearer|token|authorization)([=: ]+)[^\s'\",}]+"), r"\1\2***"))


def secrets() -> list[str]:
    """Secret values of this environment that must never be shown: the Hugging Face token (``HF_TOKEN`` or the
    stored login) when one is set."""
    values = [os.environ.get("HF_TOKEN", ""), os.environ.get("HUGGING_FACE_HUB_TOKEN", "")]
    try:
        from huggingface_hub import get_token

        values.append(get_token() or "")
    except ImportError:
        pass
    return [v for v in values if len(v) >= 4]


def scrub(text: str, extra: Iterable[str] = ()) -> str:
    """``text`` with every known secret, anything shaped like an HF token and ``Bearer``/``token=`` values replaced
    by ``***``, on one line."""
    for value in [*secrets(), *extra]:
        if value:
            text = text.replace(value, "***")
    for pattern, replacement in _TOKEN_PATTERNS:
        text = pattern.sub(replacement, text)
    return " ".join(text.split())


def status_of(error: BaseException) -> int | None:
    """The HTTP status an exception of google-cloud-storage (``.code``), huggingface_hub / requests / httpx
    (``.response.status_code``) carries, else None."""
    code = getattr(error, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_transient(error: BaseException) -> bool:
    """Worth retrying: HTTP 408/429/5xx, or a network error (connection refused or reset, timeout) of any client."""
    status = status_of(error)
    if status is not None:
        return status in (408, 429) or status >= 500
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"ConnectionError", "TimeoutError", "Timeout", "TransportError", "ChunkedEncodingError",
                         "RemoteDisconnected", "ProtocolError"})


def with_retries(call: Callable[[], _T], what: str, options: TargetOptions,
                 sleep: Callable[[float], None] = time.sleep) -> _T:
    """``call()``, retried ``options.retries`` times on transient errors with back-off ``backoff_s``, 2x, 4x...

    Raises:
        TargetError: the last error (or the first permanent one), as ``what: reason`` with secrets scrubbed.
    """
    for attempt in range(options.retries + 1):
        try:
            return call()
        except TargetError:
            raise
        except Exception as e:  # noqa: BLE001 - every client library has its own error types; all end here
            if not is_transient(e) or attempt == options.retries:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise TargetError(scrub(f"{what}: {describe(e)}{tries}"), status_of(e)) from None
            sleep(options.backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")


_MORE_INFO = re.compile(r"For more information check: \S+")  # httpx's pointer to MDN, noise in a one-line error


def describe(error: BaseException, limit: int = 400) -> str:
    """A short reason on one line: HTTP status and the message (the server's own explanation included), cut at
    ``limit`` characters. Not scrubbed: callers pass it through :func:`scrub`."""
    status = status_of(error)
    text = " ".join(_MORE_INFO.sub("", str(error)).split()) or type(error).__name__
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"HTTP {status}: {text}" if status and str(status) not in text else text


def put_parallel(target: Target, files: dict[str, Path], workers: int) -> BatchResult:
    """``target.put`` of every file on ``workers`` threads; one failure does not stop the others."""
    result = BatchResult([], {})
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {key: pool.submit(target.put, path, key) for key, path in files.items()}
        for key, future in futures.items():
            try:
                future.result()
                result.done.append(key)
            except TargetError as e:
                result.failed[key] = str(e)
    return result


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
        path = self._path(key)
        return path.read_text() if path.is_file() else None

    def read_from(self, key: str, offset: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
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


def open_target(url: str, option: str = "--to", options: TargetOptions | None = None) -> Target:
    """The target for ``url``; gs:// and hf:// import their client library here, and make no request yet.

    Raises:
        TargetError: malformed URL or unknown scheme, naming ``option``; a missing client library.
    """
    check_url(url, option)
    parsed = urlparse(url)
    options = options or TargetOptions()
    if parsed.scheme == "gs":
        from opskit.targets.gcs import GcsTarget

        return GcsTarget(url, parsed.netloc, parsed.path.strip("/"), options)
    if parsed.scheme == "hf":
        from opskit.targets.hf import HfTarget

        return HfTarget(url, options)
    return FileTarget(url, Path(parsed.path), options)


def check_url(url: str, option: str = "--to") -> None:
    """Refuse a malformed target URL without opening it (no import, no request).

    Raises:
        TargetError: one line naming ``option`` and the expected forms.
    """
    parsed = urlparse(url)
    ok = {"file": parsed.netloc in ("", "localhost") and parsed.path.startswith("/"),
          "gs": bool(parsed.netloc) and "@" not in parsed.netloc,
          "hf": "@" not in parsed.netloc and len(_hf_parts(url)) >= 2}
    if not ok.get(parsed.scheme, False):
        raise TargetError(f"{option} {scrub(url)}: expected file:///absolute/path, gs://bucket/prefix or "
                          "hf://[datasets/]org/repo[/path]")


def _hf_parts(url: str) -> list[str]:
    rest = url[len("hf://"):].strip("/").split("/")
    return rest[1:] if rest and rest[0] in ("datasets", "spaces", "models") else rest
