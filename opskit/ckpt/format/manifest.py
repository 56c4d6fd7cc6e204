"""The manifest ``opskit ckpt backup`` writes beside each step it copies (``manifests/global_stepN.json``: its shape
is :mod:`opskit.ckpt.backup`'s module docstring), read here for the commands below the backup tools too: a weights-only
backup's step folder is read in place by ``ckpt convert``/``inspect``/``check``
(:func:`opskit.ckpt.format.info.weights_only_copy`)."""

from __future__ import annotations

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
