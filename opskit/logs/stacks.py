"""Which rank hung: the Python stacks each trainer rank prints when one iteration runs past
``--stack-dump-after-mins`` (:mod:`opskit.train.stack_dump`, Python's ``faulthandler``) or when the in-job watchdog asks
(:mod:`opskit.train.heartbeat`), read back from main_log.txt.

In a hang every rank stops: the one that broke and all the others, which wait for it in the next collective. The
stacks tell them apart, as ``py-spy dump`` on every node did for BigScience: the waiting ranks sit in
``torch.distributed`` (or DeepSpeed's wrapper of it), the hung one somewhere else. Where every rank waits in a
collective (NCCL's are asynchronous, so on GPUs the others may wait in a later synchronisation instead), the ranks
whose innermost frame differs from that of most ranks are named. Plain Python: the watchdog runs it on a login node.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opskit.logs.crash import line_source, place, task_node
from opskit.rules.beats import DUMP_HEADER

# faulthandler's first line of a timed dump, or the line before one the in-job watchdog asked for
_DUMP_START = re.compile(r"Timeout \(\d+:\d\d:\d\d(?:\.\d+)?\)!$|" + re.escape(DUMP_HEADER) + "$")
_THREAD = re.compile(r"(?:Current thread|Thread) 0x[0-9a-f]+(?: \[[^\]]*\])? \(most recent call first\):$")
_FRAME = re.compile(r'\s+File "(.*)", line (\d+) in (\S+)$')
# Frames of a rank that waits for the others: a collective, or DeepSpeed's and torch's wrappers of one.
_COLLECTIVE = re.compile(r"/torch/distributed/|/deepspeed/comm/")


@dataclass(frozen=True)
class RankStack:
    """The main thread's stack in one rank's last dump: ``frames`` innermost first, each ``(path, line, function)``;
    ``node`` from srun's label (None when the log does not say), ``local_rank`` from torchrun's ``[defaultN]:``."""

    node: str | None
    local_rank: int | None
    frames: tuple[tuple[str, int, str], ...]

    @property
    def where(self) -> str:
        """``node2, local rank 1`` (the parts the log gave)."""
        return place(self.node, self.local_rank) or "a rank the log does not name"

    @property
    def waiting(self) -> bool:
        """True when the rank is inside a collective (it waits for the others)."""
        return any(_COLLECTIVE.search(path) for path, _, _ in self.frames)

    @property
    def innermost(self) -> str:
        """``opskit/train/fault.py:46 in inject_test_fault``: the innermost frame, its path from the package on."""
        path, line, function = self.frames[0]
        return f"{_short(path)}:{line} in {function}"


def rank_stacks(lines: Iterable[str], nodes: Sequence[str] = ()) -> list[RankStack]:
    """The last stack dump of every rank in ``lines`` (main_log.txt's, in order), the main thread's stack of each.

    Args:
        lines: log lines, each as srun (``N: ``) and torchrun (``[defaultK]:``) prefixed it; the lines of several
            ranks' dumps may interleave line by line.
        nodes: the job's node list in srun's task order, to name the node of a label (one node: every line's).

    Returns:
        one :class:`RankStack` per rank that dumped, in the order of their last dumps' first lines. The main thread
        is the one whose stack reaches a module's top level (``<module>``); a dump without one is left out.
    """
    dumps: dict[tuple[int | None, int | None], list[list[tuple[str, int, str]]]] = {}
    for raw in lines:
        task, local_rank, text = line_source(raw.rstrip("\n"))
        key = (task, local_rank)
        if _DUMP_START.match(text):
            dumps.pop(key, None)
            dumps[key] = []  # the newest dump of a rank replaces its older ones, and moves to the end
        elif key in dumps and _THREAD.match(text):
            dumps[key].append([])
        elif key in dumps and dumps[key] and (frame := _FRAME.match(text)):
            dumps[key][-1].append((frame.group(1), int(frame.group(2)), frame.group(3)))
    stacks = []
    for (task, local_rank), threads in dumps.items():
        main = next((frames for frames in threads if any(function == "<module>" for _, _, function in frames)), None)
        if main:
            stacks.append(RankStack(task_node(task, nodes), local_rank, tuple(main)))
    return stacks


def stuck_ranks(stacks: Sequence[RankStack]) -> list[RankStack]:
    """The ranks that the others wait for: those outside any collective while some rank waits in one; else, when
    every rank waits or none does, those whose innermost frame is not the most common one (a strict minority).
    Empty when the stacks do not single anyone out (one rank, or a tie)."""
    waiting = [s for s in stacks if s.waiting]
    if waiting and len(waiting) < len(stacks):
        return [s for s in stacks if not s.waiting]
    counts = Counter(s.innermost for s in stacks)
    if len(counts) < 2:
        return []
    (most, top), (_, second) = counts.most_common(2)
    return [s for s in stacks if s.innermost != most] if top > second else []


def _short(path: str) -> str:
    """A frame's path from its top package on (``.../site-packages/torch/x.py`` -> ``torch/x.py``)."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path if "/opskit/" not in path else "opskit/" + path.rsplit("/opskit/", 1)[1]
