"""``hf://[datasets/|spaces/]org/repo[/path]``: a Hugging Face Hub repository through huggingface_hub's ``HfApi``.

A batch is ONE commit (``create_commit`` with a ``CommitOperationAdd`` per file), so a sync publishes all its files or
none; large files go through the library's LFS/Xet path. The token is ``HF_TOKEN`` or the standard login
(``huggingface_hub.get_token``); it travels only in the library's Authorization header, never in a URL, and every
error message is scrubbed of it. ``HF_ENDPOINT`` points the client at another server (a mirror, or the tests'
stand-in). Reads (``read_from``) are HTTP range requests on the file's ``resolve`` URL.

huggingface_hub (the ``hub`` extra) is imported inside the methods: :mod:`opskit.targets` imports this module for
every target, ``file://`` ones included.
"""

from __future__ import annotations

import os
from pathlib import Path

from opskit.targets.base import BatchResult, TargetError, TargetOptions, TargetUnavailable, decoded, with_retries

REPO_TYPES = {"datasets": "dataset", "spaces": "space", "models": "model"}


def parse_hf_url(url: str) -> tuple[str, str, str]:
    """(repo type, ``org/repo``, path prefix in the repo) of ``hf://[datasets/]org/repo[/path]``.

    Raises:
        TargetError: fewer than two name parts.
    """
    parts = [p for p in url[len("hf://"):].split("/") if p]
    repo_type = REPO_TYPES.get(parts[0], "model") if parts else "model"
    if parts and parts[0] in REPO_TYPES:
        parts = parts[1:]
    if len(parts) < 2:
        raise TargetError(f"{url}: expected hf://[datasets/]org/repo[/path]")
    return repo_type, f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


class HfTarget:
    """Files of a Hub repository (branch ``main``) under an optional path; keys are relative to that path."""

    def __init__(self, url: str, options: TargetOptions):
        try:
            from huggingface_hub import HfApi, get_token
        except ImportError:
            raise TargetUnavailable.of("huggingface_hub", f"hf:// targets: {url}") from None
        self.url, self.options = url, options
        self.repo_type, self.repo_id, self.prefix = parse_hf_url(url)
        self._api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=get_token())
        self._created = False

    def _path(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retry(self, call, what: str):
        return with_retries(call, f"{self.url}: {what}", self.options)

    def _ensure_repo(self) -> None:
        if self.options.create_repo and not self._created:
            self._retry(lambda: self._api.create_repo(self.repo_id, repo_type=self.repo_type,
                                                      private=self.options.private, exist_ok=True), "create repo")
            self._created = True

    def _commit(self, operations: list, message: str) -> str:
        """Create one commit on ``main``; its id.

        Raises:
            TargetError: after retries; a missing repository (or one the token cannot write) says so.
        """
        self._ensure_repo()
        try:
            info = self._retry(lambda: self._api.create_commit(self.repo_id, operations=operations,
                                                               commit_message=message, repo_type=self.repo_type),
                               "commit")
        except TargetError as e:
            if e.status == 404:
                raise TargetError(f"{self.url}: repository {self.repo_id} not found or not writable with this token; "
                                  "create it, or set sync.create_repo: true in the spec", 404) from None
            raise
        return info.oid

    def commit_files(self, files: dict[str, Path | bytes], message: str, delete: list[str] = ()) -> str:
        """One commit adding ``files`` (key -> local file or bytes) and deleting ``delete`` keys; its commit id.

        Raises:
            TargetError: as :meth:`_commit`.
        """
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        operations = [CommitOperationAdd(self._path(key), data if isinstance(data, bytes) else str(data))
                      for key, data in files.items()]
        operations += [CommitOperationDelete(self._path(key)) for key in delete]
        return self._commit(operations, message)

    def tags(self) -> set[str]:
        """Tag names of the repository (none when it does not exist yet)."""
        try:
            refs = self._retry(lambda: self._api.list_repo_refs(self.repo_id, repo_type=self.repo_type), "list tags")
        except TargetError as e:
            if e.status == 404:
                return set()
            raise
        return {t.name for t in refs.tags}

    def tag(self, name: str, revision: str) -> None:
        """Tag commit ``revision`` as ``name`` (an existing tag of that name is left as it is)."""
        self._retry(lambda: self._api.create_tag(self.repo_id, tag=name, revision=revision, repo_type=self.repo_type,
                                                 exist_ok=True), f"tag {name}")

    def size(self, key: str) -> int | None:
        infos = self._retry(lambda: self._api.get_paths_info(self.repo_id, [self._path(key)],
                                                             repo_type=self.repo_type), f"stat {key}")
        return infos[0].size if infos else None

    def crc32c(self, key: str) -> str | None:
        return None  # the Hub keeps sha256 (LFS) or git blob ids, not CRC32C

    def put(self, local: Path, key: str) -> None:
        self.put_batch({key: local}, f"opskit: upload {key}")

    def put_batch(self, files: dict[str, Path], message: str) -> BatchResult:
        """One commit with every file; all published or none (then every key is in ``failed``)."""
        try:
            self.commit_files(dict(files), message)
        except TargetError as e:
            return BatchResult([], dict.fromkeys(files, str(e)))
        return BatchResult(list(files), {})

    def read_text(self, key: str) -> str | None:
        return decoded(self.url, key, self.read_from(key, 0))

    def read_from(self, key: str, offset: int) -> bytes | None:
        """Bytes of ``main``'s file from ``offset`` on (``Range: bytes=offset-``); b"" past the end, None missing."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        url = hf_hub_url(self.repo_id, self._path(key), repo_type=self.repo_type, endpoint=self._api.endpoint)
        headers = {**build_hf_headers(token=self._api.token), "Range": f"bytes={offset}-"}

        def read() -> bytes | None:
            response = get_session().get(url, headers=headers, follow_redirects=True)
            if response.status_code == 416:
                return b""
            if response.status_code == 404:
                return None
            response.raise_for_status()
            # A server that ignores Range answers 200 with the whole file.
            return response.content[offset:] if response.status_code == 200 else response.content

        return self._retry(read, f"read {key}")

    def write_text(self, key: str, text: str) -> None:
        self.commit_files({key: text.encode()}, f"opskit: write {key}")

    def keys(self, prefix: str = "") -> list[str]:
        try:
            files = self._retry(lambda: self._api.list_repo_files(self.repo_id, repo_type=self.repo_type),
                                "list files")
        except TargetError as e:
            if e.status == 404:
                return []
            raise
        base, strip = self._path(prefix), len(self.prefix) + 1 if self.prefix else 0
        return sorted(f[strip:] for f in files if f.startswith(base))

    def delete(self, keys: list[str], message: str) -> None:
        if keys:
            self.commit_files({}, message, delete=keys)

