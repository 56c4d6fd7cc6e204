"""What one run of the watchdog leaves the next (``<run>/watchdog/state.json``): :class:`WatchdogState`, frozen; the
snapshot's readers return the next one (:mod:`opskit.monitor.snapshot`), the watchdog saves it
(:func:`opskit.monitor.watchdog.next_state`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from opskit.fsutil import OutputRefusedError, atomic_write_text, read_json
from opskit.run import chain
from opskit.run.paths import RunPaths


@dataclass(frozen=True)
class WatchdogState:
    """The watchdog's memory between two runs. Frozen: a reader returns a new one (``dataclasses.replace``)."""

    offset: int = 0
    """Byte of main_log.txt read up to."""
    inode: int | None = None
    """main_log.txt's inode at ``offset``: another file (replaced) is read from its start."""
    history: list[dict] = field(default_factory=list)
    """Recent iteration records: the spike window and the throughput baseline."""
    skipped: int = 0
    """Record lines skipped so far (cut, wrapped or garbled)."""
    last_iteration_at: float | None = None
    """main_log.txt's mtime when it last gained an iteration line (epoch s): an upper bound for the hang check."""
    job_nodes: str = ""
    """The node list of the last job header seen (which node a crash line's srun label names)."""
    events_iteration: int | None = None
    """The last iteration read from TensorBoard events (a run without a text log)."""
    checkpoint: str | None = None
    """The newest complete step seen (``global_stepN``)."""
    saved: int | None = None
    """The iteration of the last ``successfully saved checkpoint`` line the log showed: that step must exist."""
    last_running: float | None = None
    """When a task of the run was last seen running (epoch s)."""
    measured: dict | None = None
    """The run's measured save-interval figures (:func:`opskit.history.measures.save_interval_advice`'s JSON), taken
    again only when the ledger's failure count changes: the log is read whole for them."""

    @classmethod
    def from_json(cls, data: object) -> WatchdogState:
        """The state a JSON object holds; a key of another type than its field's, or unknown, is dropped (the
        default: that part starts over)."""
        if not isinstance(data, dict):
            return cls()
        kinds = {"offset": int, "inode": int, "history": list, "skipped": int, "last_iteration_at": (int, float),
                 "job_nodes": str, "events_iteration": int, "checkpoint": str, "saved": int,
                 "last_running": (int, float), "measured": dict}
        return cls(**{key: value for key, value in data.items() if key in kinds and isinstance(value, kinds[key])
                      and not isinstance(value, bool)})


def load_state(run: RunPaths) -> WatchdogState:
    """The watchdog's memory of the last run (a fresh one the first time, or when the file is unreadable, not a
    regular file of at most :data:`opskit.fsutil.MAX_SMALL_FILE` bytes, or not a JSON object: start over)."""
    try:
        return WatchdogState.from_json(read_json(run.watchdog_state))
    except (OSError, ValueError):
        return WatchdogState()


def save_state(run: RunPaths, state: WatchdogState) -> str | None:
    """Write the state atomically; nothing when the run directory does not exist yet. Returns why it could not be
    written (``<file>: <strerror>``: a teammate without write access to the run; a ``paths.output`` that is no run
    directory: :func:`opskit.run.chain.claim_state_dir`), else None: the checks stand."""
    if not run.root.is_dir():
        return None
    try:
        chain.claim_state_dir(run, run.watchdog_dir, "status")
        atomic_write_text(run.watchdog_state, json.dumps(asdict(state), separators=(",", ":")))
    except OutputRefusedError as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or run.watchdog_dir}: {e.strerror or e}"
    return None
