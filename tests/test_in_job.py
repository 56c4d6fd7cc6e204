"""In-job recovery without SLURM: the heartbeat files, the watchdog's verdict on them, and the choice and blame of
nodes between training steps (opskit.allocation.in_job). The real scenarios run on the 3-node SLURM in
tests/test_multinode_failures.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opskit.allocation import in_job
from opskit.logs.stacks import rank_stacks
from opskit.rules.beats import DUMP_HEADER, WIDTH, Beat, beat_file, encode, read_beats
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.train.fault import CRASH_LINES
from opskit.train.heartbeat import Heartbeat


def test_beats_round_trip_and_a_torn_or_foreign_file_is_skipped(tmp_path):
    beat = Heartbeat(tmp_path, rank=3, local_rank=1, node="node2")
    try:
        beat.beat(41, "train")
        beat.beat(42, "save")  # rewritten in place: no tail of the longer line before it
    finally:
        beat.close()
    (tmp_path / "rank-00007").write_bytes(b"7 node9 1 4")  # cut mid-write
    (tmp_path / "rank-00008").write_bytes(b"\xff\xfe" * 40)  # not ASCII
    (tmp_path / "notes.txt").write_text("not a beat")
    beats = read_beats(tmp_path)
    assert [(b.rank, b.node, b.local_rank, b.iteration, b.phase) for b in beats] == [(3, "node2", 1, 42, "save")]
    assert len(beat_file(tmp_path, 3).read_bytes()) == WIDTH
    assert read_beats(tmp_path / "absent") == []
    with pytest.raises(ValueError, match="phase 'nap'"):
        encode(0, "node1", 0, 1, "nap")
    with pytest.raises(ValueError, match="node name"):
        encode(0, "node 1", 0, 1, "train")


def test_the_heartbeat_thread_prints_the_stacks_once_per_request(tmp_path):
    """The request is answered by the rank's thread while its main thread is blocked (here: in time.sleep); the
    dump parses back as that rank's stack with its innermost frame."""
    code = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from pathlib import Path
from opskit.train.heartbeat import Heartbeat
beat = Heartbeat(Path({str(tmp_path)!r}), rank=0, local_rank=0, node="node1")
beat.beat(5, "train")
print("ready", flush=True)
time.sleep(4)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    (tmp_path / "dump-stacks").touch()
    _, err = proc.communicate(timeout=30)
    assert err.count(DUMP_HEADER) == 1, err
    stacks = rank_stacks(err.splitlines(), ["node1"])
    assert len(stacks) == 1 and stacks[0].frames[0][2] == "<module>", err


def beats_at(*rows) -> list[Beat]:
    return [Beat(rank, node, 0, iteration, phase, seconds) for rank, node, iteration, phase, seconds in rows]


def test_silence_is_measured_against_the_floor_the_usual_interval_and_start_up():
    limits = in_job.Limits(timeout=10, startup=60, hang_factor=5)
    beats = beats_at((0, "node1", 30, "train", 100), (1, "node2", 29, "train", 100), (2, "node3", 0, "start", 100))
    assert in_job.silent_ranks(beats, {}, limits, now=109) == []
    assert [b.rank for b in in_job.silent_ranks(beats, {}, limits, now=111)] == [0, 1]  # start-up: 60 s
    # a model whose iterations take 4 s is not hung after 11 s: 5 x its median interval
    assert in_job.silent_ranks(beats[:2], {0: [4.0, 4.1, 3.9], 1: [4.0]}, limits, now=111) == []
    assert [b.rank for b in in_job.silent_ranks(beats, {}, limits, now=161)] == [0, 1, 2]
    # the rank behind the others' iteration is the one they wait for; all alike: nobody from the beats
    assert [b.node for b in in_job.hung_ranks(beats[:2], beats[:2])] == ["node2"]
    same = beats_at((0, "node1", 30, "train", 100), (1, "node2", 30, "train", 100))
    assert in_job.hung_ranks(same, same) == []


def run_dir(tmp_path) -> RunPaths:
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")  # opskit's marker: the job script's run directory
    run.node_logs.mkdir(parents=True)
    run.main_log.write_text("")
    return run


def test_steps_take_the_first_usable_nodes_and_blame_only_their_own_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = run_dir(tmp_path)
    log = run.node_logs / "77-node2.log"
    log.write_text("\n".join(CRASH_LINES).format(rank=1) + "\n")  # an earlier step's crash: not this one's
    nodes, heartbeats, lines = in_job.start_step(run, "77", 2, "node[1-3]")
    assert nodes == ["node1", "node2"] and heartbeats.name == "77.0.heartbeats" and lines == []
    assert in_job.blame_failed_step(run, "77") == (
        False, ["the step failed with no crash line, hang or node down to blame: no restart in this job"])

    with open(log, "a") as f:
        f.write("[default1]:" + CRASH_LINES[1].format(rank=1) + "\n")
    restart, lines = in_job.blame_failed_step(run, "77")
    assert restart and lines[0].startswith("blamed node2: CUDA launch failure: "), lines
    assert "(in-job): CUDA launch failure" in chain.read_bad_nodes(run)["node2"]
    assert in_job.start_step(run, "77", 2, "node[1-3]")[0] == ["node1", "node3"]  # the spare

    # node3 crashes too: one usable node left for two, the chain's next task takes over
    with open(run.node_logs / "77-node3.log", "a") as f:
        f.write(CRASH_LINES[1].format(rank=1) + "\n")
    restart, lines = in_job.blame_failed_step(run, "77")
    assert not restart and lines[-1] == "1 usable node(s) left for 2: the chain's next task takes over"
    with pytest.raises(in_job.InJobError, match=r"1 usable node\(s\) of the allocation for 2: .*node2: "):
        in_job.start_step(run, "77", 2, "node[1-3]")
    state = json.loads(in_job.state_path(run, "77").read_text())
    assert [s["nodes"] for s in state["steps"]] == [["node1", "node2"], ["node1", "node3"]]


