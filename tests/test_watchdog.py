"""The watchdog behind `opskit status`: log health on fixtures built from the chronicles' real lines (tr11's spike at
31215-31250, a NaN run, a hang, a CUDA crash, cut lines), incremental reads from a saved offset, checkpoints, disk;
the scheduler findings against the real local SLURM (running, pending on dependency / array limit / begin time,
absent, unreachable through a SLURM_CONF whose controller does not answer); alerts through a real SMTP server
(aiosmtpd), a local webhook server and a command, de-duplicated, acknowledged and resolved."""

from __future__ import annotations

import email
import email.policy
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import as_run, queued, running, unique, write_spec

from opskit.logs.parse import read_from
from opskit.monitor.checks import checkpoint_findings, disk_findings, log_findings, progress_findings
from opskit.monitor.snapshot import progress_of, read_checkpoints, read_disk, read_log
from opskit.monitor.watch_state import WatchdogState, load_state, save_state
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.spec.schema import WatchdogSpec

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
OPSKIT = str(Path(sys.executable).with_name("opskit"))
NOW = datetime(2026, 11, 21, 12, 0, 0)


def run_with_log(tmp_path: Path, *fixtures: str) -> RunPaths:
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text("".join((FIXTURES / f).read_text() for f in fixtures))
    return run


def keys(findings) -> dict[str, str]:
    return {f.key: f.severity for f in findings}


def only(findings, key: str):
    [finding] = [f for f in findings if f.key == key]
    return finding


# --------------------------------------------------------------------------- log health


def test_tr11_spike_with_rollback_and_skip_range(tmp_path):
    run = run_with_log(tmp_path, "tr11-176B-spike.txt")
    log = read_log(run, WatchdogState())
    findings = log_findings(log, WatchdogSpec(), NOW, running_since=None, save_interval=100)
    loss = only(findings, "log.lm_loss_spike")
    # Recovered at the real 31250 line: a warning with the chronicles' remedy, not an open alert.
    assert loss.severity == "warn"
    assert (loss.data["first"], loss.data["peak_iteration"], loss.data["recovered_at"]) == (31216, 31219, 31250)
    assert "roll back to global_step31200 and restart with --skip-train-iteration-range 31201-31249" in loss.message
    grad = only(findings, "log.grad_norm_spike")
    assert grad.severity == "warn" and grad.data["first"] == 31215 and grad.data["peak"] == 960.351
    assert "log.nan" not in keys(findings) and "log.crash" not in keys(findings)

    # Progress as the tr11 chronicle computed it: (115311 - 31251) x ~106 s = ~103 days.
    eta = progress_of(load_spec("tr11-176B-ml"), log.records)
    [progress], seconds_left, per_it = progress_findings(eta), eta.seconds_left, eta.seconds_per_iteration
    assert progress.message.startswith("progress: iteration 31,251 of 115,311 (27.1%), 84,060 left")
    assert "days at this speed" in progress.message and "tokens: 98.0B consumed / " in progress.message
    assert 100 < seconds_left / 86400 < 106 and 105 < per_it < 107


def test_spike_still_open_is_an_alert(tmp_path):
    lines = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines(keepends=True)
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text("".join(line for line in lines if "iteration    3125" not in line))  # no recovery yet
    loss = only(log_findings(read_log(run, WatchdogState()), WatchdogSpec(), NOW, None, 100), "log.lm_loss_spike")
    assert loss.severity == "alert" and "not recovered" in loss.message


def test_incremental_reads_only_new_bytes(tmp_path):
    run = run_with_log(tmp_path, "tr11-176B-spike.txt")
    state = WatchdogState()
    first = read_log(run, state)
    assert state == WatchdogState()  # the read returns the next state, it changes none
    state = first.state
    assert len(first.new) == 125 and state.offset == run.main_log.stat().st_size
    save_state(run, state)

    # An hour later: two more lines and half of a third (a rank still writing it).
    spike_lines = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines(keepends=True)
    new_lines = [line.replace("3125", "3135") for line in spike_lines[-2:]]
    partial = new_lines[0][:80]
    with open(run.main_log, "a") as f:
        f.write("".join(new_lines) + partial)
    state = load_state(run)
    second = read_log(run, state)
    state = second.state
    assert [r["iteration"] for r in second.new] == [31350, 31351]
    assert state.offset == run.main_log.stat().st_size - len(partial)
    assert len(second.records) == 127 and second.text == "".join(new_lines)
    # No spike news in the new lines: the old spike is not reported again.
    assert not {"log.lm_loss_spike", "log.grad_norm_spike"} & set(keys(log_findings(second, WatchdogSpec(), NOW, None)))

    # A log replaced by a shorter file (a sync, a truncation) is read from its start.
    run.main_log.write_text("".join(spike_lines[1:4]))
    third = read_log(run, state)
    assert [r["iteration"] for r in third.new] == [31100, 31101, 31102] and len(third.records) == 3


def test_nan_run(tmp_path):
    run = run_with_log(tmp_path, "nan.txt")
    findings = log_findings(read_log(run, WatchdogState()), WatchdogSpec(), NOW, None)
    nan = only(findings, "log.nan")
    assert nan.severity == "alert"
    assert nan.data == {"iterations": [12725], "nan_iterations": 5}
    assert nan.message.startswith("lm loss NaN/inf at iteration(s) 12725; 5 nan iteration(s) since the last check")


def test_hang_while_running(tmp_path):
    run = run_with_log(tmp_path, "hang.txt")
    last_line_at = NOW - timedelta(hours=3)
    os.utime(run.main_log, (last_line_at.timestamp(),) * 2)
    wd = WatchdogSpec(hang_factor=10, hang_min_minutes=30)
    log = read_log(run, WatchdogState())
    hang = only(log_findings(log, wd, NOW, running_since=NOW - timedelta(hours=5)), "log.hang")
    assert hang.severity == "alert" and hang.data["last_iteration"] == 12734
    assert hang.data["silent_s"] == 3 * 3600 and hang.data["interval_s"] == 105.22
    assert "no new iteration line for 180 min while running" in hang.message
    # A task that started 20 minutes ago is still loading its checkpoint; a job that is not running cannot hang.
    assert "log.hang" not in keys(log_findings(log, wd, NOW, running_since=NOW - timedelta(minutes=20)))
    assert "log.hang" not in keys(log_findings(log, wd, NOW, running_since=None))
    # 10 x 105 s is under the 30-minute floor: silence of 25 minutes is no hang, 40 minutes is.
    assert "log.hang" not in keys(log_findings(log, wd, last_line_at + timedelta(minutes=25), NOW - timedelta(hours=5)))
    assert "log.hang" in keys(log_findings(log, wd, last_line_at + timedelta(minutes=40), NOW - timedelta(hours=5)))


