"""Stragglers: the rank whose forward passes take longer than its pipeline stage's other ranks' (same layers, same
micro-batch size: only a slower GPU, CPU or node makes the difference). One rule for the trainer, which prints
:class:`SlowestRank` as a line each log interval, and ``opskit status``, which names a straggler from those lines
(:func:`straggler`).

Forward passes only: they hold no data-parallel collective, so a fast rank does not wait in them for a slow one (with
TP > 1 the TP group's all-reduces do make its ranks wait for each other: the group is named, its node is right).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

_LINE = re.compile(r"^\[opskit\] forward time per rank, iterations (\d+)-(\d+): slowest rank (\d+) on (\S+) "
                   r"\(local rank (\d+), stage (\d+)\) ([\d.]+) ms = ([\d.]+)x the median of its stage's other "
                   r"ranks \(([\d.]+) ms\)$")


@dataclass(frozen=True)
class SlowestRank:
    """The slowest rank of one log interval, against the median of the other ranks of its pipeline stage.

    ``ms``: its forward passes' time per iteration (median over the interval), in milliseconds; ``ratio``:
    ``ms / others_ms``."""

    first: int
    last: int
    rank: int
    node: str
    local_rank: int
    stage: int
    ms: float
    ratio: float
    others_ms: float

    def line(self) -> str:
        """The trainer's line (parsed back by :func:`parse_slowest_rank_line`)."""
        return (f"[opskit] forward time per rank, iterations {self.first}-{self.last}: slowest rank {self.rank} on "
                f"{self.node} (local rank {self.local_rank}, stage {self.stage}) {self.ms:.1f} ms = "
                f"{self.ratio:.2f}x the median of its stage's other ranks ({self.others_ms:.1f} ms)")


def parse_slowest_rank_line(line: str) -> SlowestRank | None:
    """The :class:`SlowestRank` a log line states, or None for any other line."""
    found = _LINE.match(line.rstrip("\n"))
    if not found:
        return None
    first, last, rank, node, local_rank, stage, ms, ratio, others = found.groups()
    return SlowestRank(int(first), int(last), int(rank), node, int(local_rank), int(stage), float(ms), float(ratio),
                       float(others))


def slowest_rank(first: int, last: int, ms_per_rank: list[float],
                 places: list[tuple[str, int, int]]) -> SlowestRank | None:
    """The rank with the largest ratio of its time to the median of its stage's other ranks.

    Args:
        first, last: the log interval's iterations.
        ms_per_rank: forward milliseconds per iteration of each global rank (its median over the interval).
        places: (node, local rank, pipeline stage) of each global rank.

    Returns:
        None when no stage has two ranks (nobody to compare with) or a time is not positive.
    """
    by_stage: dict[int, list[int]] = {}
    for rank, (_, _, stage) in enumerate(places):
        by_stage.setdefault(stage, []).append(rank)
    best = None
    for ranks in by_stage.values():
        for rank in ranks if len(ranks) > 1 else ():
            others = statistics.median(ms_per_rank[r] for r in ranks if r != rank)
            if others <= 0:
                return None
            ratio = ms_per_rank[rank] / others
            if best is None or ratio > best[0]:
                best = (ratio, rank, others)
    if best is None:
        return None
    ratio, rank, others = best
    node, local_rank, stage = places[rank]
    return SlowestRank(first, last, rank, node, local_rank, stage, ms_per_rank[rank], ratio, others)


def straggler(reports: list[SlowestRank], ratio: float, intervals: int = 3) -> SlowestRank | None:
    """The straggler, if the last ``intervals`` reports (oldest first) name the same node and local rank, each at
    least ``ratio`` times its stage's other ranks; the last of those reports, else None."""
    last = reports[-intervals:]
    if len(last) < intervals:
        return None
    if len({(r.node, r.local_rank) for r in last}) == 1 and all(r.ratio >= ratio for r in last):
        return last[-1]
    return None
