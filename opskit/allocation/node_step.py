"""What each node of a training step runs (``srun``, one task per node; with the local executor the one node here):
torchrun at this node's place in the step, the trainer under it, and this node's own copy of the output
(:meth:`opskit.run.paths.RunPaths.node_log`, where a crash line names its node). Plain Python (no torch import of its
own).

SIGUSR1 (SLURM's warning before the time limit, passed on by :mod:`opskit.allocation.job` through srun) goes to the
trainers: torchrun's agent ignores it, or it would die of it; each trainer saves a checkpoint and exits 0.

A static rendezvous (``--master_addr``, ``--node_rank``): node rank = srun task id = place in the step's node list, so
global rank 0 (and PP stage 0) is on the step's first node, MASTER_ADDR, which hosts the store. torchrun's c10d
rendezvous would ignore ``--node_rank`` and order nodes by host name and pid, not by the allocation.

``python -m opskit.allocation.node_step RUN_DIR GPUS_PER_NODE -- TRAINER_ARGS...`` with srun's ``SLURM_JOB_ID``,
``SLURM_NNODES`` and ``SLURM_PROCID`` and the job's ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil

from opskit.run.paths import RunPaths


def torchrun_command(gpus_per_node: int, trainer_args: list[str], env: Mapping[str, str]) -> list[str]:
    """torchrun for this node (``env``: srun's and the job's variables, see the module's doc) with the trainer."""
    return [sys.executable, "-u", "-m", "torch.distributed.run", "--nproc_per_node", str(gpus_per_node),
            "--nnodes", env["SLURM_NNODES"], "--node_rank", env["SLURM_PROCID"],
            "--master_addr", env["MASTER_ADDR"], "--master_port", env["MASTER_PORT"],
            "--max_restarts", "0", "--tee", "3", "-m", "opskit.train", *trainer_args]


def node_log(run: RunPaths, env: Mapping[str, str]) -> Path:
    """This node's copy of the step's output (the node as SLURM names it, else the short host name)."""
    return run.node_log(env["SLURM_JOB_ID"], env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])


def shell_code(returncode: int) -> int:
    """A child's exit status as a shell gives it (killed by signal N: 128 + N), the form the ledger records."""
    return returncode if returncode >= 0 else 128 - returncode


def run_node(run: RunPaths, gpus_per_node: int, trainer_args: list[str], env: Mapping[str, str] = os.environ
             ) -> int:
    """Run torchrun and the trainer under it, its output (stdout and stderr) copied line by line to stdout (srun
    labels it for main_log.txt) and appended to :func:`node_log`; SIGUSR1 passed to the trainers.

    Returns:
        torchrun's exit status (:func:`shell_code`).
    Raises:
        KeyError: a variable of the module's doc is not set. OSError: the node log cannot be opened.
    """
    command = torchrun_command(gpus_per_node, trainer_args, env)
    log_path = node_log(run, env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # torchrun starts with SIGUSR1 ignored (an exec keeps that)
        agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        signal.signal(signal.SIGUSR1, lambda *_: _signal_children(agent.pid, signal.SIGUSR1))
        for line in agent.stdout:
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
        return shell_code(agent.wait())


def _signal_children(pid: int, sig: int) -> None:
    """``sig`` to the children of ``pid`` (the trainers under torchrun's agent), not to the agent itself."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[2] != "--" or not args[1].isdigit():
        print(f"usage: python -m opskit.allocation.node_step RUN_DIR GPUS_PER_NODE -- TRAINER_ARGS... (got {args!r})",
              file=sys.stderr)
        return 2
    try:
        return run_node(RunPaths(Path(args[0])), int(args[1]), args[3:])
    except KeyError as e:
        print(f"opskit.allocation.node_step: {e.args[0]} is not set (srun and opskit.allocation.job set it)",
              file=sys.stderr)
    except OSError as e:
        print(f"opskit.allocation.node_step: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
