"""Recovery inside the allocation (issue 35): :mod:`opskit.allocation.job` trains in steps, each an ``srun`` on the
nodes this module picks, watched by this module's heartbeat monitor; after a crash or a hang it names the node to blame,
swaps it for a spare of the allocation, and the job starts the next step from ``latest``. The chain's next array task is
left for what the allocation cannot fix. Plain Python (no torch): it runs in the job's process, on the job's first node.

The job's state is ``<run>/in-job/<job id>.json``: the allocation's nodes, the nodes needed, the nodes this job
excluded (and why), and each step's nodes, heartbeat folder, start offsets in the per-node logs and hang record.

:func:`main` is the interface of job scripts rendered before :mod:`opskit.allocation.job` (a bash loop that called
``python -m opskit.run.in_job``, which :mod:`opskit.run.in_job` still serves: such a script may be queued when opskit
is upgraded): ``start RUN_DIR JOB_ID NEED NODELIST [--preflight]`` prints ``STEP NODES HEARTBEAT_DIR`` for the next
step after its log lines (exit 3: fewer than NEED usable nodes left); ``watch RUN_DIR JOB_ID PID TIMEOUT_S STARTUP_S
HANG_FACTOR`` watches the step run by process PID; ``failed RUN_DIR JOB_ID`` blames the failed step and says whether
to restart (exit 0) or not (exit 3). Lines for main_log.txt go to stdout.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from opskit.errors import OpskitError
from opskit.fsutil import OutputRefusedError, atomic_write_text, bounded_lines, open_regular, read_json
from opskit.logs.crash import expand_nodelist, find_crashes
from opskit.logs.stacks import rank_stacks, stuck_ranks
from opskit.rules.beats import DUMP_REQUEST, Beat, read_beats
from opskit.rules.reliability import PREFLIGHT_MARGIN
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client

CANNOT_CONTINUE = 3
HANG_LINE = "in-job watchdog: "
"""How the monitor's main_log line on a hang begins (the goodput account reads it back)."""
POLL_S = 1.0
DUMP_WAIT_S = 5.0
"""How long the watchdog waits for the ranks' stacks after asking for them."""
STOP_WAIT_S = 45.0
"""How long a stopped step gets between SIGTERM and SIGKILL (srun forwards SIGTERM to every task)."""
STOP_POLL_S = 0.1


def state_path(run: RunPaths, job_id: str) -> Path:
    return run.root / "in-job" / f"{job_id}.json"


def _load(run: RunPaths, job_id: str) -> dict:
    """The job's state (:func:`state_path`).

    Raises:
        FileNotFoundError, UnreadableFileError, OSError: not a readable regular file. ValueError: not JSON.
    """
    state = read_json(state_path(run, job_id))
    if not isinstance(state, dict):
        raise ValueError(f"{state_path(run, job_id)}: not a JSON object")
    return state


def read_job_states(run: RunPaths) -> tuple[dict[str, dict], list[str]]:
    """Every job's state in ``<run>/in-job/`` (job id -> ``{"allocation", "need", "excluded": {node: why}, "steps":
    [{"nodes", "started" (POSIX s), "hang": None | {"nodes", "ranks", "silent_s"}, ...}]}``), and one line for each
    file that cannot be read as one (what ``opskit report`` shows of the job's steps)."""
    folder, states, unreadable = run.root / "in-job", {}, []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            state = _load(run, path.stem)
            if not isinstance(state.get("steps"), list) or not isinstance(state.get("excluded"), dict):
                raise ValueError("no steps list or excluded object")
            states[path.stem] = state
        except (OSError, ValueError) as e:
            unreadable.append(f"{path}: not a job's in-job state ({e})")
    return states, unreadable


def _save(run: RunPaths, job_id: str, state: dict) -> None:
    path = state_path(run, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(state, indent=1) + "\n")


# --------------------------------------------------------------------------- start: the next step's nodes