# A process whose main thread sits in `where` (a function of a file at `path`) when faulthandler's timer fires, with a
# second thread asleep: the dump a trainer rank prints after --stack-dump-after-mins.
DUMPING = """\
import faulthandler, importlib.util, sys, threading, time
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
spec = importlib.util.spec_from_file_location("waiting", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
faulthandler.dump_traceback_later(0.3, file=sys.stderr)
module.wait()
"""


def stack_dump(tmp_path: Path, path: str) -> list[str]:
    """Real faulthandler output of a process stuck in ``wait()`` of ``tmp_path / path``."""
    source = tmp_path / path
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("import time\n\ndef wait():\n    time.sleep(1)\n")
    done = subprocess.run([sys.executable, "-c", DUMPING, str(source)], capture_output=True, text=True, timeout=30)
    assert done.stderr.startswith("Timeout (0:00:00.300000)!\n"), done.stderr
    return done.stderr.splitlines()


def test_stack_dumps_name_the_rank_the_others_wait_for(tmp_path):
    """Three ranks on two nodes print their stacks at once (lines interleaved, as tee writes them): two wait in a
    collective, node2's local rank 1 does not; an older dump of a rank is replaced by its newest."""
    from opskit.logs.stacks import rank_stacks, stuck_ranks
    from opskit.monitor.checks import with_stuck_ranks
    from opskit.monitor.findings import Finding

    waiting = stack_dump(tmp_path, "site-packages/torch/distributed/distributed_c10d.py")
    stuck = stack_dump(tmp_path, "opskit/train/data.py")
    dumps = [[f"0: [default0]:{line}" for line in waiting], [f"0: [default1]:{line}" for line in waiting],
             [f"1: [default1]:{line}" for line in stuck]]
    old = [f"1: [default1]:{line}" for line in waiting]  # an earlier dump of the same rank (a long checkpoint save)
    lines = ["[opskit] 2026-11-25 01:00:00 job 7 (array task 6_1) nodes node[1-2]: start", *old,
             *(line for group in zip(*dumps, strict=False) for line in group)]
    stacks = rank_stacks(lines, ["node1", "node2"])
    assert [(s.node, s.local_rank, s.waiting) for s in stacks] == [
        ("node1", 0, True), ("node1", 1, True), ("node2", 1, False)]
    assert stacks[0].innermost == "torch/distributed/distributed_c10d.py:4 in wait"
    assert [s.where for s in stuck_ranks(stacks)] == ["node2, local rank 1"]
    assert stuck_ranks(stacks)[0].innermost == "opskit/train/data.py:4 in wait"

    main_log = tmp_path / "main_log.txt"
    main_log.write_text("\n".join(lines) + "\n")
    hang = Finding("log.hang", "alert", "no new iteration line for 40 min", {"silent_s": 2400})
    named = with_stuck_ranks(hang, main_log.read_text())
    assert named.message == ("no new iteration line for 40 min; stacks: node2, local rank 1 is in "
                             "opskit/train/data.py:4 in wait while 2 other rank(s) wait in "
                             "torch/distributed/distributed_c10d.py:4 in wait")
    assert named.data == {"silent_s": 2400, "stuck": [
        {"node": "node2", "local_rank": 1, "frame": "opskit/train/data.py:4 in wait"}]}
    # Without the job header in the searched tail, the node list comes from the watchdog's state.
    assert with_stuck_ranks(hang, main_log.read_text()[80:], "node[1-2]").data == named.data
    # The stacks of an earlier job are not this hang's: the next job's header ends them.
    main_log.write_text("\n".join([*lines, "[opskit] 2026-11-25 02:00:00 job 8 (array task 6_2) nodes node[1-2]: "
                                             "start"]) + "\n")
    assert with_stuck_ranks(hang, main_log.read_text()) == hang
    main_log.write_text("no stacks here\n")
    assert with_stuck_ranks(hang, main_log.read_text()) == hang


def test_stacks_that_single_out_no_rank_name_none():
    """NCCL's collectives are asynchronous: on GPUs every rank may wait outside torch.distributed. The odd one out is
    then named by its innermost frame; a tie or one rank names nobody."""
    from opskit.logs.stacks import RankStack, stuck_ranks

    def rank(local: int, frame: str, collective: bool = False) -> RankStack:
        path = "/x/site-packages/torch/distributed/c10d.py" if collective else f"/x/site-packages/{frame}.py"
        return RankStack("n1", local, ((path, 1, "f"), ("/x/opskit/train/main.py", 9, "<module>")))

    synced = [rank(0, "torch/cuda/sync"), rank(1, "torch/cuda/sync"), rank(2, "torch/cuda/sync"),
              rank(3, "opskit/train/data")]
    assert [s.local_rank for s in stuck_ranks(synced)] == [3]
    assert stuck_ranks(synced[:2]) == []  # all alike
    assert stuck_ranks([rank(0, "a"), rank(1, "b")]) == []  # a tie
    assert [s.local_rank for s in stuck_ranks([rank(0, "c", True), rank(1, "a")])] == [1]
    assert stuck_ranks([rank(0, "c", True)]) == []


def test_malformed_and_cut_lines_are_counted(tmp_path):
    run = run_with_log(tmp_path, "malformed.txt")
    log = read_log(run, WatchdogState())
    skipped = read_from(run.main_log).skipped
    assert skipped >= 4 and log.skipped == skipped
    finding = only(log_findings(log, WatchdogSpec(), NOW, None), "log.skipped_lines")
    assert finding.severity == "ok" and finding.data == {"skipped": skipped}
    assert f"{skipped} cut or garbled iteration line(s) skipped" == finding.message