def test_the_watchdog_names_the_rank_behind_stops_the_step_and_the_restart_swaps_its_node(tmp_path, monkeypatch):
    """Two ranks beat: node2's stopped one iteration behind node1's. The watchdog asks for stacks, names node2,
    stops the step's process (here a sleeping child) and the blame excludes node2; the next step takes node3."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(in_job, "DUMP_WAIT_S", 0.1)
    run = run_dir(tmp_path)
    _, folder, _ = in_job.start_step(run, "9", 2, "node1,node2,node3")
    folder.mkdir(parents=True)
    for rank, node, iteration in ((0, "node1", 31), (1, "node2", 30)):
        beat_file(folder, rank).write_bytes(encode(rank, node, 0, iteration, "train"))
    old = time.time() - 30
    os.utime(beat_file(folder, 1), (old, old))
    step = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lines = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
    try:
        stopped = in_job.watch_step(run, "9", step.pid, in_job.Limits(timeout=10, startup=60, hang_factor=5))
    finally:
        step.kill()
    assert stopped == 1 and step.wait(timeout=1) == -15  # stopped with SIGTERM, left for its parent to reap
    assert (folder / "dump-stacks").exists()
    assert len(lines) == 1 and lines[0].startswith("in-job watchdog: 1 of 2 ranks silent for up to 3"), lines
    assert lines[0].endswith("hung: node2 local rank 0 (behind the others' iteration); stopping the step"), lines
    restart, blame = in_job.blame_failed_step(run, "9")
    assert restart and blame[0].startswith("blamed node2: hung (silent 3"), blame
    assert in_job.start_step(run, "9", 2, "node1,node2,node3")[0] == ["node1", "node3"]


def test_the_pre_flight_check_keeps_its_failing_nodes_out_of_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = run_dir(tmp_path)
    checked = []

    def check(nodes):
        checked.append(nodes)
        return {"node2": "GEMM 3.1 TFLOP/s, 33% of the median"} if "node2" in nodes else {}

    nodes, _, lines = in_job.start_step(run, "4", 2, "node[1-3]", check)
    assert nodes == ["node1", "node3"] and lines == ["pre-flight: node2 kept out: GEMM 3.1 TFLOP/s, 33% of the median"]
    assert in_job.start_step(run, "4", 2, "node[1-3]", check)[:3:2] == (["node1", "node3"], [])
    assert checked == [["node1", "node2", "node3"], ["node1", "node3"]]


def test_a_step_that_ends_on_its_own_is_not_watched_further(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = run_dir(tmp_path)
    in_job.start_step(run, "5", 1, "node1")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert in_job.watch_step(run, "5", done.pid, in_job.Limits(10, 60, 5)) == 0


def test_the_entry_of_job_scripts_rendered_before_run_job_says_what_it_needs_in_one_line(tmp_path):
    """``python -m opskit.run.in_job``, which scripts rendered before opskit.allocation.job call (one may still be
    queued when opskit is upgraded)."""
    def call(*args):
        return subprocess.run([sys.executable, "-m", "opskit.run.in_job", *args], capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})

    root = tmp_path / "run"
    chain.claim_run_dir(RunPaths(root), "the test")  # the job script's run directory (a missing one is refused)
    started = call("start", str(root), "3", "2", "node[1-3]")
    step, nodes, folder = started.stdout.split()
    assert started.returncode == 0 and step == "STEP" and nodes == "node1,node2" and folder.endswith("3.0.heartbeats")
    short = call("start", str(root), "4", "3", "node[1-2]")
    assert short.returncode == 3 and short.stdout == "no restart in this job: 2 usable node(s) of the allocation " \
                                                      "for 3: \n"
    bad = call("start", str(root), "5", "2", "node[1-")
    assert bad.returncode == 3 and bad.stdout.startswith("in-job recovery: ValueError: ") and "\n" == bad.stdout[-1]
    assert call("frobnicate").returncode == 2


def test_submit_refuses_more_spares_than_the_partition_and_a_timeout_a_save_outlasts(kjv_data, tmp_path, slurm):
    from conftest import write_spec

    from opskit.spec.load import load_spec
    from opskit.submission.submit import SubmitError, submit

    path = write_spec(tmp_path / "spec.yaml", kjv_data, tmp_path / "run", slurm={"spare_nodes": 1},
                      watchdog={"in_job_timeout_mins": 0.5})
    spec = load_spec(str(path))
    with pytest.raises(SubmitError) as refused:
        submit(spec)
    assert str(refused.value) == ("slurm.spare_nodes 1: the job would ask for 2 nodes (parallel.nodes 1 + spares) and "
                                  "partition (all) has 1")
    assert not (tmp_path / "run").exists() and submit(spec, executor="local", dry_run=True).warnings == []

    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")
    run.logs.mkdir(parents=True)
    run.main_log.write_text("[opskit] 2026-11-27 10:00:00 job 7 (array task 7_1) nodes node1: start\n"
                            "time (ms) | save-checkpoint: 12000.00\ntime (ms) | save-checkpoint: 41000.00\n")
    warnings = submit(spec, executor="local", dry_run=True).warnings
    assert warnings == [f"watchdog.in_job_timeout_mins: 0.5 min is shorter than a save of this run (41 s in "
                        f"{run.main_log}): the in-job watchdog would call it a hang; set it above 1.0"]