def start_step(run: RunPaths, job_id: str, need: int, nodelist: str,
               check: Callable[[list[str]], dict[str, str]] | None = None) -> tuple[list[str], Path, list[str]]:
    """The nodes of the job's next training step, and its heartbeat folder: the first ``need`` nodes of the
    allocation (``nodelist``, SLURM's syntax, in its order) that this job did not exclude, those on the run's
    bad-node list last (SLURM gave them to the job only when the partition had no others: they are tried rather than
    nothing); recorded with each node log's size, so that :func:`blame_failed_step` reads only this step's lines.

    Args:
        check: the pre-flight check (:func:`preflight_check`): usable nodes -> the failing ones with why, excluded
            for the rest of the job before any is picked.

    Returns:
        (nodes, heartbeat folder, lines for main_log.txt).

    Raises:
        InJobError: fewer than ``need`` usable nodes are left; ``run`` is no existing folder.
        OutputRefusedError: ``run`` is a folder opskit did not write (:func:`opskit.run.chain.claim_run_dir`).
    """
    if not run.root.is_dir():  # the job script runs in it: a missing one is a wrong RUN_DIR, never created here
        raise InJobError(f"RUN_DIR {run.root}: no such run directory (the job script passes its own)")
    chain.claim_run_dir(run, "in-job", write=False)
    path = state_path(run, job_id)
    state = (_load(run, job_id) if path.exists() else
             {"allocation": expand_nodelist(nodelist), "need": need, "excluded": {}, "steps": []})
    lines = []
    if check is not None:
        failing = check([n for n in state["allocation"] if n not in state["excluded"]])
        state["excluded"].update(failing)
        lines += [f"pre-flight: {node} kept out: {why}" for node, why in failing.items()]
    bad = chain.read_bad_nodes(run)
    usable = sorted((n for n in state["allocation"] if n not in state["excluded"]), key=lambda n: n in bad)
    if len(usable) < need:
        raise InJobError(f"{len(usable)} usable node(s) of the allocation for {need}: "
                         + "; ".join(f"{n}: {why}" for n, why in state["excluded"].items()))
    nodes = usable[:need]
    heartbeats = run.root / "in-job" / f"{job_id}.{len(state['steps'])}.heartbeats"
    state["steps"].append({"nodes": nodes, "started": time.time(), "heartbeats": str(heartbeats),
                           "log_offsets": {n: _size(run.node_log(job_id, n)) for n in nodes},
                           "main_log_offset": _size(run.main_log), "hang": None})
    _save(run, job_id, state)
    return nodes, heartbeats, lines


def _print(line: str) -> None:
    print(line, flush=True)


def preflight_check(run: RunPaths, margin: float, say: Callable[[str], None] = _print
                    ) -> Callable[[list[str]], dict[str, str]]:
    """``opskit preflight`` on the job's usable nodes, with the run's copy of its spec (``slurm/spec.yaml``): the
    failing nodes (put on the bad-node list) -> their problems. A check that cannot run excludes nobody (``say``
    gets the line saying why, for main_log.txt)."""
    from opskit.allocation.preflight import run_preflight
    from opskit.spec.load import load_spec

    def check(nodes: list[str]) -> dict[str, str]:
        try:
            verdict = run_preflight(load_spec(str(run.resolved_spec)), ",".join(nodes), margin, exclude=True, run=run)
        except OpskitError as e:
            say(f"pre-flight not run: {e}")
            return {}
        return {n.node: "; ".join(n.problems) for n in verdict.excluded}

    return check


class InJobError(OpskitError):
    """The allocation cannot go on training (too few usable nodes)."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# --------------------------------------------------------------------------- watch: the step's heartbeats


@dataclass(frozen=True)
class Limits:
    """Seconds without a beat that make a rank hung: ``timeout`` once training, at least ``hang_factor`` times the
    median time between the rank's beats in this step (so a slow model is not called hung for one slow iteration);
    ``startup`` before a rank's first iteration (compiles, warm-up)."""

    timeout: float
    startup: float
    hang_factor: float

    def limit(self, beat: Beat, intervals: list[float]) -> float:
        if beat.phase == "start":
            return max(self.startup, self.timeout)
        usual = self.hang_factor * statistics.median(intervals) if intervals else 0.0
        return max(self.timeout, usual)


def silent_ranks(beats: list[Beat], intervals: dict[int, list[float]], limits: Limits, now: float) -> list[Beat]:
    """The ranks whose last beat is older than their limit (:class:`Limits`)."""
    return [b for b in beats if now - b.seconds > limits.limit(b, intervals.get(b.rank, []))]


def hung_ranks(beats: list[Beat], silent: list[Beat]) -> list[Beat]:
    """Which of the silent ranks the others wait for, from the beats alone: in a collective every rank stops, but the
    ranks that went on began the next iteration (beat) before they blocked, so the hung ones are those behind the
    others' iteration. Empty when every rank is at the same iteration (the stacks may still tell)."""
    newest = max(b.iteration for b in beats)
    behind = [b for b in silent if b.iteration < newest]
    return behind if len(behind) < len(beats) else []


