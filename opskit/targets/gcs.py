"""``gs://bucket/prefix``: Google Cloud Storage through google-cloud-storage.

Credentials come the usual way (``GOOGLE_APPLICATION_CREDENTIALS`` or Application Default Credentials); with
``STORAGE_EMULATOR_HOST`` set (a local emulator) the client is anonymous. Uploads are resumable (8 MiB chunks) and
checked with CRC32C both by the library during the upload and against the stored object's ``crc32c`` afterwards; a
mismatch is an error, retried like a network failure. Each thread has its own client (a client's HTTP session is not
shared across threads).

The library (the ``gcs`` extra) is imported inside the methods: :mod:`opskit.targets` imports this module for every
target, ``file://`` ones included.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from opskit.targets.base import (
    BatchResult,
    TargetOptions,
    TargetUnavailable,
    crc32c_of_file,
    decoded,
    put_parallel,
    with_retries,
)

CHUNK_SIZE = 8 * 1024 * 1024  # resumable upload chunk (a multiple of 256 KiB, as the API requires)


class ChecksumMismatch(ConnectionError):
    """The stored object's CRC32C is not the local file's: a corrupted transfer, retried like a network error."""


class GcsTarget:
    """Objects under ``gs://bucket/prefix/``; keys are relative to the prefix."""

    def __init__(self, url: str, bucket: str, prefix: str, options: TargetOptions):
        try:
            import google.cloud.storage  # noqa: F401 - fail here, in one line, not at the first upload
        except ImportError:
            raise TargetUnavailable.of("google.cloud.storage", f"gs:// targets: {url}") from None
        self.url, self.bucket_name, self.prefix, self.options = url, bucket, prefix, options
        self._local = threading.local()

    def _bucket(self):
        if not hasattr(self._local, "bucket"):
            from google.cloud import storage

            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "emulator"),
                                        credentials=AnonymousCredentials())
            else:
                client = storage.Client()
            self._local.bucket = client.bucket(self.bucket_name)
        return self._local.bucket

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retry(self, call, what: str):
        return with_retries(call, f"{self.url}: {what}", self.options)

    def _blob_or_none(self, key: str):
        return self._retry(lambda: self._bucket().get_blob(self._name(key)), f"stat {key}")

    def size(self, key: str) -> int | None:
        blob = self._blob_or_none(key)
        return None if blob is None else blob.size

    def crc32c(self, key: str) -> str | None:
        blob = self._blob_or_none(key)
        return None if blob is None else blob.crc32c

    def put(self, local: Path, key: str) -> None:
        expected = crc32c_of_file(local)

        def upload() -> None:
            size = local.stat().st_size  # small files: one multipart request; large: resumable 8 MiB chunks
            blob = self._bucket().blob(self._name(key), chunk_size=CHUNK_SIZE if size > CHUNK_SIZE else None)
            blob.upload_from_filename(str(local), checksum="crc32c", retry=None)
            if blob.crc32c != expected:
                raise ChecksumMismatch(f"stored CRC32C {blob.crc32c}, local {expected}")

        self._retry(upload, f"upload {key}")

    def put_batch(self, files: dict[str, Path], message: str) -> BatchResult:
        return put_parallel(self, files, self.options.workers)

    def read_text(self, key: str) -> str | None:
        return decoded(self.url, key, self.read_from(key, 0))

    def read_from(self, key: str, offset: int) -> bytes | None:
        """Bytes from ``offset`` to the end (one range request); b"" when nothing is past it, None when missing."""
        from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

        def read() -> bytes | None:
            try:
                return self._bucket().blob(self._name(key)).download_as_bytes(start=offset or None, checksum=None)
            except NotFound:
                return None
            except RequestRangeNotSatisfiable:
                return b""

        return self._retry(read, f"read {key}")

    def write_text(self, key: str, text: str) -> None:
        self._retry(lambda: self._bucket().blob(self._name(key)).upload_from_string(text, checksum="crc32c"),
                    f"write {key}")

    def keys(self, prefix: str = "") -> list[str]:
        base = self._name(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        blobs = self._retry(lambda: list(self._bucket().client.list_blobs(self.bucket_name, prefix=base, retry=None)),
                            f"list {prefix or '/'}")
        return sorted(b.name[strip:] for b in blobs)

    def delete(self, keys: list[str], message: str) -> None:
        for key in keys:
            self._retry(lambda key=key: self._bucket().blob(self._name(key)).delete(), f"delete {key}")