def test_crash_lines_name_their_node(tmp_path):
    run = run_with_log(tmp_path, "crash.txt")
    crash = only(log_findings(read_log(run, WatchdogState()), WatchdogSpec(), NOW, None), "log.crash")
    assert crash.severity == "alert"
    assert crash.message.startswith("1 crash line(s) since the last check, first: CUDA error: unknown error on "
                                    "jean-zay-iam52, local rank 3: [default3]:  what():  CUDA error: unknown error")
    # An OOM traceback is reported too (no node named: an unlabelled line of a multi-node job does not say which).
    with open(run.main_log, "a") as f:
        f.write("[opskit] 2026-11-21 08:00:00 job 9 (array task 8_1) nodes n[1-2]: start\n"
                "[default0]:Traceback (most recent call last):\n"
                "[default0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    state = read_log(run, WatchdogState()).state  # everything up to here seen
    with open(run.main_log, "a") as f:
        f.write("[default1]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    log = read_log(run, state)
    state = log.state
    crash = only(log_findings(log, WatchdogSpec(), NOW, None), "log.crash")
    assert crash.data["crashes"][0]["signature"] == "out of memory" and crash.data["crashes"][0]["node"] is None
    # opskit's job script runs srun --label: task 1 of n[1-2] is n2.
    with open(run.main_log, "a") as f:
        f.write("1: [default0]:RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191\n")
    crash = only(log_findings(read_log(run, state), WatchdogSpec(), NOW, None), "log.crash")
    assert crash.message.startswith("1 crash line(s) since the last check, first: NCCL error on n2, local rank 0: "
                                    "1: [default0]:")


@pytest.mark.parametrize(("line", "signature"), [
    ("[default2]:[rank2]:[E ProcessGroupNCCL.cpp:607] [Rank 2] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", "NCCL watchdog timeout"),
    ("NVRM: GPU at PCI:0000:3b:00: GPU-1234: GPU is lost", "GPU fell off the bus"),
    ("[default0]:DRIVER: ECC ERROR DETECTED ON DEVICE 0", "uncorrectable ECC error"),
])
def test_the_status_check_sees_every_line_the_crash_finder_sees(tmp_path, line, signature):
    """The watchdog's pre-filter was a word list of its own ("rror", "bus", ...) and skipped these lines,
    which opskit.logs.crash.find_crashes names; it is now derived from the signatures (crash.NEEDLES)."""
    from opskit.logs.crash import NEEDLES, SIGNATURES, SOFTWARE_ERRORS, find_crashes

    assert [name for name, _ in SIGNATURES + SOFTWARE_ERRORS] == list(NEEDLES)
    assert [c.signature for c in find_crashes([line])] == [signature]
    run = run_with_log(tmp_path, "crash.txt")
    state = read_log(run, WatchdogState()).state
    with open(run.main_log, "a") as f:
        f.write(line + "\n")
    crash = only(log_findings(read_log(run, state), WatchdogSpec(), NOW, None), "log.crash")
    assert crash.data["crashes"][0]["signature"] == signature


def test_failed_save_is_an_alert_of_its_own(tmp_path):
    """The trainer's one line for a failed save (no traceback, no crash signature) under torchrun's rank prefix: an
    alert keyed log.save_failed, not a crash; only new lines count."""
    run = run_with_log(tmp_path, "crash.txt")
    log = read_log(run, WatchdogState())
    assert "log.save_failed" not in keys(log_findings(log, WatchdogSpec(), NOW, None))
    state = log.state
    with open(run.main_log, "a") as f:
        f.write("saving checkpoint at iteration      40 to /scratch/run/checkpoints\n"
                "[default0]:error: saving global_step40 failed: [Errno 28] No space left on device "
                "(/scratch/run/checkpoints/global_step40/zero_pp_rank_0_mp_rank_00_optim_states.pt)\n")
    log = read_log(run, state)
    findings = log_findings(log, WatchdogSpec(), NOW, None)
    failed = only(findings, "log.save_failed")
    assert failed.severity == "alert" and "log.crash" not in keys(findings)
    assert failed.data == {"tag": "global_step40", "failures": 1, "reason": "[Errno 28] No space left on device "
                           "(/scratch/run/checkpoints/global_step40/zero_pp_rank_0_mp_rank_00_optim_states.pt)"}
    assert failed.message.startswith("saving global_step40 failed: [Errno 28] No space left on device (")
    assert "log.save_failed" not in keys(log_findings(read_log(run, log.state), WatchdogSpec(), NOW, None))


def test_throughput_drop(tmp_path):
    run = run_with_log(tmp_path, "tr11-176B-spike.txt")
    state = read_log(run, WatchdogState()).state
    last = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines()[-1]
    slow = [re.sub(r"samples per second: [\d.]+", "samples per second: 8.100", last.replace("31251", str(it)))
            for it in (31252, 31253, 31254)]
    with open(run.main_log, "a") as f:
        f.write("\n".join(slow) + "\n")
    drop = only(log_findings(read_log(run, state), WatchdogSpec(), NOW, None), "log.throughput")
    assert drop.severity == "warn" and drop.data["samples_per_second"] == 8.1
    assert drop.message.startswith("throughput 8.1 samples/s, 42% of the median 19.3 before")


def test_tensorboard_events_when_there_is_no_text_log(tmp_path):
    from opskit.monitor.snapshot import read_events
    from opskit.train.log import TensorBoard

    run = RunPaths(tmp_path / "run")
    board = TensorBoard(str(run.tensorboard), 10, True)  # the trainer's own writer, Megatron's tags
    for it in range(1, 121):
        board.iteration(it, it * 16, it * 16 * 512, 3e-4, 16, 9.0 if it == 118 else 6.0 - it / 100, 0.5, None)
    board.close()
    assert read_log(run, WatchdogState()) is None
    events = read_events(run, WatchdogState())
    assert len(events.new) == 120 and events.state.events_iteration == 120
    spike = only(log_findings(events, WatchdogSpec(), NOW, None, save_interval=50), "log.lm_loss_spike")
    assert (spike.data["first"], spike.data["peak"], spike.data["recovered_at"]) == (118, 9.0, 119)
    assert "roll back to global_step100" in spike.message
    again = read_events(run, events.state)  # nothing new: the spike is not news any more
    assert again.new == [] and len(again.records) == 120
    assert "log.lm_loss_spike" not in keys(log_findings(again, WatchdogSpec(), NOW, None))


# --------------------------------------------------------------------------- checkpoints and disk


def test_checkpoint_age_against_the_save_interval(bloom_run, tmp_path):
    run = RunPaths(tmp_path / "run")
    shutil.copytree(bloom_run / "checkpoints", run.checkpoints)  # a real step: latest -> global_step20
    step = run.checkpoints / "global_step20"
    wd = WatchdogSpec()  # checkpoint_age_factor 2: warn past 2 intervals, alert past 4
    for hours, severity in ((1, "ok"), (4, "warn"), (8, "alert")):
        os.utime(step, ((NOW - timedelta(hours=hours)).timestamp(),) * 2)
        [age] = checkpoint_findings(read_checkpoints(run), save_interval=100, seconds_per_iteration=60.0,
                                    running=True, wd=wd, now=NOW)
        assert (age.key, age.severity, age.data["tag"]) == ("checkpoint.age", severity, "global_step20"), hours
    assert "global_step20 saved 8.0 h ago; one every 100 iterations is 1.7 h at 60 s/it" == age.message
    [idle] = checkpoint_findings(read_checkpoints(run), 100, 60.0, running=False, wd=wd, now=NOW)
    assert idle.severity == "ok"  # nothing runs: the checkpoint cannot get newer
    (run.checkpoints / "latest").unlink()
    [none] = checkpoint_findings(read_checkpoints(run), 100, 60.0, running=True, wd=wd, now=NOW)
    assert none.key == "checkpoint.none"


def test_disk_and_inode_thresholds(tmp_path):
    run = RunPaths(tmp_path / "run")
    run.root.mkdir()
    vfs = os.statvfs(tmp_path)
    used = 100 * (vfs.f_blocks - vfs.f_bfree) / (vfs.f_blocks - vfs.f_bfree + vfs.f_bavail)  # as df shows it
    low, high = WatchdogSpec(disk_warn_percent=used / 4, disk_alert_percent=used / 2), WatchdogSpec()
    bytes_used = only(disk_findings(read_disk(run), low), "disk.bytes")
    assert bytes_used.severity == "alert" and abs(bytes_used.data["percent"] - used) < 1  # others write meanwhile
    assert keys(disk_findings(read_disk(run), high))["disk.bytes"] == (
        "ok" if used < 85 else "warn" if used < 95 else "alert")
    inodes = only(disk_findings(read_disk(run), high), "disk.inodes")
    assert inodes.data["path"] == str(run.root) and 0 < inodes.data["percent"] < 100


def snapshot_of(spec, monkeypatch, entries=()):
    """The run of ``spec`` read once, squeue answering ``entries``."""
    from opskit.monitor.snapshot import read_snapshot

    monkeypatch.setattr("opskit.slurm.client.squeue", lambda *a, **k: list(entries))
    return read_snapshot(spec, WatchdogState(), NOW, users=["someone"])


def test_chain_files_kill_switch_failures_and_stopped(tmp_path, monkeypatch):
    from opskit.monitor.checks import check_chain, check_scheduler
    from opskit.run import chain

    spec = load_spec(str(spec_file(tmp_path, "opskit-wd-chain")))
    run = RunPaths(tmp_path / "run")
    chain.set_kill_switch(run, True)
    for task, state in (("7_1", "COMPLETED"), ("7_2", "FAILED"), ("7_3", "TIMEOUT")):
        chain.record(run, chain.TaskOutcome("2026-11-21 08:00:00", task.split("_")[0], task, state, 1, "n1",
                                            "CUDA error: unknown error on n1" if state == "FAILED" else ""))
    found = {f.key: f for f in check_chain(snapshot_of(spec, monkeypatch), spec)}
    assert found["chain.kill_switch"].severity == "warn"
    assert found["chain.failures"].message == ("2 consecutive failed task(s): 7_2 FAILED (CUDA error: unknown error "
                                               "on n1), 7_3 TIMEOUT")
    (run.root / "chain-stopped").write_text("2026-11-21 08:00:00 ***ALERT: 3 consecutive failed tasks***\n")
    [stopped] = check_scheduler(snapshot_of(spec, monkeypatch), spec)
    assert (stopped.key, stopped.severity) == ("scheduler.stopped", "alert")
    assert stopped.message == "the chain stopped itself: 2026-11-21 08:00:00 ***ALERT: 3 consecutive failed tasks***"


def test_exclusive_reservation_counts_the_wait_from_the_last_task(tmp_path, monkeypatch):
    from dataclasses import replace

    from opskit.monitor.checks import check_scheduler
    from opskit.run.chain import Ledger, TaskOutcome
    from opskit.slurm.client import QueueEntry

    spec = load_spec(str(spec_file(tmp_path, "opskit-wd-excl", exclusive_reservation=True)))
    snap = snapshot_of(spec, monkeypatch)
    # The array was submitted two days ago; its next task waits on the task limit (squeue's own words).
    waiting = QueueEntry("682842_[2-5%1]", "gpu_p13", "opskit-wd-excl", "PENDING", "0:00", "48", "N/A",
                         "(JobArrayTaskLimit)", f"{NOW - timedelta(days=2):%Y-%m-%dT%H:%M:%S}", "20:00:00")

    def alerts(ended_minutes_ago: float) -> list[str]:
        ledger = [TaskOutcome(f"{NOW - timedelta(minutes=ended_minutes_ago):%Y-%m-%d %H:%M:%S}", "682843",
                              "682842_1", "COMPLETED", 0, "r7i5n[2-3]")]
        waited = replace(snap, entries=(waiting,), ledger=Ledger(ledger, []))
        return [f.message for f in check_scheduler(waited, spec) if f.severity == "alert"]

    assert alerts(5) == []  # the hand-over between two tasks of the chain
    assert alerts(25) == ["nothing has run for 0.4 h while 1 job(s) wait (JobArrayTaskLimit); the nodes are "
                          "reserved for this training"]


def test_a_job_pending_on_a_reason_that_never_clears_is_an_alert_with_the_fix(tmp_path, monkeypatch):
    from opskit.monitor.watchdog import run_checks
    from opskit.run.chain import job_comment
    from opskit.slurm.client import QueueEntry

    spec = load_spec(str(spec_file(tmp_path, "opskit-wd-forever")))
    run = RunPaths.of(spec)

    def report(reason: str):
        # Submitted a minute ago: far from watchdog.max_pending_hours, so only the reason can alert.
        entry = QueueEntry("682842_[1-5%1]", "gpu_p13", spec.job_name, "PENDING", "0:00", "48", "N/A", reason,
                           f"{NOW - timedelta(minutes=1):%Y-%m-%dT%H:%M:%S}", "20:00:00", job_comment(run),
                           str(run.script))
        monkeypatch.setattr("opskit.slurm.client.squeue", lambda *a, **k: [entry])
        return run_checks(spec, now=NOW)

    stuck = report("(PartitionConfig)")
    found = {f.key: f for f in stuck.findings}
    assert found["scheduler.pending_forever"].severity == "alert" and stuck.exit_code == 1
    assert found["scheduler.pending_forever"].message == (
        "job 682842_[1-5%1] never starts: PartitionConfig: the job asks more than its partition allows or its nodes "
        "have (CPUs per task, memory, GPUs, nodes); lower slurm.cpus_per_task, slurm.gres or parallel.nodes "
        "(`scontrol show partition PARTITION`, `sinfo -p PARTITION -o '%c %m %G %D %l'`) or pick another "
        f"slurm.partition, then `opskit cancel {spec.cli_name}` and `opskit submit {spec.cli_name}`")
    assert found["scheduler.pending_forever"].data == {"job_ids": ["682842_[1-5%1]"]}
    assert found["scheduler.pending"].severity == "ok"
    assert "ReqNodeNotAvail: nodes it needs are DOWN" in {f.key: f for f in report(
        "(ReqNodeNotAvail, UnavailableNodes:r7i5n[2-3])").findings}["scheduler.pending_forever"].message
    for reason in ("(Priority)", "(Resources)", "(AssocMaxJobsLimit)"):
        assert "scheduler.pending_forever" not in {f.key for f in report(reason).findings}, reason


# --------------------------------------------------------------------------- the scheduler (real local SLURM)


def spec_file(tmp_path: Path, job_name: str, **watchdog) -> Path:
    """A spec watching SLURM job ``job_name`` with run directory ``tmp_path/run``, created as `opskit submit` does
    (status needs no data)."""
    fake_data = SimpleNamespace(data_prefix=tmp_path / "data" / "kjv_text_document")
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    return write_spec(tmp_path / f"{job_name}.yaml", fake_data, tmp_path / "run", slurm={"job_name": job_name},
                      watchdog=watchdog)


def status_cli(spec: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, "status", str(spec), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def findings_of(done: subprocess.CompletedProcess) -> dict[str, dict]:
    return {f["key"]: f for f in json.loads(done.stdout)["findings"]}


@pytest.mark.slurm
def test_running_job_and_a_short_queue(jobs, tmp_path):
    name = unique("opskit-wd run")
    job_id = jobs(name, as_run(tmp_path / "run"))
    queued(name, running)
    spec = spec_file(tmp_path, name)
    done = status_cli(spec, "--json")
    assert done.returncode == 0, done.stdout + done.stderr  # a warning is no alert
    found = findings_of(done)
    assert found["scheduler.running"]["severity"] == "ok"
    assert found["scheduler.running"]["data"]["job_id"] == job_id and found["scheduler.running"]["data"]["reason"] \
        == "localhost"
    assert re.fullmatch(rf"{job_id} running for \d+:\d\d since \S+ on localhost \('debug' partition\)",
                        found["scheduler.running"]["message"])
    # One 3-minute task is far less than the 24 h horizon.
    queue = found["scheduler.queue"]
    assert queue["severity"] == "warn" and queue["data"]["tasks"] == 1 and queue["data"]["hours"] <= 0.05
    assert json.loads(done.stdout)["lines"][0].endswith(f"({job_id} on 'debug' partition (localhost)")

    # The human view: the PULSE line first (grep-able), then the table.
    done = status_cli(spec)
    assert done.returncode == 0
    assert f" PULSE: {name} is running for " in done.stdout.splitlines()[0]
    assert "scheduler.running" in done.stdout and "scheduler.queue" in done.stdout


@pytest.mark.slurm
def test_pending_reasons_and_waiting_too_long(jobs, tmp_path):
    first = unique("opskit-wd-first")
    first_id = jobs(first)
    queued(first, running)
    dep, array, later = unique("opskit-wd-dep"), unique("opskit-wd-arr"), unique("opskit-wd-begin")
    jobs(dep, f"--dependency=afterany:{first_id}", as_run(tmp_path / "dep" / "run"))
    array_id = jobs(array, "--array=1-2%1", f"--dependency=afterany:{first_id}", as_run(tmp_path / "array" / "run"))
    jobs(later, "--begin=now+1hour", as_run(tmp_path / "begin" / "run"))
    queued(dep, lambda es: any(e.reason == "(Dependency)" for e in es))
    queued(later, lambda es: any(e.reason == "(BeginTime)" for e in es))
    queued(array, lambda es: any(e.reason in ("(Dependency)", "(JobArrayTaskLimit)") for e in es))

    found = findings_of(status_cli(spec_file(tmp_path / "dep", dep), "--json"))
    assert found["scheduler.pending"]["message"].endswith("pending (Dependency)")
    found = findings_of(status_cli(spec_file(tmp_path / "array", array), "--json"))
    assert found["scheduler.pending"]["data"]["job_id"] == f"{array_id}_[1-2%1]"
    assert found["scheduler.queue"]["data"]["tasks"] == 2
    done = status_cli(spec_file(tmp_path / "begin", later), "--json")
    found = findings_of(done)
    assert re.fullmatch(r"\d+ pending \(BeginTime, expected to start \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\)",
                        found["scheduler.pending"]["message"])
    assert done.returncode == 0 and "scheduler.pending_too_long" not in found

    # Nothing has run since it was submitted: with max_pending_hours 0 any wait is too long.
    done = status_cli(spec_file(tmp_path / "begin", later, max_pending_hours=0), "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    too_long = findings_of(done)["scheduler.pending_too_long"]
    assert too_long["severity"] == "alert" and "1 job(s) wait (BeginTime); watchdog.max_pending_hours is 0" in \
        too_long["message"]


@pytest.mark.slurm
def test_absent_finished_and_appended_to_main_log(slurm, tmp_path):
    name = unique("opskit-wd-gone")
    spec = spec_file(tmp_path, name, append_to_main_log=True)
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    shutil.copy(FIXTURES / "hang.txt", run.main_log)
    done = status_cli(spec)
    assert done.returncode == 1, done.stdout + done.stderr
    alert_line = done.stdout.splitlines()[0]
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] PULSE: " + re.escape(
        f"***ALERT: {name} is not RUNNING or SCHEDULED! Alert the on-call person***"), alert_line)
    assert run.main_log.read_text().endswith(alert_line + "\n")  # BigScience's tee -a main_log.txt
    assert "scheduler.absent" in done.stdout and "progress" in done.stdout

    (run.root / "finished").write_text("2026-11-21 08:29:28 consumed 8000 samples\n")
    done = status_cli(spec, "--json")
    assert json.loads(done.stdout)["lines"] == []
    assert findings_of(done)["scheduler.finished"]["severity"] == "ok"
    # Its only alert: a finished run whose log passed saves has no checkpoint to show for it.
    assert done.returncode == 1 and [k for k, f in findings_of(done).items() if f["severity"] == "alert"] == \
        ["checkpoint.missing"]


def controller_config(tmp_path: Path, port: int) -> Path:
    """A copy of the local cluster's slurm.conf whose controller is at ``port`` of localhost (nothing, or a socket
    that never answers, is there), with short timeouts: what `squeue` meets when slurmctld is down or hung."""
    lines = [line for line in Path("/etc/slurm/slurm.conf").read_text().splitlines()
             if not line.startswith(("SlurmctldPort", "MessageTimeout", "TCPTimeout"))]
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(lines + [f"SlurmctldPort={port}", "MessageTimeout=1", "TCPTimeout=1"]) + "\n")
    return conf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slurm
