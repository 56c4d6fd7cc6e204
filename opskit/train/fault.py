"""TEST ONLY: a fault injected on one node, so the node-failure story can be tested on a cluster without broken GPUs.

``OPSKIT_TEST_FAULT="KIND:NODE:iteration=N[:task=T][:local_rank=R]"`` (set through the spec's ``slurm.env``, which
the job script exports on every node) makes the trainer on node ``NODE`` (``$SLURMD_NODENAME``, else the host name),
right after iteration ``N`` (only in array task ``T``, and only in the worker of local rank ``R``, one GPU of the
node, when given):

- ``crash``: print the lines a GPU that broke mid-training leaves (``CUDA error: an illegal memory access was
  encountered`` raised from NCCL's watchdog, as :mod:`opskit.logs.crash` recognises) and exit 1 at once, as a dead
  rank does;
- ``hang``: sleep for an hour inside the iteration, as a rank stuck in a collective does;
- ``slow`` (with ``:factor=F``): from iteration ``N`` on, make every forward pass of the node's ranks take ``F`` times
  as long (on CPU ranks: :class:`opskit.train.rank_times.ForwardTimes` sleeps the difference), as a throttled GPU or
  a node with a failing fan does;
- ``slow_gemm`` (``:factor=F``, default 3) and ``allreduce_fail``: ``opskit preflight``'s check on the node
  (:mod:`opskit.allocation.node_check`) finds its GEMM slower, or its all-reduces failing;
- ``nan``: the node's ranks compute a NaN loss in iteration ``N`` (so NaN gradients), once: not when the run replays
  that iteration (``--divergence-replay``), as a transient fault of a GPU would;
- ``flip``: right after iteration ``N``'s step, one bit of the node's ranks' first parameter flips (the lowest
  mantissa bit of its first element), as silent data corruption would: the replicas' digests no longer agree;
- ``poison`` (node ``*``, any, with ``:count=C``, default 1): the training samples of iterations ``N`` to
  ``N+C-1`` (their places in the data as an uninterrupted run without ramp-up reads it) hold random tokens, on every
  attempt, as bad data would: the spike comes back when the run replays them, and is gone once they are skipped.

Never set it for a real training. Unset (always, outside tests) it costs one dictionary lookup per iteration.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Mapping

CRASH_LINES = (
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [Rank {rank}] NCCL watchdog thread terminated with exception: CUDA error: an illegal memory access "
    "was encountered",
)
HANG_S = 3600


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """This node's name as SLURM knows it (``$SLURMD_NODENAME``), else the host name: the name a fault targets, and
    the one the straggler line and ``opskit preflight`` report."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def fault_here(environ: Mapping[str, str] = os.environ) -> tuple[str, dict[str, str], str] | None:
    """(kind, options, node) of ``OPSKIT_TEST_FAULT`` when it targets this node, array task and local rank."""
    kind, _, rest = environ.get("OPSKIT_TEST_FAULT", "").partition(":")
    node, _, options = rest.partition(":")
    wanted = dict(option.partition("=")[::2] for option in options.split(":") if option)
    here = node_name(environ)
    if node not in (here, "*") or any(wanted.get(option, environ.get(variable)) != environ.get(variable)
                           for option, variable in (("task", "SLURM_ARRAY_TASK_ID"), ("local_rank", "LOCAL_RANK"))):
        return None
    return kind, wanted, here


def slowdown_factor(iteration: int, environ: Mapping[str, str] = os.environ) -> float:
    """How many times longer this rank's forward passes must take in ``iteration`` (``slow``, see the module
    docstring): 1.0 unless asked; a malformed value is ignored."""
    fault = fault_here(environ)
    if fault is None or fault[0] != "slow" or not fault[1].get("iteration", "").isdigit():
        return 1.0
    try:
        factor = float(fault[1].get("factor", "1"))
    except ValueError:
        return 1.0
    return factor if iteration >= int(fault[1]["iteration"]) else 1.0


def inject_test_fault(iteration: int, environ: Mapping[str, str] = os.environ) -> None:
    """Crash or hang here when ``OPSKIT_TEST_FAULT`` asks for it on this node after ``iteration`` (see the module
    docstring); a malformed value is ignored (it is a test's, never a user's)."""
    fault = fault_here(environ)
    if fault is None or fault[1].get("iteration") != str(iteration):
        return
    kind, _, here = fault
    if kind == "crash":
        print("\n".join(CRASH_LINES).format(rank=environ.get("RANK", "0")), file=sys.stderr, flush=True)
        os._exit(1)
    if kind == "hang":
        print(f"OPSKIT_TEST_FAULT: hanging in iteration {iteration + 1} on {here}", flush=True)
        time.sleep(HANG_S)


def nan_loss_now(iteration: int, replaying: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this rank's loss of ``iteration`` is to be NaN (``nan``, see the module docstring)."""
    fault = fault_here(environ)
    return fault is not None and fault[0] == "nan" and fault[1].get("iteration") == str(iteration) and not replaying


def flip_bit_now(iteration: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether one bit of this rank's parameters flips after ``iteration`` (``flip``, see the module docstring)."""
    fault = fault_here(environ)
    return fault is not None and fault[0] == "flip" and fault[1].get("iteration") == str(iteration)


def flip_one_bit(parameters) -> None:
    """Flip the lowest bit of the first element of the first of ``parameters`` (torch tensors), in place."""
    import torch

    first = next(iter(parameters))
    with torch.no_grad():
        bits = first.data.view(-1)[:1].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[first.element_size()])
        bits ^= 1


@contextlib.contextmanager
def nan_loss(module, active: bool):
    """While in the block, ``module``'s (a pipeline stage's) loss function returns NaN times the loss, when
    ``active`` (:func:`nan_loss_now`)."""
    if not active:
        yield
        return
    loss_fn = module.loss_fn
    module.loss_fn = lambda *args: loss_fn(*args) * float("nan")
    try:
        yield
    finally:
        module.loss_fn = loss_fn


def poisoned_samples(global_batch_size: int, environ: Mapping[str, str] = os.environ) -> range | None:
    """The indices of the training samples ``poison`` replaces (see the module docstring), None when not asked."""
    fault = fault_here(environ)
    if fault is None or fault[0] != "poison" or not fault[1].get("iteration", "").isdigit():
        return None
    first, count = int(fault[1]["iteration"]), int(fault[1].get("count", "1") or 1)
    return range((first - 1) * global_batch_size, (first - 1 + count) * global_batch_size)


class PoisonedSamples:
    """``samples`` (a sequence of token arrays) with those at ``indices`` replaced by random tokens of the same length
    and range (seeded by the index: every attempt reads the same poison)."""

    def __init__(self, samples, indices: range):
        self.samples, self.indices = samples, indices

    def __getitem__(self, index: int):
        import numpy as np

        sample = self.samples[index]
        if index not in self.indices:
            return sample
        return np.random.default_rng(index).integers(0, int(sample.max()) + 1, size=sample.shape, dtype=sample.dtype)
