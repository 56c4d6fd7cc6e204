"""This rank's heartbeat for the job's in-job watchdog (:mod:`opskit.rules.beats` has the file format): a beat at
the start of every iteration and of every save, and a thread that prints the rank's stacks when the watchdog asks.

The beats come from the training loop itself, never from a thread: a rank whose main thread is stuck (in a
collective, a CUDA call, a dead file system) stops beating. The thread only answers the watchdog's request for stacks:
Python's ``faulthandler`` prints every thread's stack from C, also while the main thread is blocked.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from opskit.rules.beats import DUMP_HEADER, DUMP_REQUEST, ENV, beat_file, encode
from opskit.train.fault import node_name

POLL_S = 1.0
"""How often the thread looks for the watchdog's request (one ``stat``)."""


class Heartbeat:
    """Writes ``rank``'s beats into ``folder`` and watches it for a stacks request.

    Args:
        folder: ``$OPSKIT_HEARTBEAT_DIR`` (created if missing).
        rank, local_rank: torchrun's ``RANK`` and ``LOCAL_RANK``.
        node: this node's name (:func:`opskit.train.fault.node_name`).

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, folder: Path, rank: int, local_rank: int, node: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.rank, self.local_rank, self.node = folder, rank, local_rank, node
        self._fd = os.open(beat_file(folder, rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer_requests, name="opskit-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Heartbeat | None:
        """The heartbeat the job script asked for (``$OPSKIT_HEARTBEAT_DIR``), None outside such a job."""
        folder = environ.get(ENV)
        if not folder:
            return None
        return cls(Path(folder), int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0")),
                   node_name(environ))

    def beat(self, iteration: int, phase: str) -> None:
        """Record that this rank is alive at ``iteration`` (the last completed one) in ``phase``
        (:data:`opskit.rules.beats.PHASES`): one ``pwrite``, which also sets the file's time."""
        os.pwrite(self._fd, encode(self.rank, self.node, self.local_rank, iteration, phase), 0)

    def close(self) -> None:
        """Stop the thread and close the file (the file stays: the watchdog ends with the step)."""
        self._stop.set()
        self._thread.join(timeout=2 * POLL_S)
        os.close(self._fd)

    def _answer_requests(self) -> None:
        request = self.folder / DUMP_REQUEST
        answered = None
        while not self._stop.wait(POLL_S):
            try:
                asked = request.stat().st_mtime
            except OSError:
                continue
            if asked != answered:
                answered = asked
                print(DUMP_HEADER, file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