@pytest.mark.parametrize("controller", ["down", "silent"])
def test_unreachable_scheduler_is_never_absent(slurm, tmp_path, controller):
    port = free_port()
    listener = None
    if controller == "silent":  # accepts connections into its backlog and never answers
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen(16)
    try:
        done = status_cli(spec_file(tmp_path, unique("opskit-wd-down")), "--json",
                          env={"SLURM_CONF": str(controller_config(tmp_path, port))})
    finally:
        if listener:
            listener.close()
    assert done.returncode == 2, done.stdout + done.stderr
    data = json.loads(done.stdout)
    found = {f["key"]: f for f in data["findings"]}
    assert data["unreachable"] is True and "scheduler.absent" not in found and "ALERT" not in done.stdout
    assert found["scheduler.unreachable"]["severity"] == "warn"
    assert ("connect failure" if controller == "down" else "Socket timed out") in found["scheduler.unreachable"][
        "message"]
    assert "scheduler unreachable, job state unknown" in data["lines"][0]


# --------------------------------------------------------------------------- alerts


class Mailbox:
    """A real SMTP server (aiosmtpd) on localhost; ``messages`` holds what arrived, parsed."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.messages: list[email.message.Message] = []
        self.port = free_port()
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port)

    async def handle_DATA(self, server, session, envelope):
        self.messages.append(email.message_from_bytes(envelope.content, policy=email.policy.default))
        return "250 OK"


@pytest.fixture
def mailbox():
    box = Mailbox()
    box.controller.start()
    yield box
    box.controller.stop()


@pytest.fixture
def webhook():
    """A local HTTP server taking JSON POSTs; set ``.status`` to make it fail."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            server.posts.append(json.loads(body))
            self.send_response(server.status)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.posts, server.status = [], 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/services/T000/B000/secret"
    yield server
    server.shutdown()


