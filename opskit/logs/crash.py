"""Crash signatures of a broken GPU, link or node in training logs, and which node each crash line names.

Plain Python (``re`` only) so that the job script's epilogue, ``opskit submit`` and the watchdog can all use it.
The signatures are the lines BigScience's runs died with (tr11-176B chronicles, 2022-03-21: ``CUDA error: unknown
error`` raised from ``ProcessGroupNCCL``) and the usual hardware suspects (NCCL failures, ECC errors, Xid, a GPU that
fell off the bus).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

# (signature, pattern): the first pattern that matches a line names its signature. Software errors that happen to
# mention CUDA (out of memory, an illegal argument) are no hardware crash and are left out on purpose.
SIGNATURES: list[tuple[str, re.Pattern]] = [
    ("CUDA error: unknown error", re.compile(r"CUDA error: unknown error")),
    ("uncorrectable ECC error", re.compile(r"uncorrectable ECC error|\bECC\b.*\berror", re.I)),
    ("GPU fell off the bus", re.compile(r"fallen off the bus|GPU is lost", re.I)),
    ("Xid", re.compile(r"\bNVRM: Xid\b")),
    ("NCCL error", re.compile(r"NCCL error|ncclSystemError|ncclUnhandledCudaError|ncclInternalError")),
    ("NCCL watchdog timeout", re.compile(r"Watchdog caught collective operation timeout")),
    ("CUDA launch failure", re.compile(r"CUDA error: (?:unspecified launch failure|an illegal memory access)")),
]
# Errors that kill a training without blaming its hardware: the watchdog reports them too (with the node when a line
# names it), but they never put a node on the bad-node list.
SOFTWARE_ERRORS: list[tuple[str, re.Pattern]] = [
    ("out of memory", re.compile(r"CUDA out of memory|OutOfMemoryError|\bout of memory\b")),
    ("Python traceback", re.compile(r"Traceback \(most recent call last\):")),
]
# What every line a pattern above matches holds, lower-cased: a block of log with none of these has no crash line, so
# the watchdog splits only blocks that hold one (a regex over a whole 8 MiB block costs seconds, these finds ms).
NEEDLES: dict[str, tuple[str, ...]] = {
    "CUDA error: unknown error": ("cuda error",),
    "uncorrectable ECC error": ("ecc",),
    "GPU fell off the bus": ("fallen off the bus", "gpu is lost"),
    "Xid": ("nvrm: xid",),
    "NCCL error": ("nccl",),
    "NCCL watchdog timeout": ("watchdog caught collective operation timeout",),
    "CUDA launch failure": ("cuda error",),
    "out of memory": ("out of memory", "outofmemoryerror"),
    "Python traceback": ("traceback (most recent call last):",),
}


def may_hold_crash(text: str) -> bool:
    """False only when no line of ``text`` can match a pattern of :data:`SIGNATURES` or :data:`SOFTWARE_ERRORS`
    (none holds any of their :data:`NEEDLES`); a cheap test before splitting a block into lines."""
    lowered = text.lower()
    return any(needle in lowered for needles in NEEDLES.values() for needle in needles)


# A node list's items: names, each with any number of [ranges] groups; commas inside a group do not split items.
_NODELIST_ITEM = re.compile(r"(?:[^,\[\]]|\[[^\[\]]*\])+")
_NODELIST = re.compile(rf"{_NODELIST_ITEM.pattern}(?:,{_NODELIST_ITEM.pattern})*")
# srun --label's prefix: "3: ..." is task 3 (with one task per node, node 3 of the job's node list).
_TASK_PREFIX = re.compile(r"^\s*(\d+): ")
# torchrun --tee's prefix, after that label if any: "[default3]:" is the worker of local rank 3 (GPU 3 of its node).
_WORKER_PREFIX = re.compile(r"\[[A-Za-z_-]*(\d+)\]:")
# The line opskit.allocation.job writes as each array task starts; the lines after it, up to the next one, are
# that task's: ``job`` (SLURM_JOB_ID), ``task`` (``<array job>_<task id>``), ``nodes`` (its compressed node list).
JOB_HEADER = re.compile(r"^\[opskit\] \S+ \S+ job (?P<job>\d+) \(array task (?P<task>\S+)\) "
                        r"nodes (?P<nodes>\S+): start$", re.M)
# The line it writes as each training step of the task starts (opskit.allocation.in_job picks the nodes: a restart
# inside the allocation may run on other nodes): srun's labels after it index ``nodes``, the step's node list, not the
# job's; ``step`` counts from 0 in each job.
STEP_HEADER = re.compile(r"^\[opskit\] \S+ \S+ job \d+ \(array task \S+\) nodes \S+: "
                         r"training step (?P<step>\d+) on nodes (?P<nodes>\S+)$", re.M)


def last_header(text: str) -> re.Match | None:
    """The last job or training-step header in ``text``: its ``nodes`` are what srun's labels after it index."""
    found = [m for regex in (JOB_HEADER, STEP_HEADER) for m in regex.finditer(text)]
    return max(found, key=lambda m: m.start(), default=None)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed node list -> node names, in ``scontrol show hostnames``'s order (the order of srun's task
    ids): ``r7i5n[2-3],r8i0n7`` -> r7i5n2 r7i5n3 r8i0n7; zero padding kept (``n[08-10]``: n08 n09 n10); several
    bracket groups multiply (``r[1-2]n[1-2]``: r1n1 r1n2 r2n1 r2n2).

    Raises:
        ValueError: an unbalanced bracket, or a range that is not ``A`` or ``A-B`` of digits with A <= B; a list of
            more than :data:`MAX_NODES` names (counted before any is made: time and memory stay bounded).
    """
    if not _NODELIST.fullmatch(nodelist):
        raise ValueError(f"{_shown(nodelist)} is no SLURM node list")
    items = []
    for item in _NODELIST_ITEM.findall(nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        items.append([[text] if i % 2 == 0 else _ranges(text, nodelist) for i, text in enumerate(parts)])
    count = sum(math.prod(sum(len(numbers) for _, numbers in choice) if i % 2 else 1 for i, choice in enumerate(parts))
                for parts in items)
    if count > MAX_NODES:
        raise ValueError(f"{_shown(nodelist)} names {count:,} nodes, more than any cluster has (at most "
                         f"{MAX_NODES:,})")
    names: list[str] = []
    for parts in items:
        choices = [choice if i % 2 == 0 else [f"{n:0{width}d}" for width, numbers in choice for n in numbers]
                   for i, choice in enumerate(parts)]
        names += ["".join(chosen) for chosen in itertools.product(*choices)]
    return names


MAX_NODES = 1 << 16
"""Most names a node list may expand to: the largest clusters have ~10,000 nodes (SLURM's own node count limit is
65,533); a longer list is a typo or garbage, refused before it is expanded."""


def _shown(nodelist: str) -> str:
    """A node list quoted for a message, its middle elided past 60 characters."""
    return repr(nodelist if len(nodelist) <= 60 else f"{nodelist[:40]}...{nodelist[-15:]}")


def _ranges(ranges: str, nodelist: str) -> list[tuple[int, range]]:
    """``08-10,12`` -> [(2, range(8, 11)), (2, range(12, 13))]: each range with the width of its start (zero padding
    kept when the names are made), not expanded."""
    found = []
    for one in ranges.split(","):
        first, _, last = one.partition("-")
        if not (first.isdigit() and (last or first).isdigit()) or int(first) > int(last or first):
            raise ValueError(f"{_shown(nodelist)}: {one[:20]!r} is no range")
        found.append((len(first), range(int(first), int(last or first) + 1)))
    return found


class Crash(NamedTuple):
    """One crash line, ``(node, signature, line, local_rank)``: the node is None when nothing names it; the local
    rank (the worker's GPU on its node) comes from torchrun's ``[defaultN]:`` prefix, None without one."""

    node: str | None
    signature: str
    line: str
    local_rank: int | None = None

    @property
    def where(self) -> str:
        """``node2, local rank 1``, ``node2``, ``local rank 1``, or "" for a line that names neither."""
        return place(self.node, self.local_rank)


def place(node: str | None, local_rank: int | None) -> str:
    """``node2, local rank 1``: the parts that are known, "" for neither."""
    rank = None if local_rank is None else f"local rank {local_rank}"
    return ", ".join(part for part in (node, rank) if part)


def signature_of(line: str, signatures: Sequence[tuple[str, re.Pattern]] = SIGNATURES) -> str | None:
    """The crash signature a log line carries (the first of ``signatures`` that matches), or None."""
    for name, pattern in signatures:
        if pattern.search(line):
            return name
    return None


def find_crashes(lines: Iterable[str], node: str | None = None, nodes: Sequence[str] = (),
                 signatures: Sequence[tuple[str, re.Pattern]] = SIGNATURES) -> list[Crash]:
    """Every crash line in ``lines``, with its node.

    Args:
        lines: log lines (with or without their newline).
        node: the node all lines come from (a per-node log file such as ``logs/nodes/<job>-<node>.log``).
        nodes: the job's node list in task order (``scontrol show hostnames``), to map srun ``--label`` prefixes
            (``3: ...``) to nodes (:func:`task_node`; a job of one node names every line).
        signatures: what to look for; ``SIGNATURES + SOFTWARE_ERRORS`` for every error the watchdog reports.

    Returns:
        one :class:`Crash` per matching line, in order, with the local rank of torchrun's prefix where it has one.
    """
    found = []
    for raw in lines:
        line = raw.rstrip("\n")
        signature = signature_of(line, signatures)
        if signature is None:
            continue
        task, local_rank, _ = line_source(line)
        found.append(Crash(node if node is not None else task_node(task, nodes), signature, line, local_rank))
    return found


def task_node(task: int | None, nodes: Sequence[str]) -> str | None:
    """The node of a line from srun task ``task`` (its ``--label``; None without one): a job's only node whatever
    the label, else the task's entry of ``nodes`` (srun's task order); None when neither says."""
    if len(nodes) == 1:
        return nodes[0]
    return nodes[task] if task is not None and task < len(nodes) else None


def line_source(line: str) -> tuple[int | None, int | None, str]:
    """``(task, local_rank, text)`` of a training log line: srun ``--label``'s task id (``3: ...``; with one task per
    node, the node's index in the job's node list), torchrun's worker prefix's local rank (``[default1]:``), each
    None when absent, and the text after both prefixes."""
    label = _TASK_PREFIX.match(line)
    worker = _WORKER_PREFIX.match(line, label.end() if label else 0)
    end = worker.end() if worker else label.end() if label else 0
    return (int(label.group(1)) if label else None, int(worker.group(1)) if worker else None, line[end:])
