"""A training task inside its allocation, the job script's one entry: the rendered batch script sets the environment
and hands over (``exec python -m opskit.allocation.job FLAGS -- TRAINER_ARGS``, the DeepSpeed config on stdin), so every
decision of a task is Python, testable without SLURM (a fake launcher), and signals are handled here:

1. the chain's stop flags (training finished, the kill switch, a stopped chain): the task records SKIPPED and exits 0
   before starting anything;
2. the DeepSpeed config the job was rendered with (BigScience's heredoc), written at every start: a task queued
   before a resubmission of an edited spec must not read the newer config beside its own trainer flags;
3. training in steps (:meth:`Job.train_in_steps`): each step one :mod:`opskit.allocation.node_step` per node
   (``srun``, one task per node; the local executor runs its one node here) on the nodes
   :func:`opskit.allocation.in_job.start_step` picks, watched by :func:`opskit.allocation.in_job.watch_step`;
   after a crash or a hang :func:`opskit.allocation.in_job.blame_failed_step` swaps the blamed node for a spare
   (the allocation holds ``slurm.spare_nodes`` more than training uses) and the next step resumes from ``latest``, up
   to ``slurm.in_job_restarts`` times; what the allocation cannot fix goes to the chain's next task;
4. SIGUSR1 (SLURM's ``--signal=B:USR1`` before the time limit) passed to the step: the trainer saves and exits 0 and
   no restart follows; SIGTERM (the trainer did not stop in time, or scancel) ends the task as TIMEOUT or CANCELLED;
5. the ledger (:func:`opskit.run.chain.task_ended`): the task's outcome, the chain's failure counts and stop.

Every line goes to main_log.txt (:class:`MainLog`), the step's output too, and that output also to the job's own
output file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

from opskit.allocation import divergence, in_job
from opskit.allocation.node_step import shell_code
from opskit.fsutil import OutputRefusedError, atomic_write_text
from opskit.rules.divergence import REPORT_DIR_ENV, read_reports
from opskit.rules.reliability import PREFLIGHT_MARGIN
from opskit.run import chain
from opskit.run.incidents import IncidentsError
from opskit.run.paths import RunPaths

TERMINATED = 143
"""The exit status of a task ended by SIGTERM (128 + 15), as a shell gives it."""
TIMEOUT_MARGIN_S = 10
"""A SIGTERM this close to the time limit is SLURM's time limit (TIMEOUT), earlier a scancel (CANCELLED)."""


@dataclass(frozen=True)
class JobConfig:
    """What the rendered script passes (:func:`job_flags` renders it, :func:`parse_job_flags` reads it back)."""

    run: RunPaths
    spec_name: str
    """The spec's name on the command line, for the ledger's advice lines."""
    nodes: int
    """Nodes one training step uses (``parallel.nodes``); the allocation may hold spares."""
    gpus_per_node: int
    master_port: int
    time_limit_s: int
    max_failures: int
    max_stalled_starts: int
    in_job_restarts: int
    preflight: bool
    limits: in_job.Limits
    trainer_args: tuple[str, ...]
    divergence: divergence.Bounds = divergence.Bounds()
    preflight_margin: float = PREFLIGHT_MARGIN


def job_flags(config: JobConfig) -> list[str]:
    """The command-line flags of :mod:`opskit.allocation.job` for ``config`` (the trainer's arguments not included)."""
    return ["--run-dir", str(config.run.root), "--spec-name", config.spec_name, "--nodes", str(config.nodes),
            "--gpus-per-node", str(config.gpus_per_node), "--master-port", str(config.master_port),
            "--time-limit-s", str(config.time_limit_s), "--max-failures", str(config.max_failures),
            "--max-stalled-starts", str(config.max_stalled_starts), "--in-job-restarts", str(config.in_job_restarts),
            *(["--preflight"] if config.preflight else []), "--hang-timeout-s", f"{config.limits.timeout:g}",
            "--hang-startup-s", f"{config.limits.startup:g}", "--hang-factor", f"{config.limits.hang_factor:g}",
            "--skip-after", str(config.divergence.skip_after), "--max-rollbacks",
            str(config.divergence.max_rollbacks), "--rollback-hours", f"{config.divergence.rollback_hours:g}",
            "--preflight-margin", f"{config.preflight_margin:g}"]


