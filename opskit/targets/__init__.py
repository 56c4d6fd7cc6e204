"""Where opskit copies files to: one small interface shared by ``opskit sync``, ``opskit ckpt backup/verify`` and
``opskit logs tail --remote``; this module opens a target by its URL.

A target stores objects under string keys (``logs/main_log.txt``, ``global_step100/layer_01-model_00-model_states.pt``)
and can say an object's size and CRC32C (the interface, errors, retries and scrubbing: :mod:`opskit.targets.base`).
``file:///abs/path`` (a mounted share) is :mod:`opskit.targets.file`, ``gs://bucket/prefix`` :mod:`opskit.targets.gcs`
and ``hf://[datasets/]org/repo[/path]`` :mod:`opskit.targets.hf`; the last two import their client library only when
opened (the hourly sync stays light).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from opskit.targets.base import Target, TargetError, TargetOptions, scrub
from opskit.targets.file import FileTarget
from opskit.targets.gcs import GcsTarget
from opskit.targets.hf import HfTarget


def open_target(url: str, option: str = "--to", options: TargetOptions | None = None) -> Target:
    """The target for ``url``; gs:// and hf:// import their client library here, and make no request yet.

    Raises:
        TargetError: malformed URL or unknown scheme, naming ``option``; a missing client library.
    """
    check_url(url, option)
    parsed = urlparse(url)
    options = options or TargetOptions()
    if parsed.scheme == "gs":
        return GcsTarget(url, parsed.netloc, parsed.path.strip("/"), options)
    if parsed.scheme == "hf":
        return HfTarget(url, options)
    return FileTarget(url, Path(unquote(parsed.path)), options)  # file:///my%20backups is "/my backups"


def check_url(url: str, option: str = "--to") -> None:
    """Refuse a malformed target URL without opening it (no import, no request).

    Raises:
        TargetError: one line naming ``option`` and the expected forms; a file:// URL with a query (``?x=1``) or a
            fragment (``#frag``), which name no other folder (``%3F``, ``%23`` spell those characters in a name).
    """
    parsed = urlparse(url)
    if parsed.scheme == "file" and (parsed.query or parsed.fragment or parsed.params or url.endswith(("?", "#"))):
        raise TargetError(f"{option} {scrub(url)}: a file:// URL names a folder, without ?query or #fragment (a "
                          "'?' or '#' in a folder's name is written %3F or %23)")
    ok = {"file": parsed.netloc in ("", "localhost") and parsed.path.startswith("/"),
          "gs": bool(parsed.netloc) and "@" not in parsed.netloc,
          "hf": "@" not in parsed.netloc and len(_hf_parts(url)) >= 2}
    if not ok.get(parsed.scheme, False):
        raise TargetError(f"{option} {scrub(url)}: expected file:///absolute/path, gs://bucket/prefix or "
                          "hf://[datasets/]org/repo[/path]")


def _hf_parts(url: str) -> list[str]:
    rest = url[len("hf://"):].strip("/").split("/")
    return rest[1:] if rest and rest[0] in ("datasets", "spaces", "models") else rest