def watch_step(run: RunPaths, job_id: str, pid: int, limits: Limits, now=time.time, sleep=time.sleep,
               say: Callable[[str], None] = _print) -> int:
    """Watch the current step's heartbeats until process ``pid`` (the step's srun) ends; on a hang, ask every rank
    for its stacks, name the hung rank(s) (``say``: a line for main_log.txt; beats, else stacks), record it in the
    job's state and stop the step (SIGTERM, then SIGKILL after :data:`STOP_WAIT_S`).

    Returns:
        0 when the step ended on its own, 1 when it was stopped for a hang.
    """
    state = _load(run, job_id)
    step = state["steps"][-1]
    folder = Path(step["heartbeats"])
    seen: dict[int, float] = {}
    intervals: dict[int, list[float]] = {}
    while _running(pid):
        beats = read_beats(folder)
        for b in beats:
            if b.rank in seen and b.seconds > seen[b.rank] and b.phase == "train":
                intervals.setdefault(b.rank, []).append(b.seconds - seen[b.rank])
                del intervals[b.rank][:-50]
            seen[b.rank] = b.seconds
        silent = silent_ranks(beats, intervals, limits, now()) if beats else []
        if silent:
            _report_hang(run, job_id, state, beats, silent, limits, now, sleep, say)
            _stop(pid, sleep)
            return 1
        sleep(POLL_S)
    return 0


