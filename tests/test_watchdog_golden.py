"""The watchdog's whole output held to golden files: each scenario builds a run folder (no run directory, no log, a
healthy log, a hang with stacks, spikes, NaN, crash lines, a failed save, incomplete and missing checkpoints, the kill
switch, ledger failures, bad nodes, disk thresholds, an events-only run, stragglers, an unreachable scheduler, ...),
runs ``run_checks`` once or twice against a fake squeue and a fake ``statvfs``, and compares every finding (key,
severity, message, data), the PULSE lines, the report's flags, the saved watchdog state and what the watchdog did
(scancel calls, the bad-node list) to ``tests/golden_watchdog/<scenario>.json``.

The golden files were written by the watchdog before it became a pipeline (snapshot -> checks -> actions -> next
state): its findings must not change. ``OPSKIT_UPDATE_GOLDEN=1`` rewrites them; the diff is reviewed in the commit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec

from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.slurm.client import QueueEntry, SchedulerUnreachable
from opskit.spec.load import load_spec

GOLDEN = Path(__file__).parent / "golden_watchdog"
FIXTURES = Path(__file__).parent / "fixtures" / "logs"
NOW = datetime(2026, 11, 21, 12, 0, 0)
JOB = "opskit-wd-golden"
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"


def at(hours_ago: float) -> float:
    return (NOW - timedelta(hours=hours_ago)).timestamp()


def iteration(n: int, seconds: float = 100.0, loss: float = 5.0) -> str:
    """One Megatron iteration line of a 1000-iteration run (16 samples of 512 tokens)."""
    return (f" iteration {n:8d}/    1000 | consumed samples: {16 * n:12d} | consumed tokens: {16 * 512 * n:12d} | "
            f"elapsed time per iteration (s): {seconds:.2f} | learning rate: 3.000E-04 | global batch size:    16 | "
            f"lm loss: {loss:E} | grad norm: 0.500 | num zeros: 0.0 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 | samples per second: 0.160 | TFLOPs: 1.00 |\n")


def header(when: str, job: int, task: str, what: str, nodes: str = "n[1-2]") -> str:
    return f"[opskit] {when} job {job} (array task {task}) nodes {nodes}: {what}\n"


def stack_dump(label: str, path: str) -> list[str]:
    """faulthandler's dump of a rank whose main thread waits in ``path``, as ``label`` (srun's and torchrun's
    prefixes) writes it into main_log."""
    return [f"{label}{line}" for line in (
        "Timeout (0:00:00.300000)!",
        "Thread 0x00007f0000000002 (most recent call first):",
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait',
        "",
        "Thread 0x00007f0000000001 (most recent call first):",
        f'  File "/x/{path}", line 4 in wait',
        '  File "/x/opskit/train/main.py", line 9 in <module>')]


class Cluster:
    """What the fake SLURM answers (``entries``, or ``unreachable``) and what the watchdog asked of it."""

    def __init__(self, run: RunPaths):
        self.run = run
        self.entries: list[QueueEntry] = []
        self.unreachable = False
        self.cancelled: list[list[str]] = []

    def squeue(self, *args, **kwargs) -> list[QueueEntry]:
        if self.unreachable:
            raise SchedulerUnreachable("squeue: error: slurm_load_jobs error: Unable to contact slurm controller")
        return list(self.entries)

    def scancel(self, ids, *args, **kwargs) -> None:
        self.cancelled.append(list(ids))

    def running(self, job_id: str = "711114_4", hours: float = 5.0, nodes: str = "n[1-2]") -> None:
        self.entries.append(QueueEntry(job_id, "gpu_p13", JOB, "RUNNING", f"{int(hours)}:00:00", "2",
                                       f"{NOW - timedelta(hours=hours):{SLURM_TIME}}", nodes,
                                       f"{NOW - timedelta(hours=hours + 1):{SLURM_TIME}}", "20:00:00",
                                       chain.job_comment(self.run), str(self.run.script)))

    def pending(self, job_id: str = "711114_[5-6%1]", reason: str = "(JobArrayTaskLimit)",
                submitted_hours: float = 6.0) -> None:
        self.entries.append(QueueEntry(job_id, "gpu_p13", JOB, "PENDING", "0:00", "2", "N/A", reason,
                                       f"{NOW - timedelta(hours=submitted_hours):{SLURM_TIME}}", "20:00:00",
                                       chain.job_comment(self.run), str(self.run.script)))


class Disk:
    """A fake ``os.statvfs``: ``percent`` of the bytes and ``inode_percent`` of the inodes used."""

    def __init__(self):
        self.percent, self.inode_percent = 40.0, 10.0

    def statvfs(self, path):
        blocks, files = 1_000_000, 100_000
        return os.statvfs_result((4096, 4096, blocks, round(blocks * (1 - self.percent / 100)),
                                  round(blocks * (1 - self.percent / 100)), files,
                                  round(files * (1 - self.inode_percent / 100)),
                                  round(files * (1 - self.inode_percent / 100)), 0, 255))


@pytest.fixture(scope="module")
def complete_step(tmp_path_factory) -> Path:
    """A checkpoint folder whose ``latest`` names a complete ``global_step100`` (hand-built, BLOOM, TP=1)."""
    from megatron_ckpt import build_checkpoint

    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    build_checkpoint(root, arch="bloom", tp=1, layers=1, hidden=32, heads=2, vocab=200, iteration=100)
    return root


def copy_step(source: Path, run: RunPaths, hours_ago: float) -> None:
    shutil.copytree(source, run.checkpoints)
    os.utime(run.checkpoints / "global_step100", (at(hours_ago),) * 2)


def healthy_log(run: RunPaths, first: int = 1, last: int = 120) -> None:
    run.logs.mkdir(parents=True, exist_ok=True)
    run.main_log.write_text(header("2026-11-21 07:00:00", 711118, "711114_4", "start") + "".join(
        iteration(n) for n in range(first, last + 1)) + "saving checkpoint at iteration     100 to /ckpt\n"
        "  successfully saved checkpoint at iteration     100 to /ckpt\n")


def fixture_log(run: RunPaths, *names: str) -> None:
    run.logs.mkdir(parents=True, exist_ok=True)
    run.main_log.write_text("".join((FIXTURES / name).read_text() for name in names))


def ledger(run: RunPaths, *states: str, hours_ago: float = 2.0) -> None:
    for i, state in enumerate(states, 1):
        chain.record(run, chain.TaskOutcome(f"{NOW - timedelta(hours=hours_ago):%Y-%m-%d %H:%M:%S}", "711114",
                                            f"711114_{i}", state, 0 if state == "COMPLETED" else 1, "n[1-2]",
                                            "CUDA error: unknown error on n1" if state == "FAILED" else ""))


# --------------------------------------------------------------------------- scenarios
# Each builds the run (its spec's run directory), the fake queue and disk; returns the watchdog settings to use and
# how many times to run the checks (a later run reads only what the log gained: `more` appends between runs).


def no_run_dir(run, cluster, disk, step):
    shutil.rmtree(run.root)


def fresh(run, cluster, disk, step):
    cluster.pending(submitted_hours=0.1)


def healthy_running(run, cluster, disk, step):
    healthy_log(run)
    os.utime(run.main_log, (at(0.02),) * 2)
    copy_step(step, run, 0.5)
    cluster.running()
    cluster.pending()


def short_queue_and_pending_forever(run, cluster, disk, step):
    healthy_log(run)
    os.utime(run.main_log, (at(0.02),) * 2)
    copy_step(step, run, 0.5)
    cluster.running(hours=19.5)
    cluster.pending("711200_[1-3%1]", "(PartitionConfig)", 1.0)


def pending_too_long(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    cluster.pending(submitted_hours=30.0)
    return {"max_pending_hours": 12}


def exclusive_reservation(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    ledger(run, "COMPLETED", hours_ago=0.5)
    cluster.pending(submitted_hours=30.0)
    return {"exclusive_reservation": True}


def absent(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)


def finished(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    run.finished_flag.write_text("2026-11-21 10:00:00 training done at iteration 1000\n")


def stopped_storm(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    run.stopped_flag.write_text(f"2026-11-21 10:00:00 {chain.RESTART_STORM}: 5 restarts within 1 h\n")


def stopped(run, cluster, disk, step):
    healthy_log(run)
    run.stopped_flag.write_text("2026-11-21 08:00:00 ***ALERT: 3 consecutive failed tasks***\n")


def spike_open(run, cluster, disk, step):
    lines = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines(keepends=True)
    run.logs.mkdir(parents=True)
    run.main_log.write_text("".join(line for line in lines if "iteration    3125" not in line))
    cluster.running()


def spike_recovered(run, cluster, disk, step):
    fixture_log(run, "tr11-176B-spike.txt")


def nan(run, cluster, disk, step):
    fixture_log(run, "nan.txt")
    cluster.running()


def malformed(run, cluster, disk, step):
    fixture_log(run, "malformed.txt")


def restart(run, cluster, disk, step):
    fixture_log(run, "restart.txt")


def hang_with_stacks(run, cluster, disk, step):
    fixture_log(run, "hang.txt")
    waiting = stack_dump("0: [default0]:", "site-packages/torch/distributed/distributed_c10d.py")
    other = stack_dump("0: [default1]:", "site-packages/torch/distributed/distributed_c10d.py")
    stuck = stack_dump("1: [default1]:", "opskit/train/data.py")
    with open(run.main_log, "a") as f:
        f.write(header("2026-11-21 06:00:00", 711118, "711114_4", "start") + "\n".join(
            line for group in zip(waiting, other, stuck, strict=True) for line in group) + "\n")
    os.utime(run.main_log, (at(3),) * 2)
    cluster.running(hours=5)
    return {"hang_factor": 10, "hang_min_minutes": 30}


def hang_cancelled(run, cluster, disk, step):
    hang_with_stacks(run, cluster, disk, step)
    return {"hang_factor": 10, "hang_min_minutes": 30, "cancel_hung": True}


def hang_stacks_from_the_state(run, cluster, disk, step):
    """The stacks come in the second run's read, an hour into the hang (no job header in this log: no node named)."""
    fixture_log(run, "hang.txt")
    cluster.running(hours=5)

    def more():
        waiting = stack_dump("0: [default0]:", "site-packages/torch/distributed/distributed_c10d.py")
        stuck = stack_dump("1: [default1]:", "opskit/train/data.py")
        with open(run.main_log, "a") as f:
            f.write("\n".join(line for group in zip(waiting, stuck, strict=True) for line in group) + "\n")
        os.utime(run.main_log, (at(3),) * 2)
    return {"hang_factor": 10, "hang_min_minutes": 30}, more