def parse_job_flags(argv: list[str]) -> JobConfig:
    """:func:`job_flags` and ``-- TRAINER_ARGS`` read back (argparse: a wrong flag exits 2 with one usage line)."""
    parser = argparse.ArgumentParser(prog="python -m opskit.allocation.job")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--spec-name", required=True)
    for name in ("nodes", "gpus-per-node", "master-port", "time-limit-s", "max-failures", "max-stalled-starts",
                 "in-job-restarts"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--preflight", action="store_true")
    for name in ("hang-timeout-s", "hang-startup-s", "hang-factor"):
        parser.add_argument(f"--{name}", type=float, required=True)
    # scripts rendered before issue 48 pass none of these: the spec's defaults
    bounds = divergence.Bounds()
    parser.add_argument("--skip-after", type=int, default=bounds.skip_after)
    parser.add_argument("--max-rollbacks", type=int, default=bounds.max_rollbacks)
    parser.add_argument("--rollback-hours", type=float, default=bounds.rollback_hours)
    parser.add_argument("--preflight-margin", type=float, default=PREFLIGHT_MARGIN)
    ours, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = parser.parse_args(ours)
    return JobConfig(RunPaths(a.run_dir), a.spec_name, a.nodes, a.gpus_per_node, a.master_port, a.time_limit_s,
                     a.max_failures, a.max_stalled_starts, a.in_job_restarts, a.preflight,
                     in_job.Limits(a.hang_timeout_s, a.hang_startup_s, a.hang_factor), tuple(trainer_args),
                     divergence.Bounds(a.skip_after, a.max_rollbacks, a.rollback_hours), a.preflight_margin)


@dataclass(frozen=True)
class Allocation:
    """The task's allocation as SLURM's variables give it (the local executor sets the same)."""

    job_id: str
    """``SLURM_JOB_ID``: this task's own job id."""
    task: str
    """``<array job id>_<array task id>``, the ledger's name of the task."""
    nodelist: str
    under_slurm: bool
    """False under the local executor (``OPSKIT_LOCAL``): one node, no srun."""
    partition: str | None
    num_nodes: int | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Allocation:
        """Raises:
            KeyError: ``SLURM_JOB_ID`` or ``SLURM_JOB_NODELIST`` is not set (not run by sbatch or the local executor).
        """
        job_id = env["SLURM_JOB_ID"]
        task = f"{env.get('SLURM_ARRAY_JOB_ID') or job_id}_{env.get('SLURM_ARRAY_TASK_ID') or 0}"
        num_nodes = env.get("SLURM_JOB_NUM_NODES", "")
        return cls(job_id, task, env["SLURM_JOB_NODELIST"], not env.get("OPSKIT_LOCAL"),
                   env.get("SLURM_JOB_PARTITION"), int(num_nodes) if num_nodes.isdigit() else None)


class MainLog:
    """``main_log.txt``: opskit's own lines, stamped and prefixed as the run's readers expect (``[opskit] DATE TIME job
    ID (array task T) nodes NODES: ...``), and the step's output as it comes. Appends under one lock (the step's
    output, the watchdog's lines and the job's own come from three threads). A write that fails (a full disk) never
    stops the job nor the step's output, which would then fill its pipe and block the trainer: the bytes go to
    ``fallback`` (the job's output file) instead, after one line saying why."""

    def __init__(self, path: Path, allocation: Allocation, fallback: IO[bytes] | None = None):
        self.path = path
        self.prefix = f"job {allocation.job_id} (array task {allocation.task}) nodes {allocation.nodelist}: "
        self.lock = threading.RLock()  # a signal handler on the main thread may log while it holds the lock
        self.fallback = fallback if fallback is not None else sys.stderr.buffer
        self.failed = False
        try:
            path.parent.mkdir(exist_ok=True)
        except OSError:
            pass  # said at the first write

    def line(self, text: str) -> None:
        self.write(f"[opskit] {datetime.now():%Y-%m-%d %H:%M:%S} {self.prefix}{text}\n".encode())

    def lines(self, texts: Iterable[str]) -> None:
        for text in texts:
            if text:
                self.line(text)

    def write(self, data: bytes) -> None:
        with self.lock:
            try:
                with open(self.path, "ab") as f:
                    f.write(data)
                return
            except OSError as e:
                if not self.failed:
                    self.failed = True
                    self.fallback.write(f"[opskit] {self.path} not written ({e}): its lines go here\n".encode())
            self.fallback.write(data)
            self.fallback.flush()


Launcher = Callable[[JobConfig, list[str], dict[str, str]], subprocess.Popen]
"""Starts one training step: (the job, the step's nodes, the environment) -> the step's process, its stdout a pipe
(stderr joined to it). :func:`srun_step` under SLURM, :func:`local_step` under the local executor, a fake in tests."""


def node_command(config: JobConfig) -> list[str]:
    """The command every node of a step runs (:mod:`opskit.allocation.node_step`)."""
    return [sys.executable, "-u", "-m", "opskit.allocation.node_step", str(config.run.root),
            str(config.gpus_per_node), "--", *config.trainer_args]


def srun_step(config: JobConfig, nodes: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One srun task per node of ``nodes``; ``--label`` prefixes each line with its task id ("1: ..."), the node's
    place in the step's node list; ``--kill-on-bad-exit``: a rank's crash ends the step on every node."""
    command = ["srun", "--wait=60", "--kill-on-bad-exit=1", "--label", f"--nodes={len(nodes)}",
               f"--ntasks={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
               *node_command(config)]
    return _popen(command, {**env, "MASTER_ADDR": nodes[0]})


def local_step(config: JobConfig, nodes: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The local executor's step: the node command here, the store on 127.0.0.1."""
    return _popen(node_command(config), {**env, "MASTER_ADDR": "127.0.0.1"})


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    # stdin closed: the job's stdin is the script's heredoc, and srun would pass its stdin on to task 0
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


class Terminated(BaseException):
    """SIGTERM reached the job (raised by its handler on the main thread, caught in :meth:`Job.run`). A
    BaseException, as SystemExit is: no ``except Exception`` on the way may swallow it."""


class Job:
    """One task of the chain in its allocation (see the module's doc). Signals reach it through :meth:`on_usr1` and
    :meth:`on_term`, which :func:`main` installs."""

    def __init__(self, config: JobConfig, allocation: Allocation, launch: Launcher, log: MainLog,
                 stdout: IO[bytes] | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self.allocation, self.launch, self.log = config, allocation, launch, log
        self.stdout = stdout  # where the step's output also goes (the job's output file); None: main_log only
        self.clock = clock
        self.started = clock()
        self.step: subprocess.Popen | None = None
        self.usr1 = False
        self.training = False  # SIGTERM ends the task only while it trains: the ledger line, once begun, is written

    def run(self, ds_config: str) -> int:
        """The task from start to its ledger line; returns its exit status (0 also for a skipped task)."""
        self.log.line("start")
        reason = chain.stop_reason(self.config.run)
        if reason:
            self.log.line(f"exiting at once: {reason}")
            self._record_skipped(reason)
            self.log.line("end, exit code 0")
            return 0
        try:
            self.config.run.ds_config.parent.mkdir(exist_ok=True)
            atomic_write_text(self.config.run.ds_config, ds_config)
        except OSError as e:  # the trainer would read a stale or no config: no step starts
            self.log.line(f"the DeepSpeed config was not written: {e}")
            self._task_ended("FAILED", 1)
            self.log.line("end, exit code 1")
            return 1
        self.training = True
        try:
            code = self.train_in_steps()
        except Terminated:
            self.training = False
            state = ("TIMEOUT" if self.clock() - self.started >= self.config.time_limit_s - TIMEOUT_MARGIN_S
                     else "CANCELLED")
            self.log.line(f"SIGTERM: the job ends ({state})")
            self._task_ended(state, TERMINATED)
            return TERMINATED
        self.training = False
        self._task_ended("COMPLETED" if code == 0 else "FAILED", code)
        self.log.line(f"end, exit code {code}")
        return code

    def train_in_steps(self) -> int:
        """Steps until one ends well, SIGUSR1 came, or no restart is left or possible; the last step's status (1
        when no step could start). A step stopped by the divergence check is followed by the triage's next step
        (:mod:`opskit.allocation.divergence`: a replay, or training on after a skip), which no restart counts: the
        triage's own bound (``max_rollbacks``) ends that."""
        restarts, steps = 0, 0
        while True:
            picked = self._next_step_nodes(check=steps == 0)
            if picked is None:
                return 1
            nodes, heartbeats = picked
            args = self._in_job(divergence.step_trainer_args, self.config.run, list(self.config.trainer_args))
            if args is None:
                return 1
            self.log.lines(args[1])
            self.log.line(f"training step {steps} on nodes {','.join(nodes)}")
            reports = heartbeats.with_suffix(".divergence")
            code = self._run_step(nodes, heartbeats, reports, args[0])
            steps += 1
            triage = self._in_job(divergence.triage, self.config.run, read_reports(reports), nodes,
                                  self.config.divergence, self.allocation.job_id, self.allocation.task,
                                  self.config.spec_name)
            if triage is not None:
                self.log.lines(triage.lines)
            if triage is not None and triage.restart is not None:  # the trainer stopped for the triage (exit 0)
                if triage.restart and not self.usr1:
                    continue
                return code or 1  # held: the task did not train to its end
            if code == 0 or self.usr1:
                return code
            if restarts >= self.config.in_job_restarts:
                self.log.line(f"step {restarts} failed (exit {code}): no in-job restart left (slurm.in_job_restarts "
                              f"{self.config.in_job_restarts})")
                return code
            blamed = self._in_job(in_job.blame_failed_step, self.config.run, self.allocation.job_id)
            if blamed is None:
                return code
            restart, lines = blamed
            self.log.lines(lines)
            if not restart:
                return code
            restarts += 1
            self.log.line(f"in-job restart {restarts} of {self.config.in_job_restarts}: training resumes from the "
                          "last checkpoint")

    def on_usr1(self, *_) -> None:
        self.usr1 = True
        self.log.line("SIGUSR1: asking the trainer to save and exit")
        if self.step is not None:
            self.step.send_signal(signal.SIGUSR1)

    def on_term(self, *_) -> None:
        if self.training:
            raise Terminated

    def _next_step_nodes(self, check: bool) -> tuple[list[str], Path] | None:
        """The next step's nodes and heartbeat folder; at the task's start after the pre-flight check of the
        allocation's nodes (``slurm.preflight``, under SLURM): a restart minutes later reuses that verdict and the
        blame. None when no step can start (said in main_log.txt)."""
        run_check = check and self.config.preflight and self.allocation.under_slurm
        started = self._in_job(in_job.start_step, self.config.run, self.allocation.job_id, self.config.nodes,
                               self.allocation.nodelist,
                               in_job.preflight_check(self.config.run, self.config.preflight_margin, say=self.log.line)
                               if run_check else None)
        if started is None:
            return None
        nodes, heartbeats, lines = started
        self.log.lines(lines)
        return nodes, heartbeats

    def _in_job(self, call, *args):
        """``call(*args)`` of :mod:`opskit.allocation.in_job` or :mod:`opskit.allocation.divergence`; None when it
        cannot go on, the reason in main_log.txt."""
        try:
            return call(*args)
        except (in_job.InJobError, OutputRefusedError, IncidentsError) as e:
            self.log.line(f"no restart in this job: {e}")
        except (OSError, ValueError, KeyError, chain.ChainError) as e:
            self.log.line(f"in-job recovery: {type(e).__name__}: {e}")
        return None

    def _run_step(self, nodes: list[str], heartbeats: Path, reports: Path, trainer_args: list[str]) -> int:
        """One step on ``nodes`` with ``trainer_args``, its output copied as it comes and its heartbeats watched; the
        trainer's divergence reports go to ``reports``; its exit status."""
        env = {**os.environ, "OPSKIT_HEARTBEAT_DIR": str(heartbeats), REPORT_DIR_ENV: str(reports),
               "MASTER_PORT": str(self.config.master_port)}
        step = self.launch(dataclasses.replace(self.config, trainer_args=tuple(trainer_args)), nodes, env)
        self.step = step
        copier = threading.Thread(target=self._copy_output, args=(step.stdout,), daemon=True)
        watcher = threading.Thread(target=self._watch, args=(step.pid,), daemon=True)
        copier.start()
        watcher.start()
        try:
            code = shell_code(step.wait())
        finally:
            self.step = None
        copier.join()
        watcher.join()
        return code

    def _copy_output(self, output: IO[bytes]) -> None:
        for line in output:
            self.log.write(line)
            if self.stdout is not None:
                self.stdout.write(line)
                self.stdout.flush()

    def _watch(self, pid: int) -> None:
        try:
            in_job.watch_step(self.config.run, self.allocation.job_id, pid, self.config.limits, say=self.log.line)
        except (OSError, ValueError, KeyError) as e:
            self.log.line(f"in-job watchdog stopped: {type(e).__name__}: {e}")

    def _task_ended(self, state: str, code: int) -> None:
        c, a = self.config, self.allocation
        try:
            lines = chain.task_ended(c.run, c.spec_name, a.job_id, a.task, state, code, a.nodelist, c.max_failures,
                                     job_nodes=a.num_nodes, partition=a.partition,
                                     max_stalled_starts=c.max_stalled_starts)
        except (chain.ChainError, OSError) as e:
            lines = [f"ledger not updated: {e}"]
        self.log.lines(lines)

    def _record_skipped(self, reason: str) -> None:
        a = self.allocation
        try:
            chain.task_skipped(self.config.run, a.job_id, a.task, a.nodelist, reason)
        except (chain.ChainError, OSError) as e:
            self.log.line(f"ledger not updated: {e}")


def main(argv: list[str] | None = None) -> int:
    """``python -m opskit.allocation.job FLAGS -- TRAINER_ARGS < DS_CONFIG``: the task (:class:`Job`) with SIGUSR1 and
    SIGTERM handled; its exit status. Exit 2: the flags or SLURM's variables are not what a rendered script gives."""
    config = parse_job_flags(list(sys.argv[1:] if argv is None else argv))
    try:
        allocation = Allocation.from_environ(os.environ)
        if not config.run.root.is_dir():  # a wrong --run-dir is never created here
            raise chain.ChainError(f"--run-dir {config.run.root}: no such run directory")
        chain.claim_run_dir(config.run, "the job", write=False)
    except KeyError as e:
        print(f"opskit.allocation.job: {e.args[0]} is not set: a job of sbatch or of opskit submit --executor local "
              "runs this", file=sys.stderr)
        return 2
    except (chain.ChainError, OutputRefusedError, OSError) as e:
        print(f"opskit.allocation.job: {e}", file=sys.stderr)
        return 2
    job = Job(config, allocation, srun_step if allocation.under_slurm else local_step,
              MainLog(config.run.main_log, allocation), stdout=sys.stdout.buffer)
    signal.signal(signal.SIGUSR1, job.on_usr1)
    signal.signal(signal.SIGTERM, job.on_term)
    return job.run(sys.stdin.read())


if __name__ == "__main__":
    sys.exit(main())
