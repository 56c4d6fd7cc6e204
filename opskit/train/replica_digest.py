"""Silent data corruption caught by replica digests (issue 48): under ZeRO-0 and ZeRO-1 every data-parallel rank
holds the same copy of its stage's (and TP shard's) parameters after a step, bitwise; every
``--replica-digest-interval`` iterations and before every save each rank digests its copy and the data-parallel group
compares them. A replica that
differs is named (of three or more, the odd one out; of two, both), every rank writes its report for the job
(:mod:`opskit.rules.divergence`, event :data:`DIGEST`) and the run stops without saving (:class:`Diverged`): the job
keeps the replica's node out and resumes from the last step whose digests agreed, on a spare. Every save is preceded by
a check, so a saved step is one whose replicas agreed (its iteration is recorded as the client state's
``replica_digest_agreed``).

The digest of a tensor is the sum of its elements' bit patterns as integers (``int16`` for half types, ``int32`` or
``int64`` otherwise), accumulated in int64: integer addition is exact and order-free, so equal copies give equal sums
on any device and a single flipped bit always changes the sum (by a power of two). Cost: one read of the parameters
and one all-gather of ``[parameters]`` int64 per check (measured in bench/trainer_throughput.py).
"""

from __future__ import annotations

import time

from opskit.rules.divergence import DIGEST, Report
from opskit.train.divergence import Diverged, DivergenceCheck

_INT_VIEW = {2: "int16", 4: "int32", 8: "int64"}


def parameter_digests(parameters):
    """A ``[len(parameters)]`` int64 tensor: each tensor's sum of bit patterns (see the module docstring), on its
    device."""
    import torch

    sums = [p.detach().contiguous().view(getattr(torch, _INT_VIEW[p.element_size()])).sum(dtype=torch.int64)
            for p in parameters]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def odd_replicas(rows: list[tuple[int, ...]]) -> list[int]:
    """The indices of ``rows`` (one digest row per data-parallel rank) that differ: those not equal to the most
    common row when it is held by more than half of them; all of them otherwise (two replicas that differ: both)."""
    counts: dict[tuple[int, ...], int] = {}
    for row in rows:
        counts[row] = counts.get(row, 0) + 1
    if len(counts) == 1:
        return []
    common, held = max(counts.items(), key=lambda item: item[1])
    if held * 2 > len(rows):
        return [i for i, row in enumerate(rows) if row != common]
    return list(range(len(rows)))


class ReplicaDigests:
    """The check of one rank: its stage's parameters, its data-parallel group, the interval (0: only before saves)."""

    def __init__(self, module, dp_group, dp_size: int, interval: int, check: DivergenceCheck):
        self.parameters = [p for p in module.parameters()]
        self.dp_group, self.dp_size, self.interval, self.check = dp_group, dp_size, interval, check
        self.agreed_at: int | None = None
        """The last iteration this run's replicas agreed at (None: not checked yet)."""

    def due(self, iteration: int) -> bool:
        return self.dp_size > 1 and bool(self.interval) and iteration % self.interval == 0

    def compare(self, iteration: int) -> None:
        """Digest, gather over the data-parallel group, and decide on every rank alike.

        Raises:
            Diverged: a replica differs (after every rank's report is on disk).
        """
        import torch
        import torch.distributed as dist

        if self.dp_size <= 1:
            return
        mine = parameter_digests(self.parameters)
        rows = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(rows, mine, group=self.dp_group)
        odd = odd_replicas([tuple(row.tolist()) for row in rows])
        any_odd = torch.tensor([float(bool(odd))], device=mine.device)
        dist.all_reduce(any_odd, op=dist.ReduceOp.MAX)  # a mismatch in any stage or TP shard stops every rank
        if not any_odd.item():
            self.agreed_at = iteration
            return
        me = dist.get_rank(group=self.dp_group)
        self.check.write(Report(DIGEST, "replica_digest", iteration, iteration, iteration, float("nan"),
                                float("nan"), float("nan"), self.check.rank, self.check.node, None,
                                time=time.time(), odd=me in odd, agreed_at=self.agreed_at))
        raise Diverged(f"divergence: the data-parallel replicas' parameters differ after iteration {iteration} "
                       f"(replica(s) {', '.join(map(str, odd)) or 'of another stage'} of {self.dp_size}); "
                       "stopping without saving: the job keeps the node out and resumes from the last agreeing step")
