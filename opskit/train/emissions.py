"""``--codecarbon-dir``: CodeCarbon's offline emissions tracking, as BigScience's Megatron-DeepSpeed did it (CSV files
``emissions-RANK.csv``, country FRA, no network), optional: without the ``codecarbon`` package the trainer warns once
and trains on.

One tracker per node (local rank 0): CodeCarbon measures the whole machine's CPUs, GPUs and RAM, so one tracker per
process would count each node's power once per GPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


class Emissions:
    """Start, flush (at every checkpoint save) and stop a tracker; every method is a no-op when there is none."""

    def __init__(self, tracker=None):
        self.tracker = tracker

    @classmethod
    def start(cls, directory: str | None, rank: int) -> Emissions:
        """A started tracker writing ``<directory>/emissions-{rank:03d}.csv`` on each node's local rank 0; an idle
        one without ``directory``, on other ranks, or (after one warning line from rank 0) without codecarbon."""
        if not directory or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return cls()
        try:
            from codecarbon import OfflineEmissionsTracker
        except ImportError:
            if rank == 0:
                print(f"WARNING: --codecarbon-dir {directory}: the codecarbon package is not installed "
                      "(pip install codecarbon); training without emissions tracking", flush=True)
            return cls()
        Path(directory).mkdir(parents=True, exist_ok=True)
        logging.getLogger("codecarbon").setLevel(logging.WARNING)
        tracker = OfflineEmissionsTracker(output_dir=directory, output_file=f"emissions-{rank:03d}.csv",
                                          country_iso_code="FRA", log_level="warning", project_name="opskit-train",
                                          allow_multiple_runs=True)
        tracker.start()
        return cls(tracker)

    def flush(self) -> None:
        if self.tracker is not None:
            self.tracker.flush()

    def stop(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()
            self.tracker = None