def age_alert_state(run: RunPaths, hours: float) -> None:
    """Pretend every channel's last message was sent ``hours`` earlier (instead of waiting for the interval)."""
    path = run.watchdog_dir / "alerts.json"
    state = json.loads(path.read_text())
    for told in state["channels"].values():
        told["at"] -= hours * 3600
    path.write_text(json.dumps(state))


@pytest.mark.slurm
def test_email_once_then_resolved(jobs, tmp_path, mailbox):
    name = unique("opskit-wd-mail")
    runbook = ["https://example.org/on-call", "https://example.org/logs"]
    spec = spec_file(tmp_path, name, alerts={"resend_hours": 6, "runbook": runbook, "log_lines": 3})
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    shutil.copy(FIXTURES / "hang.txt", run.main_log)
    saved_checkpoint(run, 12500)  # the log is past its saves: without one, checkpoint.missing would alert too
    env = {"OPSKIT_SMTP_HOST": "127.0.0.1", "OPSKIT_SMTP_PORT": str(mailbox.port),
           "OPSKIT_ALERT_EMAIL_TO": "oncall@example.org, eng@example.org"}

    done = status_cli(spec, "--alert", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "alerts: alert via email" in done.stdout
    [mail] = mailbox.messages
    assert mail["Subject"].startswith(f"[ALERT] {spec.stem}: {name} is not RUNNING or SCHEDULED")
    assert mail["To"] == "oncall@example.org, eng@example.org"
    body = mail.get_content().replace("\r\n", "\n")
    assert f"[alert] scheduler.absent: {name} is not RUNNING or SCHEDULED" in body
    last_lines = (FIXTURES / "hang.txt").read_text().splitlines()[-3:]
    assert "\n".join("  " + line for line in last_lines) in body
    assert "https://example.org/on-call" in body and "https://example.org/logs" in body
    assert f"`opskit status {spec} --ack` silences this alert" in body

    # The next hourly run: same alert, within resend_hours: nothing sent.
    done = status_cli(spec, "--alert", env=env)
    assert done.returncode == 1 and "alerts: nothing new to send" in done.stdout
    assert len(mailbox.messages) == 1
    # After the interval: sent again.
    age_alert_state(run, 7)
    status_cli(spec, "--alert", env=env)
    assert len(mailbox.messages) == 2 and mailbox.messages[1]["Subject"] == mail["Subject"]

    # The job is back in the queue: one RESOLVED message, then silence.
    jobs(name, "--begin=now+1hour", as_run(run.root))
    queued(name, lambda es: bool(es))
    done = status_cli(spec, "--alert", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(mailbox.messages) == 3
    assert mailbox.messages[2]["Subject"] == f"[RESOLVED] {spec.stem}: all clear (scheduler.absent)"
    status_cli(spec, "--alert", env=env)
    assert len(mailbox.messages) == 3


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl); clients trust it through SSL_CERT_FILE."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   capture_output=True, check=True, timeout=60)
    return cert, key


@pytest.mark.slurm
@pytest.mark.parametrize("security", ["starttls", "ssl"])
def test_email_over_tls_with_a_password(slurm, tmp_path, certificate, security):
    import ssl

    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult

    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    logins = []

    def authenticator(server, session, envelope, mechanism, auth_data):
        logins.append((auth_data.login, auth_data.password))
        # handled=False: aiosmtpd answers a refusal with 535 itself (handled=True would leave the client waiting).
        return AuthResult(success=auth_data.password == b"s3cret", handled=False)

    box = Mailbox()
    # aiosmtpd does not see that an implicit-TLS connection is encrypted: it must be told AUTH is fine there.
    tls = {"tls_context": context, "require_starttls": True} if security == "starttls" else {
        "ssl_context": context, "auth_require_tls": False}
    box.controller = Controller(box, hostname="127.0.0.1", port=box.port, authenticator=authenticator,
                                auth_required=True, **tls)
    box.controller.start()
    try:
        name = unique("opskit-wd-tls")
        alerts = {"email": {"to": ["oncall@example.org"], "host": "127.0.0.1", "port": box.port,
                            "security": security, "user": "bot", "password_env": "MY_SMTP_SECRET"}}
        spec = spec_file(tmp_path, name, alerts=alerts)
        env = {"SSL_CERT_FILE": str(cert), "MY_SMTP_SECRET": "s3cret"}
        done = status_cli(spec, "--alert", env=env)
        assert done.returncode == 1 and "alert via email" in done.stdout, done.stdout + done.stderr
        assert logins == [(b"bot", b"s3cret")] and box.messages[0]["Subject"].startswith(f"[ALERT] {spec.stem}: ")

        # A wrong password: one line naming the server and SMTP's refusal, never the password; nothing sent.
        (tmp_path / "wrong").mkdir()
        wrong = spec_file(tmp_path / "wrong", unique("opskit-wd-pw"), alerts=alerts)
        done = status_cli(wrong, "--alert", env={**env, "MY_SMTP_SECRET": "hunter2-wrong"})
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith(f"error: alert not sent: email via 127.0.0.1:{box.port}: "
                                      "SMTPAuthenticationError"), done.stderr
        assert "hunter2" not in done.stdout + done.stderr and len(box.messages) == 1
        assert logins[-1] == (b"bot", b"hunter2-wrong")  # it did try, with the configured user
    finally:
        box.controller.stop()


def saved_checkpoint(run: RunPaths, iteration: int) -> None:
    """A complete tiny checkpoint step ``iteration`` in the run, ``latest`` naming it."""
    import torch
    from megatron_ckpt import build_checkpoint

    build_checkpoint(run.checkpoints, arch="gpt2", tp=1, layers=1, hidden=32, iteration=iteration,
                     dtype=torch.float16)


@pytest.mark.slurm
def test_ack_silences_until_something_changes(slurm, tmp_path, webhook):
    name = unique("opskit-wd-ack")
    spec = spec_file(tmp_path, name, alerts={"webhook": webhook.url})
    run = RunPaths(tmp_path / "run")
    done = status_cli(spec, "--alert")
    assert done.returncode == 1 and len(webhook.posts) == 1
    post = webhook.posts[0]
    assert post["text"].startswith(f"[ALERT] {spec.stem}: {name} is not RUNNING or SCHEDULED")  # Slack's field
    assert post["opskit"]["kind"] == "alert" and post["opskit"]["findings"][0]["key"] == "scheduler.absent"

    done = status_cli(spec, "--ack")
    assert "acknowledged" in done.stdout and len(webhook.posts) == 1
    age_alert_state(run, 7)
    done = status_cli(spec, "--alert")
    assert "silenced (--ack)" in done.stdout and len(webhook.posts) == 1

    # Something changes (a crash line arrives): the silence ends, and the message lists both alerts.
    run.logs.mkdir(parents=True, exist_ok=True)  # --alert refreshed the run's page there
    shutil.copy(FIXTURES / "crash.txt", run.main_log)
    saved_checkpoint(run, 31000)  # the log is past its saves: without one, checkpoint.missing would alert too
    done = status_cli(spec, "--alert")
    assert len(webhook.posts) == 2, done.stdout
    assert "(+1 more)" in webhook.posts[1]["text"] and "CUDA error: unknown error on jean-zay-iam52" in \
        webhook.posts[1]["text"]


@pytest.mark.slurm
def test_a_failing_channel_is_reported_and_the_others_still_fire(slurm, tmp_path, webhook):
    name = unique("opskit-wd-fail")
    marker = tmp_path / "hook.txt"
    spec = spec_file(tmp_path, name, alerts={"webhook": webhook.url,
                                             "command": f'cat > {marker}; echo "$OPSKIT_ALERT_SUBJECT" >> {marker}'})
    dead = free_port()  # nothing listens there: SMTP down
    env = {"OPSKIT_SMTP_HOST": "127.0.0.1", "OPSKIT_SMTP_PORT": str(dead), "OPSKIT_ALERT_EMAIL_TO": "a@example.org",
           "OPSKIT_SMTP_PASSWORD": "hunter2-secret", "OPSKIT_SMTP_USER": "bot"}
    webhook.status = 500
    done = status_cli(spec, "--alert", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = done.stderr.splitlines()
    assert errors[0].startswith(f"error: alert not sent: email via 127.0.0.1:{dead}: ConnectionRefusedError")
    assert errors[1].startswith("error: alert not sent: webhook http://127.0.0.1:") and "HTTP Error 500" in errors[1]
    assert "secret" not in done.stderr and "hunter2" not in done.stdout + done.stderr  # no secrets in messages
    assert len(webhook.posts) == 1  # it was tried
    text = marker.read_text()
    assert f"[alert] scheduler.absent: {name}" in text
    assert text.endswith(f"\n[ALERT] {spec.stem}: {name} is not RUNNING or SCHEDULED\n")
    # The command channel was told; the failed ones try again on the next run, the command is not repeated.
    webhook.status = 200
    marker.unlink()
    done = status_cli(spec, "--alert", env=env)
    assert len(webhook.posts) == 2 and not marker.exists()
    assert done.returncode == 2 and "email via" in done.stderr


@pytest.mark.slurm
def test_unreachable_scheduler_neither_confirms_nor_resolves(slurm, tmp_path, webhook):
    name = unique("opskit-wd-unk")
    spec = spec_file(tmp_path, name, alerts={"webhook": webhook.url})
    assert status_cli(spec, "--alert").returncode == 1 and len(webhook.posts) == 1
    down = {"SLURM_CONF": str(controller_config(tmp_path, free_port()))}
    done = status_cli(spec, "--alert", env=down)
    assert done.returncode == 2 and len(webhook.posts) == 1  # no "resolved": the job's state is unknown
    state = json.loads((tmp_path / "run" / "watchdog" / "alerts.json").read_text())
    assert "scheduler.absent" in state["active"]


def test_no_channel_and_bad_settings_are_one_line_errors(tmp_path):
    spec = spec_file(tmp_path, unique("opskit-wd-cfg"))
    done = status_cli(spec, "--alert", env={"PATH": "/nonexistent"})  # no squeue either: still a config error
    assert done.returncode == 2
    assert done.stderr.startswith("error: no alert channel: set watchdog.alerts.email.to") and \
        len(done.stderr.splitlines()) == 1
    done = status_cli(spec, "--alert", env={"OPSKIT_ALERT_EMAIL_TO": "a@b", "OPSKIT_SMTP_PORT": "smtp"})
    assert done.returncode == 2 and done.stderr == "error: OPSKIT_SMTP_PORT=smtp: expected a port number\n"

    bad = spec_file(tmp_path, "x", throughput_drop=2)
    done = status_cli(bad)
    assert done.returncode == 2
    assert done.stderr == f"error: {bad}: watchdog.throughput_drop: Input should be less than 1\n"


@pytest.mark.slurm
def test_user_config_and_cron(slurm, tmp_path, webhook, monkeypatch):
    from opskit.upkeep.cron import hourly_commands

    name = unique("opskit-wd-user")
    spec = spec_file(tmp_path, name, alerts={"resend_hours": 1})
    config = tmp_path / "alerts.yaml"
    config.write_text(f"webhook: {webhook.url}\nresend_hours: 12\n")
    assert hourly_commands(load_spec(str(spec)), None)[0].endswith(f"status {spec} --page")  # no channel: no --alert
    done = status_cli(spec, "--alert", env={"OPSKIT_CONFIG": str(config)})
    assert done.returncode == 1 and len(webhook.posts) == 1, done.stdout + done.stderr
    age_alert_state(RunPaths(tmp_path / "run"), 2)  # the spec's resend_hours (1) wins over the user's (12)
    status_cli(spec, "--alert", env={"OPSKIT_CONFIG": str(config)})
    assert len(webhook.posts) == 2
    monkeypatch.setenv("OPSKIT_CONFIG", str(config))
    assert hourly_commands(load_spec(str(spec)), None)[0].endswith(f"status {spec} --alert")

    config.write_text("webhooks: http://x\n")
    done = status_cli(spec, "--alert", env={"OPSKIT_CONFIG": str(config)})
    assert done.returncode == 2
    assert done.stderr == f"error: {config}: webhooks: Extra inputs are not permitted\n"


@pytest.mark.slurm
def test_watch_checks_again_until_interrupted(slurm, tmp_path):
    import signal

    name = unique("opskit-wd-watch")
    watcher = subprocess.Popen([OPSKIT, "status", str(spec_file(tmp_path, name)), "--watch", "0.2"],
                               stdout=subprocess.PIPE, text=True)
    try:
        alerts: list[str] = []
        for line in watcher.stdout:
            if f"***ALERT: {name} is not RUNNING or SCHEDULED!" in line:
                alerts.append(line)
            if len(alerts) == 3:
                break
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 1  # Ctrl-C: the last run's exit code
    finally:
        watcher.kill()
    assert len(alerts) == 3  # three runs, one process


def test_status_imports_nothing_heavy(tmp_path):
    run = run_with_log(tmp_path, "tr11-176B-spike.txt")
    spec = spec_file(tmp_path, unique("opskit-wd-light"))
    assert RunPaths(tmp_path / "run") == run
    probe = ("import sys\nfrom opskit.cli.app import app\ntry:\n    app(sys.argv[1:], prog_name='opskit')\n"
             "except SystemExit:\n    pass\n"
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed', 'transformers', "
             "'matplotlib', 'numpy', 'megatron', 'plotext'})\nprint('HEAVY=' + ','.join(heavy), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, "status", str(spec), "--json"], capture_output=True,
                          text=True, timeout=60)
    assert "HEAVY=\n" in done.stderr, done.stderr[-2000:]
    assert "log.lm_loss_spike" in done.stdout  # the log was read


# --------------------------------------------------------------------------- what status cannot see


@pytest.mark.slurm
def test_status_never_says_ok_about_a_log_or_checkpoints_it_cannot_see(slurm, bloom_run, tmp_path):
    spec = spec_file(tmp_path, unique("opskit-wd-unseen"))
    run = RunPaths(tmp_path / "run")
    never_started = findings_of(status_cli(spec, "--json"))  # an empty run folder: nothing is due yet
    assert never_started["log.none"]["severity"] == never_started["checkpoint.none"]["severity"] == "ok"

    run.logs.mkdir()
    shutil.copy(FIXTURES / "hang.txt", run.main_log)
    shutil.copytree(bloom_run / "checkpoints", run.checkpoints)
    (run.root / "finished").write_text("2026-11-21 08:29:28 consumed 8000 samples\n")
    seen = status_cli(spec, "--json")
    assert "checkpoint.age" in findings_of(seen) and "log.missing" not in findings_of(seen), seen.stdout

    # Logs and checkpoints deleted: the watchdog saw iterations and global_step20, and the run is finished.
    shutil.rmtree(run.logs)
    shutil.rmtree(run.checkpoints)
    done = status_cli(spec, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    found = findings_of(done)
    assert found["scheduler.finished"]["severity"] == "ok"
    assert found["log.missing"]["severity"] == "alert" and str(run.main_log) in found["log.missing"]["message"]
    missing = found["checkpoint.missing"]
    assert missing["severity"] == "alert"
    assert missing["message"].startswith(f"no checkpoint folder at {run.checkpoints}")
    assert "checkpoint.none" not in found

    # A file where the checkpoint folder (or the log folder) should be, even for a run that never started.
    run.checkpoints.write_text("not a folder")
    run.logs.write_text("not a folder")
    (run.root / "finished").unlink()
    shutil.rmtree(run.watchdog_dir)
    done = status_cli(spec, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    found = findings_of(done)
    assert found["checkpoint.missing"]["message"] == (f"{run.checkpoints} is a file, not a folder: the next job "
                                                     "cannot save nor resume")
    assert found["log.missing"]["message"].startswith(f"{run.logs} is a file, not a folder")


@pytest.mark.slurm
@pytest.mark.parametrize("content", ["[1, 2]", '"str"', "null"])
def test_state_that_is_not_an_object_starts_over(slurm, tmp_path, content):
    spec = spec_file(tmp_path, unique("opskit-wd-state"))
    run = run_with_log(tmp_path, "hang.txt")
    run.watchdog_dir.mkdir()
    (run.watchdog_dir / "state.json").write_text(content)
    done = status_cli(spec, "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # scheduler.absent
    assert "log.hang" not in findings_of(done) and load_state(run).offset > 0


@pytest.mark.slurm
def test_status_without_write_access_still_reports(slurm, tmp_path):
    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    spec = spec_file(tmp_path, unique("opskit-wd-ro"))
    run = run_with_log(tmp_path, "hang.txt")
    status_cli(spec)
    if subprocess.run(["chattr", "+i", str(run.watchdog_dir)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i not supported here")
    try:
        done = status_cli(spec)
    finally:
        subprocess.run(["chattr", "-i", str(run.watchdog_dir)], capture_output=True)
    assert done.returncode == 1, done.stdout + done.stderr  # the alert of an absent job, not a crash
    assert "scheduler.absent" in done.stdout and "progress" in done.stdout
    [line] = done.stderr.strip().splitlines()
    assert re.fullmatch(rf"warning: watchdog state not saved: {re.escape(str(run.watchdog_dir))}/\S+: "
                        "Operation not permitted", line), line


@pytest.mark.slurm
def test_the_table_quotes_log_lines_literally(slurm, tmp_path):
    # rich read torchrun's "[default3]:" in a quoted crash line as a style tag and dropped it from the table.
    spec = spec_file(tmp_path, unique("opskit-wd-literal"))
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    shutil.copy(FIXTURES / "crash.txt", run.main_log)
    done = status_cli(spec, env={"COLUMNS": "400"})
    assert done.returncode == 1, done.stdout + done.stderr
    crash_row = next(line for line in done.stdout.splitlines() if "log.crash" in line)
    assert "jean-zay-iam52, local rank 3: [default3]:  what():  CUDA error: unknown error" in crash_row
