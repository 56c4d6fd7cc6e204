"""The manifest ``opskit ckpt backup`` writes beside each step it copies (``manifests/global_stepN.json``: its shape
is :mod:`opskit.ckpt.backup`'s module docstring), read here for the commands below the backup tools too: a weights-only
backup's step folder is read in place by ``ckpt convert``/``inspect``/``check`` (:func:`weights_only_copy`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from opskit.fsutil import read_json

if TYPE_CHECKING:
    from opskit.ckpt.format.info import StepInfo

MANIFEST_SHAPE = "expected JSON {step, complete, files: [{path, size, crc32c}]}"


def is_manifest(manifest, tag: str) -> bool:
    """Whether ``manifest`` (parsed JSON) has the shape :mod:`opskit.ckpt.backup` writes for step ``tag``;
    ``source`` may be absent (an older opskit), not malformed."""
    def entry_ok(e) -> bool:
        return isinstance(e, dict) and isinstance(e.get("path"), str) and type(e.get("size")) is int \
            and isinstance(e.get("crc32c"), str)

    if not isinstance(manifest, dict):
        return False
    source = manifest.get("source")
    return manifest.get("step") == tag and isinstance(manifest.get("complete"), bool) \
        and isinstance(manifest.get("files"), list) and all(entry_ok(e) for e in manifest["files"]) \
        and (source is None and "source" not in manifest or isinstance(source, dict)
             and isinstance(source.get("dir"), str))


def weights_only_copy(info: StepInfo) -> bool:
    """Whether an incomplete step folder is a weights-only backup's copy that lacks only what the backup left out:
    ``<root>/global_stepN`` whose ``<root>/manifests/global_stepN.json`` is opskit's, complete and ``weights_only``,
    its ``left_out`` names exactly the optimizer shards the step's layout needs and the folder lacks
    (``info.absent_optimizer``), every other file is there and readable (``info.weights_problems`` empty), and every
    file the manifest lists is there with its size (no read: ``ckpt check`` reads the CRC-32s). Such a folder serves
    ``ckpt convert``/``inspect``/``check`` (the weights); it is not complete and cannot resume. Never raises: an
    unreadable manifest is no such copy."""
    folder = info.path
    if not info.absent_optimizer or info.weights_problems:
        return False
    try:
        manifest = read_json(folder.parent / "manifests" / f"{folder.name}.json")
    except (OSError, ValueError):  # missing, not JSON, not text
        return False
    if not (is_manifest(manifest, folder.name) and manifest["complete"] and manifest.get("weights_only") is True):
        return False
    left_out = manifest.get("left_out")
    if not (isinstance(left_out, list) and all(isinstance(name, str) for name in left_out)
            and sorted(left_out) == sorted(f.name for f in info.absent_optimizer)):
        return False
    try:
        return all(e["path"] == f"{folder.name}/{Path(e['path']).name}"
                   and (folder / Path(e["path"]).name).stat().st_size == e["size"] for e in manifest["files"])
    except OSError:  # a listed file is not there
        return False
