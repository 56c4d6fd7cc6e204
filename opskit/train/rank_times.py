"""Each rank's forward time, gathered once per log interval, so the log names a straggler
(:mod:`opskit.rules.stragglers`: the rule and the line).

A forward hook pair on the pipeline stage's module times every training micro-batch's forward pass on this rank
(CUDA events on a GPU, read only at the log interval when they have long completed; the host clock on a CPU). At each
log interval every rank hands its median per iteration (one slow iteration, a garbage collection or a save, moves
it little) to one ``all_gather`` (the only collective added, one per
interval) and the last rank prints the slowest rank against its stage's other ranks.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from opskit.rules.stragglers import slowest_rank
from opskit.train.fault import node_name


class ForwardTimes:
    """The forward time of this rank's training micro-batches, and the interval's line (last rank).

    Args:
        module: this rank's pipeline stage (``deepspeed.pipe.PipelineModule``); evaluation forwards
            (``module.training`` False) are not counted.
        stage: this rank's pipeline stage index.
        slowdown: TEST ONLY (``OPSKIT_TEST_FAULT="slow:..."``, :func:`opskit.train.fault.slowdown_factor`): a
            callable of the iteration under way giving how many times longer this rank's forwards must take (1.0:
            unchanged; on a CPU it sleeps the difference).
    """

    def __init__(self, module: torch.nn.Module, stage: int, slowdown=lambda iteration: 1.0):
        self.cuda = torch.cuda.is_available()
        self.slowdown = slowdown
        self.iteration = 0  # the iteration under way, for the slowdown
        self.pairs: list[tuple] = []  # (iteration, start event, end event) on a GPU
        self.seconds: dict[int, float] = {}  # forward seconds of each iteration of the interval
        self._started = None
        places: list = [None] * dist.get_world_size()
        dist.all_gather_object(places, (node_name(), int(os.environ.get("LOCAL_RANK", "0")), stage))
        self.places = [tuple(place) for place in places]
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, module, inputs) -> None:
        if not module.training:
            return
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def _after(self, module, inputs, output) -> None:
        if not module.training or self._started is None:
            return
        if self.cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self.pairs.append((self.iteration, self._started, ended))
        else:
            elapsed = time.perf_counter() - self._started
            if (factor := self.slowdown(self.iteration)) > 1.0:
                time.sleep(elapsed * (factor - 1.0))
            self.seconds[self.iteration] = self.seconds.get(self.iteration, 0.0) + time.perf_counter() - self._started
        self._started = None

    def interval_line(self, first: int, last: int, is_last_rank: bool) -> str | None:
        """Collective (every rank, each log interval): gather every rank's median forward milliseconds per iteration
        over iterations ``first..last``; on the last rank the :class:`~opskit.rules.stragglers.SlowestRank` line,
        else (or with no stage of two ranks) None. Resets the count."""
        if self.pairs:
            self.pairs[-1][2].synchronize()
            for iteration, start, end in self.pairs:
                self.seconds[iteration] = self.seconds.get(iteration, 0.0) + start.elapsed_time(end) / 1e3
        ms = statistics.median(self.seconds.values()) * 1e3 if self.seconds else 0.0
        mine = torch.tensor([ms], dtype=torch.float64, device="cuda" if self.cuda else "cpu")
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        self.pairs, self.seconds = [], {}
        if not is_last_rank:
            return None
        report = slowest_rank(first, last, torch.cat(everyone).tolist(), self.places)
        return report.line() if report else None
