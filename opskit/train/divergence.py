"""The trainer's divergence check (issue 48): each iteration's lm loss and grad norm judged by the spike rule the
watchdog and ``opskit logs spikes`` use (:class:`opskit.rules.spike_rule.SpikeWatch`, its windows saved with every
checkpoint so that a resumed run judges as the run that saved it would have).

A spike that has not come back within ``--divergence-patience`` iterations, or a NaN/Inf at once, is acted on by
``--divergence-action``: ``alert`` prints a warning and trains on; ``rollback`` writes this rank's report for the job
(:mod:`opskit.rules.divergence`) and stops the run *without saving* (:class:`Diverged`), so that nothing trained on
after the spike reaches ``latest``. Under ``--divergence-replay`` the run replays a spike: at its iteration the value
is judged reproduced (report, stop: the job rolls back and skips) or not (report, train on: the job gives the node a
strike). Torch-free apart from the distributed barrier.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from opskit.rules.divergence import (
    DETECTED,
    REPLAYED,
    REPORT_DIR_ENV,
    Replay,
    Report,
    reproduced,
    spike_config,
    write_report,
)
from opskit.rules.spike_rule import Spike, SpikeWatch
from opskit.train.config import TrainConfig


class Diverged(Exception):
    """The run stops for the job's triage (``--divergence-action rollback``); the message is the trainer's line."""


class DivergenceCheck:
    """The check of one rank. ``report_dir``: where this rank writes its reports (:data:`REPORT_DIR_ENV`), None for a
    run no job watches (a rollback then only stops it); ``node``: this rank's node name, for the job's strike."""

    def __init__(self, config: TrainConfig, rank: int, node: str, report_dir: Path | None):
        self.action, self.patience = config.divergence_action, config.divergence_patience
        self.watch = SpikeWatch(spike_config(config.spike_window, config.spike_threshold))
        self.replay = Replay.parse(config.divergence_replay) if config.divergence_replay else None
        self.rank, self.node, self.report_dir = rank, node, report_dir
        self.recent: dict[int, tuple[dict[str, float | None], float | None]] = {}
        """The last ``patience`` + 1 iterations' values and this rank's local loss: a spike is acted on up to
        ``patience`` iterations after its first, whose values the report gives."""
        self.warned: set[tuple[str, int]] = set()

    @classmethod
    def from_environ(cls, config: TrainConfig, rank: int, node: str) -> DivergenceCheck:
        folder = os.environ.get(REPORT_DIR_ENV)
        return cls(config, rank, node, Path(folder) if folder else None)

    def state(self) -> dict:
        """What a checkpoint saves (:meth:`SpikeWatch.state`)."""
        return self.watch.state()

    def restore(self, state: dict | None) -> None:
        """Take back a checkpoint's :meth:`state`; None or a damaged one (a step saved before the check existed, or
        re-cut by a conversion that dropped it): the windows start empty and fill again."""
        if state is not None:
            try:
                self.watch.restore(state)
            except ValueError:
                pass

    def after_iteration(self, iteration: int, loss: float | None, grad_norm: float | None,
                        local_loss: float | None) -> None:
        """Judge ``iteration``'s values (None: not logged, as an fp16 step the loss scaler skipped).

        Args:
            local_loss: this rank's lm loss before the data-parallel average (last pipeline stage), else None.

        Raises:
            Diverged: after the report is written on every last-stage rank, when the run must stop for the job.
        """
        values = {"lm_loss": loss, "grad_norm": grad_norm}
        self.watch.add(iteration, values)
        self.recent[iteration] = values, local_loss
        self.recent.pop(iteration - self.patience - 1, None)
        if self.replay is not None and iteration == self.replay.iteration:
            self._judge_replay(iteration, values[self.replay.metric])
            return
        spike = self.watch.unrecovered(iteration, self.patience)
        if spike is None:
            return
        what = _describe(spike, iteration)
        if self.action == "alert":
            if (spike.metric, spike.first) not in self.warned:
                self.warned.add((spike.metric, spike.first))
                _print(self.rank, f"WARNING: divergence: {what}; --divergence-action alert: training goes on")
            return
        value, local_loss = self._at(spike.first, spike.metric)
        self.write(Report(DETECTED, spike.metric, spike.first, spike.last, iteration, spike.peak, value,
                            spike.baseline, self.rank, self.node, local_loss, time=time.time()))
        raise Diverged(f"divergence: {what}; stopping without saving for the job's replay (--divergence-action "
                       "rollback)")

    def _judge_replay(self, iteration: int, value: float | None) -> None:
        replay, self.replay = self.replay, None
        again = reproduced(replay, value)
        self.write(Report(REPLAYED, replay.metric, replay.iteration, replay.iteration, iteration, replay.value,
                            math.nan if value is None else value, replay.baseline, self.rank, self.node,
                            self._at(iteration, replay.metric)[1], reproduced=again, time=time.time()))
        verdict = (f"replay of iteration {iteration}: {replay.metric} {value} against {replay.value} at the spike "
                   f"(median before it {replay.baseline:.4g})")
        if again:
            raise Diverged(f"divergence: {verdict}: reproduced, stopping for the rollback")
        _print(self.rank, f"divergence: {verdict}: not reproduced, a transient fault; training goes on")

    def _at(self, iteration: int, metric: str) -> tuple[float, float | None]:
        """(``metric``'s value, this rank's local loss) at ``iteration`` (NaN, None: not kept)."""
        values, local_loss = self.recent.get(iteration, ({}, None))
        value = values.get(metric)
        return (math.nan if value is None else value), local_loss

    def write(self, report: Report) -> None:
        """Write this rank's report (when it holds something of its own: a local loss, an odd replica; rank 0
        always) and wait for every rank at a barrier, so that none leaves before the reports are on disk (the launcher
        stops the others when one exits)."""
        import torch.distributed as dist

        if self.report_dir is not None and (report.local_loss is not None or report.odd or self.rank == 0):
            try:
                write_report(self.report_dir, report)
            except OSError as e:  # the run still stops; the job then finds no report and treats it as a failure
                print(f"WARNING: rank {self.rank}: divergence report not written to {self.report_dir}: {e}",
                      flush=True)
        if dist.is_initialized():
            dist.barrier()


def _describe(spike: Spike, iteration: int) -> str:
    metric = spike.metric.replace("_", " ")
    if not math.isfinite(spike.peak):
        return f"{metric} {spike.peak} at iteration {spike.first}"
    return (f"{metric} spike from iteration {spike.first} (peak {spike.peak:.4g} at {spike.peak_iteration}, median "
            f"before {spike.baseline:.4g}) not back within {iteration - spike.first} iterations")


def _print(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)
