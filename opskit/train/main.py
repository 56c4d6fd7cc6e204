"""The trainer's entry point: :func:`main` parses the flags and :func:`train` builds the distributed world, trains the
run (:class:`opskit.train.trainer.Trainer`) and closes it in a ``finally`` (TensorBoard, CodeCarbon, the background
writer, the process groups), also when training raises.

Run with ``torchrun --nproc_per_node N -m opskit.train ...``, or as one process without a launcher.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

from opskit.rules.divergence import REPORT_DIR_ENV
from opskit.train.args import parse_args
from opskit.train.build import (
    check_precision,
    destroy_distributed,
    init_distributed,
    init_model_parallel,
)
from opskit.train.config import TrainConfig, TrainerError
from opskit.train.divergence import Diverged
from opskit.train.exit import ExitPolicy, ExitRequests
from opskit.train.fault import inject_test_fault
from opskit.train.stack_dump import disarm_stack_dump

DIVERGED = 3
"""The exit status of a run stopped by the divergence check when no job triages it (a run by hand)."""


def main(argv: list[str] | None = None, start_time: float | None = None) -> int:
    """Run the trainer with the flags ``argv`` (default: ``sys.argv[1:]``).

    ``start_time`` (seconds since the epoch) is when the process started, from which ``--exit-duration-in-mins``
    counts: ``python -m opskit.train`` takes it before its imports; None (a caller in the same process, such as
    ``opskit train`` or a test) counts from this call.

    Returns:
        0: trained, or saved and exited on request, or stopped by the divergence check under a job (its triage
        reads the reports, :data:`~opskit.rules.divergence.REPORT_DIR_ENV`); 3 (:data:`DIVERGED`): stopped by the
        divergence check with no job to triage (:mod:`opskit.train.divergence`); 2: bad input (missing packages, a
        bad flag combination found at run time, data, tokenizer, checkpoint), printed as one ``error:`` line.
        argparse's own errors exit 2.
    """
    start_time = time.time() if start_time is None else start_time
    # One write per line: under PYTHONUNBUFFERED print() writes text and newline separately, and two ranks sharing
    # torchrun's stdout then splice lines (rank 0's "saving checkpoint ..." glued to the last rank's iteration line).
    if hasattr(sys.stdout, "reconfigure"):  # a real text stream (not a test's capture object)
        sys.stdout.reconfigure(write_through=False, line_buffering=True)
    args = parse_args(argv)
    if missing := _missing_extra(args):
        print(f"error: {missing}", file=sys.stderr, flush=True)
        return 2
    exit_requests = ExitRequests()
    from opskit.train.checkpointing import CheckpointError

    try:
        return train(args, TrainConfig.from_args(args, start_time), exit_requests)
    except Diverged as e:  # every rank stops at the same iteration
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        # under the job, its triage takes it from its reports: a failure would only make torchrun print a traceback
        # that reads as a crash
        return 0 if os.environ.get(REPORT_DIR_ENV) else DIVERGED
    except (TrainerError, CheckpointError) as e:
        # one write per line: every rank of a job prints the same error, and two ranks' print() calls (text, then
        # newline) would splice their lines on torchrun's shared stderr
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 2


def _missing_extra(args: argparse.Namespace) -> str | None:
    """Why the trainer's own packages (the ``train`` extra), or those its flags ask for (``--use-bnb-optimizer``:
    bitsandbytes, the ``bnb`` extra), cannot be imported here, in one line; None when they can. Flags are parsed
    first, so ``--help`` and flag errors need none of them (a login node without torch)."""
    import importlib

    from opskit.train import REQUIRED_MODULES

    for module in REQUIRED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return (f"the trainer cannot import {module} ({' '.join(str(e).split())}): pip install 'opskit[train]' "
                    "(torch first: the README says which build)")
    if args.use_bnb_optimizer:
        # its CPU backend warns at import about a 4-bit matmul kernel package that 8-bit Adam does not use
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        try:
            importlib.import_module("bitsandbytes")
        except ImportError:
            return "--use-bnb-optimizer needs bitsandbytes: pip install bitsandbytes"
    return None


def train(args: argparse.Namespace, config: TrainConfig, exit_requests: ExitRequests) -> int:
    """Build the run from ``config``, train it, and close it in a ``finally``: TensorBoard's writer closed (its queue
    flushed), CodeCarbon stopped and the process groups destroyed, also when training raises. ``args`` is the parsed
    Namespace ``config`` was taken from: checkpoints save a copy of it as ``args``, with the vocabulary sizes.

    Returns:
        0: training finished, or saved and exited on request (kill switch, SIGUSR1, ``--exit-interval``,
        ``--exit-duration-in-mins``).

    Raises:
        TrainerError, CheckpointError: bad input found at run time (:func:`main` prints them in one line).
    """
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    trainer = None
    try:
        # 1. distributed: torchrun's world, megatron-core's TP/PP groups, the seeds, the agreed start time
        init_distributed(config)
        check_precision(config)
        world = init_model_parallel(config)
        exits = ExitPolicy(config, world.start_time, exit_requests)
        if exits.kill_switch_at_start():
            return 0
        # tests only (OPSKIT_TEST_FAULT): a crash or hang on one node after an iteration; the environment is read
        # here, once, after a launcher-less run has set its rank variables
        fault = functools.partial(inject_test_fault, environ=dict(os.environ))
        # 2.-8. tokenizer and checkpoints, model, DeepSpeed engine, resume, data, logging, heartbeat
        from opskit.train.trainer import Trainer

        trainer = Trainer(args, config, world, exits, fault)
        trainer.train()
        return 0
    finally:
        disarm_stack_dump()
        if trainer is not None:
            trainer.close()
        destroy_distributed()


