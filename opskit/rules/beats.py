"""The in-job watchdog's heartbeat files: one rule for the trainer, which rewrites its rank's file at the start of
every iteration and of every save (:class:`opskit.train.heartbeat.Heartbeat`), and the job script's monitor, which
reads their ages (:mod:`opskit.allocation.in_job`).

A file per rank in ``$OPSKIT_HEARTBEAT_DIR`` (one folder per training step of a job, on the run's shared file
system): no socket and no process beside the trainer, one ``pwrite`` of :data:`WIDTH` bytes per iteration. The beat's
time is the file's modification time. The monitor asks for the ranks' Python stacks by creating
:data:`DUMP_REQUEST` in the folder; each rank's heartbeat thread prints them once under :data:`DUMP_HEADER`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from opskit.fsutil import open_regular

ENV = "OPSKIT_HEARTBEAT_DIR"
WIDTH = 128
"""Bytes of one beat: fixed, so a rewrite in place never leaves a longer old one's tail."""
PHASES = ("start", "train", "save")
"""``start``: built and resumed, before the first iteration (compiles, warm-up); ``train``: an iteration began;
``save``: a checkpoint save began."""
DUMP_REQUEST = "dump-stacks"
DUMP_HEADER = "[opskit] stacks requested by the in-job watchdog"


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat: ``seconds`` is its time (epoch seconds, the file's mtime)."""

    rank: int
    node: str
    local_rank: int
    iteration: int
    phase: str
    seconds: float


def beat_file(folder: Path, rank: int) -> Path:
    """The heartbeat file of global rank ``rank``."""
    return folder / f"rank-{rank:05d}"


def encode(rank: int, node: str, local_rank: int, iteration: int, phase: str) -> bytes:
    """A beat's bytes: ``rank node local_rank iteration phase``, space-padded to :data:`WIDTH`.

    Raises:
        ValueError: a phase not in :data:`PHASES`, or a node name with whitespace or too long to fit.
    """
    if phase not in PHASES:
        raise ValueError(f"heartbeat phase {phase!r}: expected one of {', '.join(PHASES)}")
    text = f"{rank} {node} {local_rank} {iteration} {phase}"
    if len(node.split()) != 1 or len(text) >= WIDTH:
        raise ValueError(f"node name {node!r}: expected one word of at most {WIDTH - 40} characters")
    return text.ljust(WIDTH - 1).encode() + b"\n"


def read_beats(folder: Path) -> list[Beat]:
    """Every rank's last beat in ``folder`` (a file being written or not of this format is skipped: the next poll
    reads it), by rank; [] when the folder does not exist yet."""
    beats = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.startswith("rank-"):
            continue
        try:
            with open_regular(entry.path) as f:  # a FIFO or device planted there must not stall the monitor
                fields = f.read(WIDTH).decode("ascii").split()
            seconds = entry.stat().st_mtime
            rank, node, local_rank, iteration, phase = fields
            beats.append(Beat(int(rank), node, int(local_rank), int(iteration), phase, seconds))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
    return sorted(beats, key=lambda b: b.rank)
