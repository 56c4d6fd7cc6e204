"""When the trainer saves and stops before the end of training, Megatron's way: on SIGUSR1 (SLURM's
``--signal=B:USR1@N`` through the job script), on the kill switch (``--kill-switch-path`` exists), after
``--exit-interval`` iterations or ``--exit-duration-in-mins`` minutes. Every rank takes the same decision: the
requests are OR-ed over all ranks in one all-reduce after each iteration.

The minutes count from the earliest start over all ranks, in wall time, or on the rehearsal's simulated clock
(:attr:`~opskit.train.config.TrainConfig.rehearsal_minutes_per_iteration`): ``opskit rehearse`` runs a production
spec's exit duration (BLOOM-176B: 5990 min) on a CPU model in seconds, and stops at a known iteration however loaded
the machine is; the rest of the exit path (the all-reduce, the save, the exit line) is the real one.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from opskit.train.build import rank_device
from opskit.train.config import TrainConfig
from opskit.train.log import print_datetime


class ExitRequests:
    """SIGUSR1 asks for save-and-exit: the handler, installed at construction, sets :attr:`usr1`."""

    def __init__(self):
        self.usr1 = False
        signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_usr1(self, signum, frame):
        self.usr1 = True


@dataclass(frozen=True)
class ExitPolicy:
    """The exit flags of ``config``, the start time every rank agreed on (seconds since the epoch) and the SIGUSR1
    requests: why to stop, decided alike on every rank (each call is one all-reduce over all ranks)."""

    config: TrainConfig
    start_time: float
    requests: ExitRequests

    def kill_switch_at_start(self) -> bool:
        """True, after Megatron's line, when the kill switch is on (on any rank) before anything is built: a drained
        job array's tasks then end at once."""
        if not _on_any_rank(self._kill_switch_on())[0]:
            return False
        print_datetime(self._kill_switch_line())
        return True

    def reason(self, iteration: int, iterations_run: int) -> str | None:
        """Why to save and stop after ``iteration``, or None. Megatron's order: duration, then interval; the kill
        switch is checked here, before the next iteration starts. ``iterations_run``: the iterations this process
        trained (the rehearsal's simulated clock, :func:`minutes_since_start`)."""
        config = self.config
        minutes = minutes_since_start(self.start_time, iterations_run, config.rehearsal_minutes_per_iteration)
        kill, timed_out, usr1 = _on_any_rank(
            self._kill_switch_on(),
            config.exit_duration_in_mins is not None and minutes > config.exit_duration_in_mins,
            self.requests.usr1,
        )
        if kill:
            return self._kill_switch_line()
        if timed_out:
            return f"exiting program after {minutes:.4f} minutes"
        if usr1:
            return f"exiting program on SIGUSR1 at iteration {iteration}"
        if config.exit_interval and iteration % config.exit_interval == 0:
            return f"exiting program at iteration {iteration}"
        return None

    def _kill_switch_line(self) -> str:
        return f"Detected kill switch at {self.config.kill_switch_path}. Exiting"  # Megatron's words

    def _kill_switch_on(self) -> bool:
        return bool(self.config.kill_switch_path) and os.path.exists(self.config.kill_switch_path)


def minutes_since_start(start_time: float, iterations_run: int, rehearsal_minutes_per_iteration: float | None) -> float:
    """Minutes counted against ``--exit-duration-in-mins``: wall time since ``start_time`` (seconds since the epoch),
    or on the rehearsal's simulated clock ``iterations_run * rehearsal_minutes_per_iteration``, which makes the exit
    iteration deterministic."""
    if rehearsal_minutes_per_iteration is None:
        return (time.time() - start_time) / 60
    return iterations_run * rehearsal_minutes_per_iteration


def _on_any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks (one MAX all-reduce), so every rank takes the same decision."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(f) for f in flags], device=rank_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]
