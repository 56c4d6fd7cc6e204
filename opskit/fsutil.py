"""Atomic file-system writes: nothing half-written is ever visible under its final name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def staging_path(path: Path) -> Path:
    """Hidden per-process temporary name next to ``path`` (same file system, so the rename is atomic)."""
    return path.with_name(f".{path.name}-{os.getpid()}")


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    staging = staging_path(path)
    try:
        staging.write_text(text, encoding="utf-8")
        if mode is not None:
            staging.chmod(mode)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def replace_dir(staging: Path, target: Path) -> None:
    """Rename the finished folder ``staging`` to ``target``; an existing ``target`` is moved aside, then removed."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = target.with_name(f".{target.name}-old-{os.getpid()}")
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
