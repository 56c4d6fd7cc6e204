"""What every target shares: the :class:`Target` interface, its errors, retries with back-off, secret scrubbing and
CRC32C as GCS writes it.

Network failures, HTTP 429 and 5xx are retried with exponential back-off (:func:`with_retries`); whatever still fails
becomes a one-line :class:`TargetError` with secrets scrubbed out (:func:`scrub`).

CRC32C is written as Google Cloud Storage writes it (base64 of the big-endian 32-bit value), so a manifest made here
can be checked against GCS object metadata without reading the objects.
"""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from opskit.errors import MissingExtraError, OpskitError

CHUNK = 8 * 1024 * 1024


class TargetError(OpskitError, ValueError):
    """A malformed target URL, or a transfer that failed (after its retries); one line, secrets scrubbed.
    ``status``: the HTTP status of the failed request, when there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class TargetUnavailable(MissingExtraError, TargetError):
    """The client library a target needs (an optional extra) is not installed here; one line naming the extra
    (:func:`opskit.errors.missing_module_message`)."""


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
        from huggingface_hub import get_token  # optional (hub extra), and heavy: only to scrub its stored token

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


def decoded(url: str, key: str, data: bytes | None) -> str | None:
    """An object's bytes as text (None stays None: a missing object), for every target's ``read_text``.

    Raises:
        TargetError: not UTF-8 (a ``latest`` or manifest overwritten with binary), naming the object.
    """
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        more = "..." if len(data) > 16 else ""
        raise TargetError(f"{url.rstrip('/')}/{key}: not UTF-8 text ({len(data)} bytes: {data[:16]!r}{more})") \
            from None


def crc32c_of_file(path: str | Path) -> str:
    """CRC32C of a file's bytes, base64 of the big-endian value (GCS's ``crc32c`` object field), read in 8 MB
    chunks."""
    try:
        import google_crc32c  # optional (backup extra)
    except ImportError:
        raise TargetUnavailable.of("google_crc32c", "CRC32C checksums") from None
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode()
