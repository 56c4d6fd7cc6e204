"""``python -m opskit.train``: the trainer (:func:`opskit.train.main.main`) with this process's start time."""

import sys
import time


def _run() -> int:
    # Megatron measures --exit-duration-in-mins from the import of its training module: the clock starts before the
    # trainer's imports, since they count against the SLURM time limit too.
    start_time = time.time()
    from opskit.train.main import main

    return main(start_time=start_time)


sys.exit(_run())