def _running(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _report_hang(run: RunPaths, job_id: str, state: dict, beats: list[Beat], silent: list[Beat], limits: Limits,
                 now, sleep, say: Callable[[str], None]) -> None:
    step = state["steps"][-1]
    folder = Path(step["heartbeats"])
    (folder / DUMP_REQUEST).touch()
    sleep(DUMP_WAIT_S)
    hung = hung_ranks(beats, silent)
    named = [(b.node, b.local_rank) for b in hung]
    how = "behind the others' iteration"
    if not named:
        with open_regular(run.main_log) as log:
            log.seek(step["main_log_offset"])
            stuck = stuck_ranks(rank_stacks(bounded_lines(log), step["nodes"]))
        named, how = [(s.node, s.local_rank) for s in stuck if s.node], "from the stacks"
    age = max(now() - b.seconds for b in silent)
    oldest = min(silent, key=lambda b: b.seconds)
    who = ", ".join(f"{node} local rank {lr}" for node, lr in named) if named else "not named (every rank alike)"
    say(f"{HANG_LINE}{len(silent)} of {len(beats)} ranks silent for up to {age:.0f} s (limit "
        f"{limits.limit(oldest, []):.0f} s; last iteration {oldest.iteration}); hung: {who}"
        + (f" ({how})" if named else "") + "; stopping the step")
    step["hang"] = {"nodes": sorted({node for node, _ in named}), "ranks": [b.rank for b in hung],
                    "silent_s": round(age, 1)}
    _save(run, job_id, state)


def _stop(pid: int, sleep) -> None:
    """SIGTERM to the step's process and its local children (srun forwards it to every task), SIGKILL to whatever
    is left after :data:`STOP_WAIT_S`. Nothing is reaped here: the step's parent (the job) must read its exit status
    (a child reaped by another wait reads as 0 to Python's ``Popen.wait``)."""
    try:
        parent = psutil.Process(pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in processes:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        sleep(STOP_POLL_S)
    for p in processes:
        if _alive(p):
            _signal(p, signal.SIGKILL)


def _alive(process: psutil.Process) -> bool:
    """Still running (a zombie has ended: its parent reaps it)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(process: psutil.Process, sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


# --------------------------------------------------------------------------- failed: blame and decide


def blame_failed_step(run: RunPaths, job_id: str, now: datetime | None = None) -> tuple[bool, list[str]]:
    """After a step that failed: the node(s) to blame (a hang the watchdog named, crash lines in this step's part of
    the per-node logs, or nodes SLURM holds down), put on this job's excluded list and the run's bad-node list.

    Returns:
        (restart, lines for main_log.txt): restart in this allocation when a node was blamed and enough usable nodes
        are left, or after a hang no rank could be blamed for (same nodes); not after a failure nothing explains (the
        trainer's own error: the chain's failure count handles it).
    """
    state = _load(run, job_id)
    step = state["steps"][-1]
    blamed: dict[str, str] = {}
    hang = step["hang"]
    if hang is not None:
        blamed = {node: f"hung (silent {hang['silent_s']:.0f} s)" for node in hang["nodes"]}
    else:
        for node in step["nodes"]:
            crashes = find_crashes(_lines_from(run.node_log(job_id, node), step["log_offsets"].get(node, 0)),
                                   node=node)
            if crashes:
                blamed[node] = f"{crashes[0].signature}: {crashes[0].line.strip()[:200]}"
        if not blamed:
            blamed = _down(step["nodes"])
    if not blamed:
        if hang is not None:
            return True, ["no rank could be blamed for the hang: restarting on the same nodes"]
        return False, ["the step failed with no crash line, hang or node down to blame: no restart in this job"]
    return keep_out(run, job_id, blamed, now)


def keep_out(run: RunPaths, job_id: str, nodes: dict[str, str], now: datetime | None = None
             ) -> tuple[bool, list[str]]:
    """Keep ``nodes`` (node -> why) out of this job's later steps and off the chain's (the run's bad-node list; under
    SLURM the queued tasks' ``--exclude`` too).

    Returns:
        (restart: enough usable nodes are left in the allocation, lines for main_log.txt).
    """
    state = _load(run, job_id)
    stamp = f"{now or datetime.now():%Y-%m-%d %H:%M:%S}"
    state["excluded"].update(nodes)
    _save(run, job_id, state)
    chain.add_bad_nodes(run, {n: f"{stamp} job {job_id} (in-job): {why}" for n, why in nodes.items()})
    lines = [f"blamed {node}: {why}" for node, why in nodes.items()]
    if _under_slurm():  # the chain's queued tasks keep out of it too
        lines.append(chain.exclude_in_queue_line(run, len(state["allocation"]), os.environ.get("SLURM_JOB_PARTITION"),
                                                 list(nodes)))
    usable = [n for n in state["allocation"] if n not in state["excluded"]]
    if len(usable) < state["need"]:
        lines.append(f"{len(usable)} usable node(s) left for {state['need']}: the chain's next task takes over")
        return False, lines
    return True, lines


def _lines_from(path: Path, offset: int) -> list[str]:
    """The lines of ``path`` after byte ``offset`` ([] for a node that left no log, or one that is not a regular
    file); a line longer than :data:`opskit.fsutil.MAX_LINE` is left out."""
    try:
        with open_regular(path) as f:
            f.seek(offset)
            return [line.rstrip("\n") for line in bounded_lines(f)]
    except OSError:
        return []


def _under_slurm() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID")) and not os.environ.get("OPSKIT_LOCAL")


def _down(nodes: list[str]) -> dict[str, str]:
    """The step's nodes SLURM holds down (none outside SLURM, or when sinfo fails)."""
    if not _under_slurm():
        return {}
    try:
        return client.down_nodes(",".join(nodes))
    except client.SlurmError:
        return {}


# --------------------------------------------------------------------------- entry of scripts rendered before job.py


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["start"] and len(args) in (5, 6):  # 6: with --preflight
            _, root, job_id, need, nodelist, *preflight = args
            run = RunPaths(Path(root))
            check = preflight_check(run, PREFLIGHT_MARGIN) if preflight == ["--preflight"] and _under_slurm() else None
            nodes, heartbeats, lines = start_step(run, job_id, int(need), nodelist, check)
            print("\n".join([*lines, f"STEP {','.join(nodes)} {heartbeats}"]))
            return 0
        if args[:1] == ["watch"] and len(args) == 7:
            _, root, job_id, pid, timeout, startup, factor = args
            return watch_step(RunPaths(Path(root)), job_id, int(pid),
                              Limits(float(timeout), float(startup), float(factor)))
        if args[:1] == ["failed"] and len(args) == 3:
            restart, lines = blame_failed_step(RunPaths(Path(args[1])), args[2])
            print("\n".join(lines))
            return 0 if restart else CANNOT_CONTINUE
    except (InJobError, OutputRefusedError) as e:
        print(f"no restart in this job: {e}")
        return CANNOT_CONTINUE
    except (OSError, ValueError, KeyError, chain.ChainError) as e:
        print(f"in-job recovery: {type(e).__name__}: {e}")
        return CANNOT_CONTINUE
    print(f"usage: python -m opskit.allocation.in_job start|watch|failed ... (got {args!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