def crash(run, cluster, disk, step):
    fixture_log(run, "crash.txt")
    with open(run.main_log, "a") as f:
        f.write(header("2026-11-21 08:00:00", 9, "8_1", "start") +
                "1: [default0]:RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191\n")
    cluster.running()


def save_failed_and_fallback(run, cluster, disk, step):
    healthy_log(run)
    with open(run.main_log, "a") as f:
        f.write("saving checkpoint at iteration     120 to /scratch/run/checkpoints\n"
                "[default0]:error: saving global_step120 failed: [Errno 28] No space left on device "
                "(/scratch/run/checkpoints/global_step120/zero_pp_rank_0_mp_rank_00_optim_states.pt)\n")
    copy_step(step, run, 1.0)


def incomplete_latest(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    (run.checkpoints / "latest").write_text("global_step200")
    (run.checkpoints / "global_step200").mkdir()
    cluster.running()


def binary_latest(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    (run.checkpoints / "latest").write_bytes(b"\x00\xff\x00garbage")


def saved_step_gone(run, cluster, disk, step):
    healthy_log(run, 1, 220)
    with open(run.main_log, "a") as f:
        f.write("  successfully saved checkpoint at iteration     200 to /ckpt\n")
    copy_step(step, run, 1.0)
    cluster.running()


def no_checkpoint_although_saved(run, cluster, disk, step):
    healthy_log(run)
    cluster.running()


def checkpoint_folder_is_a_file(run, cluster, disk, step):
    healthy_log(run)
    run.checkpoints.write_text("oops\n")


def old_checkpoint(run, cluster, disk, step):
    healthy_log(run)
    os.utime(run.main_log, (at(0.02),) * 2)
    copy_step(step, run, 20.0)
    cluster.running()


def chain_files(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 3.0)
    run.kill_switch.write_text("2026-11-21 09:30:00 opskit kill-switch on\n")
    ledger(run, "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", hours_ago=1.0)
    with open(run.ledger, "a") as f:
        f.write('{"torn": \n')
    chain.write_bad_nodes(run, {"n7": "2026-11-21 09:00:00 NODE_FAIL of task 711114_4"})
    cluster.pending()


def failure_cut_a_save_short(run, cluster, disk, step):
    """A node died while global_step150 was being written: the task lost its training since global_step100, the
    step the next task resumes from, not since the cut-short folder."""
    healthy_log(run)
    copy_step(step, run, 3.0)
    cut = run.checkpoints / "global_step150"
    cut.mkdir()
    (cut / "layer_01-model_00-model_states.pt").write_bytes(b"PK\x03\x04")
    os.utime(cut, (at(1.5),) * 2)
    ledger(run, "NODE_FAIL", hours_ago=1.0)
    cluster.pending()


def bad_node_list_is_damaged(run, cluster, disk, step):
    healthy_log(run)
    run.bad_nodes.write_text("\tno host here\n")


def ledger_without_log(run, cluster, disk, step):
    ledger(run, "COMPLETED")


def log_is_a_folder(run, cluster, disk, step):
    run.main_log.mkdir(parents=True)


def logs_is_a_file(run, cluster, disk, step):
    run.logs.write_text("x\n")
    ledger(run, "COMPLETED")


def no_iteration_lines(run, cluster, disk, step):
    run.logs.mkdir(parents=True)
    run.main_log.write_text("garbage\n" * 50)
    ledger(run, "COMPLETED")


def disk_warn(run, cluster, disk, step):
    healthy_log(run)
    disk.percent, disk.inode_percent = 90.0, 50.0


def disk_alert(run, cluster, disk, step):
    healthy_log(run)
    disk.percent, disk.inode_percent = 97.0, 99.5


def events_only(run, cluster, disk, step):
    from opskit.train.log import TensorBoard

    board = TensorBoard(str(run.tensorboard), 10, True)  # the trainer's own writer, Megatron's tags
    for it in range(1, 121):
        board.iteration(it, it * 16, it * 16 * 512, 3e-4, 16, 9.0 if it == 118 else 6.0 - it / 100, 0.5, None)
    board.close()
    for event in run.tensorboard.rglob("*tfevents*"):
        os.utime(event, (at(1),) * 2)


def stragglers(run, cluster, disk, step, exclude: bool = False):
    healthy_log(run)
    with open(run.main_log, "a") as f:
        for first in (121, 125, 129):
            f.write(f"[opskit] forward time per rank, iterations {first}-{first + 3}: slowest rank 5 on n2 (local "
                    "rank 1, stage 0) 30.0 ms = 2.00x the median of its stage's other ranks (15.0 ms)\n")
    cluster.running()
    return {"exclude_stragglers": exclude}


def stragglers_excluded(run, cluster, disk, step):
    return stragglers(run, cluster, disk, step, exclude=True)


def save_interval_measured(run, cluster, disk, step):
    run.logs.mkdir(parents=True)
    run.main_log.write_text(
        header("2026-11-11 00:00:00", 7, "7_1", "start") + iteration(1) + "saving checkpoint at iteration       1 "
        "to /ckpt\n  successfully saved checkpoint at iteration       1 to /ckpt\n"
        "time (ms) | save-checkpoint: 30000.00\n" + iteration(2) + header("2026-11-11 10:00:00", 7, "7_1",
                                                                          "end, exit code 1")
        + header("2026-11-11 12:00:00", 8, "8_1", "start") + iteration(2) + "time (ms) | save-checkpoint: 50000.00\n"
        + header("2026-11-12 08:00:00", 8, "8_1", "end, exit code 0"))
    ledger(run, "FAILED", "COMPLETED", "NODE_FAIL", hours_ago=200)


def incremental(run, cluster, disk, step):
    """Two runs: the second reads the lines the log gained (a spike in them), the old spike is no news."""
    fixture_log(run, "tr11-176B-spike.txt")
    cluster.running()

    def more():
        lines = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines(keepends=True)
        with open(run.main_log, "a") as f:
            f.write("".join(line.replace("3125", "3135") for line in lines[-2:]) + lines[-1][:80])
    return {}, more


def unreachable(run, cluster, disk, step):
    healthy_log(run)
    copy_step(step, run, 1.0)
    cluster.unreachable = True


def unreachable_then_running(run, cluster, disk, step):
    unreachable(run, cluster, disk, step)

    def more():
        cluster.unreachable = False
        cluster.running()
    return {}, more


SCENARIOS = {f.__name__: f for f in (
    no_run_dir, fresh, healthy_running, short_queue_and_pending_forever, pending_too_long,
    exclusive_reservation, absent, finished, stopped_storm, stopped, spike_open, spike_recovered, nan, malformed,
    restart, hang_with_stacks, hang_cancelled, hang_stacks_from_the_state, crash, save_failed_and_fallback,
    incomplete_latest, binary_latest, saved_step_gone, no_checkpoint_although_saved, checkpoint_folder_is_a_file,
    old_checkpoint, chain_files, failure_cut_a_save_short, bad_node_list_is_damaged, ledger_without_log,
    log_is_a_folder, logs_is_a_file, no_iteration_lines, disk_warn, disk_alert, events_only, stragglers,
    stragglers_excluded, save_interval_measured, incremental, unreachable, unreachable_then_running)}


# --------------------------------------------------------------------------- running and comparing


def settle(folder: Path) -> None:
    """What the scenario wrote at the real time (after NOW) dated an hour before NOW: mtimes are the watchdog's
    clocks (the last iteration line, a step's age, the training a failed task lost)."""
    for path in [folder, *folder.rglob("*")]:
        if path.lstat().st_mtime > NOW.timestamp():
            os.utime(path, (at(1),) * 2, follow_symlinks=False)


def normalise(value, tmp: str):
    """``value`` with the test's folder as ``<tmp>``, the stamp of today's date (a bad node's reason) as ``<now>``."""
    text = json.dumps(value, sort_keys=True).replace(tmp, "<tmp>")
    text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d straggler", "<now> straggler", text)
    return json.loads(text)


def outcome(tmp_path: Path, scenario, step: Path, monkeypatch) -> list[dict]:
    """Every run's report, saved state and actions, normalised."""
    from opskit.monitor.watchdog import run_checks

    spec_path = write_spec(tmp_path / f"{JOB}.yaml", SimpleNamespace(data_prefix=tmp_path / "data" / "kjv"),
                           tmp_path / "run", slurm={"job_name": JOB})
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "submit")  # as `opskit submit` leaves it
    cluster, disk = Cluster(run), Disk()
    monkeypatch.setattr(client, "squeue", cluster.squeue)
    monkeypatch.setattr(client, "scancel", cluster.scancel)
    monkeypatch.setattr(os, "statvfs", disk.statvfs)
    built = scenario(run, cluster, disk, step) or {}
    watchdog, more = built if isinstance(built, tuple) else (built, None)
    if watchdog:
        spec_path = write_spec(spec_path, SimpleNamespace(data_prefix=tmp_path / "data" / "kjv"), tmp_path / "run",
                               slurm={"job_name": JOB}, watchdog=watchdog)
    spec = load_spec(str(spec_path))
    runs = []
    for when in (NOW, NOW + timedelta(hours=1)) if more else (NOW,):
        if runs:
            more()
        if run.root.exists():
            settle(run.root)
        report = run_checks(spec, now=when, users=["someone"])
        state = json.loads(run.watchdog_state.read_text()) if run.watchdog_state.is_file() else None
        if state and state.get("inode") is not None:
            state["inode"] = "<inode>"
        if state and isinstance(state.get("history"), list):  # kept short: its length, ends and digest
            history = state["history"]
            state["history"] = {"records": len(history), "iterations": [r.get("iteration") for r in history[:1]
                                                                         + history[-1:]],
                                "sha256": hashlib.sha256(json.dumps(history, sort_keys=True).encode()).hexdigest()}
        runs.append({**report.as_json(), "unknown": list(report.unknown), "run_missing": report.run_missing,
                     "state_error": report.state_error, "main_log": str(report.main_log), "state": state,
                     "cancelled": cluster.cancelled,
                     "bad_nodes": run.bad_nodes.read_text() if run.bad_nodes.is_file() else None})
    return normalise(runs, str(tmp_path))


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_watchdog_reports_as_its_golden_file_says(name, tmp_path, monkeypatch, complete_step):
    got = outcome(tmp_path, SCENARIOS[name], complete_step, monkeypatch)
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("OPSKIT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(golden.read_text())


VOLATILE = ("age_s", "waited_s", "hours", "seconds", "percent", "wall_hours", "wall_seconds", "end", "goodput")


def masked(value):
    """``value`` without what the real clock moves: VOLATILE keys' values as ``<now>``."""
    if isinstance(value, dict):
        return {k: "<now>" if k in VOLATILE and not isinstance(v, dict) else masked(v) for k, v in value.items()}
    return [masked(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize(("name", "args"), [("save_interval_measured", ("--json",)), ("no_run_dir", ("--json",)),
                                            ("chain_files", ("--json", "--ack"))])
def test_status_json_as_its_golden_file_says(name, args, tmp_path, monkeypatch, complete_step):
    """``opskit status --json``: the report with the exit code, the alerts' outcome and the goodput summary, as the
    CLI printed them before it stopped composing them itself. Its clock is the real one: the findings are compared
    by key and severity (the messages are the other test's), the PULSE lines' stamps and the figures the clock moves
    (VOLATILE) are left out."""
    from typer.testing import CliRunner

    from opskit.cli.app import app

    outcome(tmp_path, SCENARIOS[name], complete_step, monkeypatch)  # the run folder, the fake queue and disk
    done = CliRunner().invoke(app, ["status", str(tmp_path / f"{JOB}.yaml"), *args])
    got = masked(normalise(json.loads(done.stdout), str(tmp_path)))
    got.pop("time")
    got["findings"] = [(f["key"], f["severity"]) for f in got["findings"]]
    got["lines"] = [line[22:] for line in got["lines"]]
    golden = GOLDEN / f"cli-{name}.json"
    if os.environ.get("OPSKIT_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert json.loads(json.dumps(got)) == json.loads(golden.read_text())


@pytest.mark.parametrize("name", ["no_run_dir", "healthy_running", "hang_with_stacks", "chain_files",
                                  "saved_step_gone", "save_interval_measured", "stragglers"])
def test_the_checks_read_nothing_but_the_snapshot(name, tmp_path, monkeypatch, complete_step):
    """Every check of CHECKS computes on the snapshot alone: with the run folder gone and SLURM and statvfs failing
    after the read, the findings are the same."""
    from opskit.monitor.checks import CHECKS
    from opskit.monitor.snapshot import read_snapshot
    from opskit.monitor.watch_state import WatchdogState

    outcome(tmp_path, SCENARIOS[name], complete_step, monkeypatch)  # the run folder, the fake queue and disk
    spec = load_spec(str(tmp_path / f"{JOB}.yaml"))
    snap = read_snapshot(spec, WatchdogState(), NOW, users=["someone"])
    before = [f for check in CHECKS for f in check(snap, spec)]
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    (tmp_path / "run").write_text("not the run read\n")

    def unavailable(*args, **kwargs):
        raise AssertionError("a check did I/O")
    for name_ in ("squeue", "scancel"):
        monkeypatch.setattr(client, name_, unavailable)
    monkeypatch.setattr(os, "statvfs", unavailable)
    assert [f for check in CHECKS for f in check(snap, spec)] == before
    assert {f.key for f in before} & {"run.missing", "scheduler.running", "log.hang", "chain.failures",
                                      "checkpoint.missing", "checkpoint.save_interval", "log.straggler"}
