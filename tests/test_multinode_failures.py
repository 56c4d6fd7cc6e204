"""The node-failure story on a real 3-node SLURM (scripts/local-slurm.sh start --nodes 3), 2-node chains of the real
trainer (tiny model, CPU, gloo): a crash on one node (the test-only OPSKIT_TEST_FAULT hook), a node whose slurmd dies,
a hung rank, slurmctld restarted mid-chain, and `opskit nodes list/clear`.

The crash node is chosen by name (SLURMD_NODENAME), never by rank: ranks are not tied to nodes under c10d.
Durations are printed (pytest -s shows them) and never asserted.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import REPO, write_spec
from test_report import artifact, browse
from test_submit import OPSKIT, iterations_logged, one, tasks_of

from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.submission.submit import submit

pytestmark = pytest.mark.slurm

GBS = 8
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32}


def node_spec(tmp_path: Path, data, iterations: int, save_interval: int, fault: str = "", log_interval: int = 1,
              model: dict = MODEL, **sections):
    """A 2-node chain of the tiny model: one CPU and one OpenMP thread per node (the nodes have CPUs=1), the fault
    hook in the job's environment, this worktree's opskit on every node."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if fault:
        env["OPSKIT_TEST_FAULT"] = fault
    slurm = {"job_name": f"mnf-{tmp_path.name[-12:]}", "cpus_per_task": 1, "array": 3, "max_failures": 3,
             "time": "10", "master_port": random.randint(20000, 29000), "env": env, **sections.pop("slurm", {})}
    path = write_spec(tmp_path / "spec.yaml", data, tmp_path / "run", model=model, parallel={"nodes": 2},
                      batch={"micro_batch_size": 4, "global_batch_size": GBS, "train_samples": iterations * GBS},
                      optimizer={"lr_warmup_samples": 32},
                      checkpoint={"save_interval": save_interval, "log_interval": log_interval}, slurm=slurm,
                      **sections)
    return load_spec(str(path))


def opskit(cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, timeout=timeout, env=cluster.env)


def wait_for(condition, timeout: float, what: str, interval: float = 0.5, evidence=lambda: ""):
    """``condition()``'s first truthy value within ``timeout`` s; else fail with ``what`` and ``evidence()`` (what
    the run left, read at the moment of the failure)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}{evidence()}"
        time.sleep(interval)
    return value


def queue(cluster, job_id: str) -> list[tuple[str, str, str]]:
    """(task id, state, node list or reason) of the job (array)'s queued and running tasks."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", "%i %T %R").stdout
    return [tuple(line.split(None, 2)) for line in out.splitlines() if line.strip()]


def starts(log: str) -> dict[str, list[datetime]]:
    """Array task -> the times its job script started (a requeued task starts twice)."""
    found: dict[str, list[datetime]] = {}
    for m in re.finditer(r"^\[opskit\] (\S+ \S+) job \S+ \(array task (\S+)\) nodes \S+: start$", log, re.M):
        found.setdefault(m[2], []).append(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S"))
    return found


def ledger_time(row: chain.TaskOutcome) -> datetime:
    return datetime.strptime(row.time, "%Y-%m-%d %H:%M:%S")


def test_crash_on_one_node_excludes_it_and_the_chain_resumes_on_the_healthy_nodes(cluster, kjv_data, tmp_path):
    alerts = tmp_path / "alerts.txt"
    spec = node_spec(tmp_path, kjv_data, iterations=12, save_interval=4, fault="crash:node2:iteration=6",
                     watchdog={"alerts": {"command": f'(cat; echo "KIND=$OPSKIT_ALERT_KIND") >> {alerts}'}})
    spec_file = str(tmp_path / "spec.yaml")
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    run = sub.run
    wait_for(lambda: not queue(cluster, sub.job_id), 300, "the chain never drained")

    # The ledger: task 1 FAILED on node[1-2] with the crash node named, task 2 COMPLETED on the two healthy nodes,
    # task 3 found the finished flag.
    rows = chain.read_ledger(run)
    assert [(r.task, r.state, r.nodes) for r in rows] == [
        (f"{sub.job_id}_1", "FAILED", "node[1-2]"), (f"{sub.job_id}_2", "COMPLETED", "node[1,3]"),
        (f"{sub.job_id}_3", "SKIPPED", "node[1,3]")], run.main_log.read_text()[-3000:]
    assert rows[0].reason == "CUDA launch failure on node2" and rows[0].exit_code != 0
    bad = chain.read_bad_nodes(run)
    assert list(bad) == ["node2"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d job \d+ \(in-job\): CUDA launch failure: .*CUDA error: an "
                        r"illegal memory access was encountered", bad["node2"]), bad
    assert "CUDA error: an illegal memory access" in next(run.node_logs.glob("*-node2.log")).read_text()

    # No human action: the epilogue moved the exclusion onto the queued tasks; SLURM still shows it (MinJobAge).
    log = run.main_log.read_text()
    tasks = dict(tasks_of(log))
    # The job blamed node2 (opskit.allocation.in_job) and, with no spare node in the allocation, left it to the chain.
    one(r"blamed node2: CUDA launch failure: .*an illegal memory access was encountered$", tasks[f"{sub.job_id}_1"])
    one(rf"queued task\(s\) {sub.job_id}_\[2-3\] now exclude node2 \(ExcNodeList\)$", tasks[f"{sub.job_id}_1"])
    one(r"1 usable node\(s\) left for 2: the chain's next task takes over$", tasks[f"{sub.job_id}_1"])
    shown = cluster.run("scontrol", "show", "job", f"{sub.job_id}_2").stdout
    assert "ExcNodeList=node2" in shown and re.search(r"\bNodeList=node\[1,3\]", shown), shown

    # Task 2 resumed from the last complete checkpoint (iteration 4, before the crash at 6, once its background write
    # was agreed: a crash one iteration after a save may find it unfinished, and then task 2 starts afresh) and
    # trained to the end.
    resumed = tasks[f"{sub.job_id}_2"]
    saved = re.findall(r"successfully saved checkpoint at iteration +(\d+)", tasks[f"{sub.job_id}_1"])
    assert saved in (["4"], []), saved
    resumed_from = int(saved[-1]) if saved else 0
    if saved:
        one(r"successfully loaded checkpoint from .* at iteration 4$", resumed)
    assert [i for i, *_ in iterations_logged(resumed)][:1] == [resumed_from + 1]
    assert (run.checkpoints / "latest").read_text() == "global_step12" and run.finished_flag.exists()

    # `opskit goodput`: task 1's redone work is exactly the iterations from the last save to the crash.
    report = json.loads(opskit(cluster, "goodput", spec_file, "--json").stdout)
    assert [(t["task"], t["state"], t["iterations"], t["redone_iterations"]) for t in report["tasks"]] == [
        (f"{sub.job_id}_1", "FAILED", 6, 6 - resumed_from), (f"{sub.job_id}_2", "COMPLETED", 12 - resumed_from, 0),
        (f"{sub.job_id}_3", "SKIPPED", 0, 0)]
    parts = sum(c["seconds"] for c in report["categories"].values())
    assert abs(parts - report["wall_seconds"]) <= 0.01 * report["wall_seconds"], report
    print(f"goodput {report['goodput']:.1%} of {report['wall_hours'] * 3600:.0f} s; redone: {6 - resumed_from}")
    crash_to_next = (starts(log)[f"{sub.job_id}_2"][0] - ledger_time(rows[0])).total_seconds()
    print(f"\ncrash -> next task running on node[1,3]: {crash_to_next:.0f} s (excluded: node2)")

    # `opskit status` names the crash node; the alert goes out once, however often the watchdog runs.
    status = opskit(cluster, "status", spec_file, "--json", "--alert")
    report = json.loads(status.stdout)
    found = {f["key"]: f for f in report["findings"]}
    assert found["chain.bad_nodes"]["message"].startswith("1 node(s) excluded from the chain: node2 (")
    assert "CUDA launch failure" in found["chain.bad_nodes"]["message"]
    assert found["log.crash"]["severity"] == "alert" and report["alerts"]["sent"] == [
        {"channel": "command", "kind": "alert"}]
    for _ in range(2):
        again = json.loads(opskit(cluster, "status", spec_file, "--json", "--alert").stdout)
        assert {"channel": "command", "kind": "alert"} not in again["alerts"]["sent"]
    sent = alerts.read_text()
    assert sent.count("KIND=alert") == 1 and "node2" in sent, sent

    # `opskit status --alert` refreshed the run's page: in Chromium, the crash on node2, its exclusion and the resume
    # on node[1,3]; its screenshots are kept (tests/test_report.artifact).
    page = browse(run.report, artifact("report-multinode.png"))
    assert page["errors"] == [] and page["requests"] == []
    text = page["text"]
    assert re.search(rf"{sub.job_id}_1\tFAILED\tnode1,node2\t.*CUDA launch failure on node2", text), text
    assert re.search(rf"{sub.job_id}_2\tCOMPLETED\tnode1,node3\t", text) and "blamed node2" in text
    assert re.search(r"node2\t\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\trun\tjob \d+ \(in-job\): CUDA launch failure", text), text
    timeline = next(points for title, _, points in page["points"] if title == "tasks and in-job steps")
    assert timeline[0] == 3, timeline  # a bar per task

    # `opskit nodes list` says why; `opskit nodes clear NODE` puts it back.
    listed = opskit(cluster, "nodes", "list", spec_file)
    assert listed.stdout.split(None, 1) == ["node2", bad["node2"] + "\n"], listed.stderr  # node, time, job, signature
    cleared = opskit(cluster, "nodes", "clear", spec_file, "node2")
    assert cleared.stdout == "cleared node2\n" and chain.read_bad_nodes(run) == {}
    assert opskit(cluster, "nodes", "list", spec_file).stdout == "no bad nodes\n"


def test_a_dead_node_ends_the_task_and_the_chain_continues_on_the_others(cluster, kjv_data, tmp_path):
    spec = node_spec(tmp_path, kjv_data, iterations=100_000, save_interval=50)
    spec_file = str(tmp_path / "spec.yaml")
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    run = sub.run
    first = f"{sub.job_id}_1"
    wait_for(lambda: (run.checkpoints / "latest").is_file(), 180, "task 1 never saved a checkpoint")
    [(_, state, nodes)] = [row for row in queue(cluster, sub.job_id) if row[0] == first]
    assert (state, nodes) == ("RUNNING", "node[1-2]")

    # node2 (not the batch host, whose script records the outcome) stops answering: its slurmd dies.
    os.kill(cluster.slurmd_pid("node2"), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: cluster.node_states()["node2"].startswith("down"), 90, "node2 never marked down")
    down = time.monotonic()
    rows = wait_for(lambda: [r for r in chain.read_ledger(run) if r.task == first], 60, "task 1 never ended")
    assert [(r.state, r.nodes) for r in rows] == [("NODE_FAIL", "node[1-2]")]
    assert rows[0].reason.startswith("node2 down"), rows[0].reason

    # The chain goes on without anyone: the next task runs on the two live nodes and resumes from the last save.
    second = f"{sub.job_id}_2"
    wait_for(lambda: (second, "RUNNING", "node[1,3]") in queue(cluster, sub.job_id), 90, "task 2 never started")
    running = time.monotonic()
    wait_for(lambda: second in dict(tasks_of(run.main_log.read_text())) and iterations_logged(
        dict(tasks_of(run.main_log.read_text()))[second]), 120, "task 2 never trained",
        evidence=lambda: f"; main log ends:\n{run.main_log.read_text()[-4000:]}\nqueue: {queue(cluster, sub.job_id)}")
    resumed = dict(tasks_of(run.main_log.read_text()))[second]
    step = int(one(r"successfully loaded checkpoint from .* at iteration +(\d+)$", resumed).group(1))
    assert step > 0 and step % 50 == 0 and iterations_logged(resumed)[0][0] == step + 1
    print(f"\nslurmd killed -> node2 down: {down - killed:.0f} s; node down -> task 2 running on node[1,3]: "
          f"{running - down:.0f} s")

    # `opskit status` reports the down node and the training lost since the last save.
    report = json.loads(opskit(cluster, "status", spec_file, "--json").stdout)
    failures = {f["key"]: f for f in report["findings"]}["chain.failures"]
    assert re.search(rf"{first} NODE_FAIL \(node2 down\S* \(Not responding\)\) at \d\d:\d\d:\d\d, losing \d+ s of "
                     rf"training since global_step{step}\b", failures["message"]), failures["message"]
    assert failures["data"]["lost_s"][first] >= 0

    # The kill switch ends the task (it saves and exits 0). SLURM requeued task 1 (a node failure), to start again
    # after a delay of its own: it and task 3 would exit at start; the fixture cancels them.
    assert opskit(cluster, "kill-switch", spec_file, "on").returncode == 0
    wait_for(lambda: len(chain.read_ledger(run)) >= 2, 120, "task 2 never ended")
    assert [(r.task, r.state) for r in chain.read_ledger(run)][:2] == [(first, "NODE_FAIL"), (second, "COMPLETED")]


def test_a_hung_rank_is_found_and_with_cancel_hung_cancelled_so_the_chain_moves_on(cluster, kjv_data, tmp_path):
    # the in-job watchdog kept out of the way: this is the hourly watchdog's story
    spec = node_spec(tmp_path, kjv_data, iterations=100_000, save_interval=20, fault="hang:node2:iteration=30:task=1",
                     watchdog={"hang_factor": 2, "hang_min_minutes": 0.25, "in_job_timeout_mins": 60})
    spec_file = tmp_path / "spec.yaml"
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    run = sub.run
    first, second = f"{sub.job_id}_1", f"{sub.job_id}_2"

    def hang_finding() -> dict | None:
        report = json.loads(opskit(cluster, "status", str(spec_file), "--json").stdout)
        return next((f for f in report["findings"] if f["key"] == "log.hang"), None)

    def main_log() -> str:
        return run.main_log.read_text() if run.main_log.is_file() else ""

    def evidence() -> str:
        return f"; main log ends:\n{main_log()[-4000:]}\nqueue: {queue(cluster, sub.job_id)}"

    # Without the opt-in, opskit offers the scancel that moves the chain on, and does nothing. The clock of the hang
    # starts at the hung iteration: how long the two nodes take to get there depends on the machine's load.
    wait_for(lambda: any(i >= 29 for i, *_ in iterations_logged(dict(tasks_of(main_log())).get(first, ""))), 240,
             "task 1 never reached iteration 29", interval=2, evidence=evidence)
    hang = wait_for(hang_finding, 120, "no log.hang finding", interval=2, evidence=evidence)
    hung_at = time.monotonic()
    assert hang["severity"] == "alert" and hang["data"]["last_iteration"] in (29, 30), hang
    # Both ranks printed their stacks after 7.5 s (--stack-dump-after-mins: half the floor); node1's waits in a
    # collective, so the rank named is node2's.
    assert [(s["node"], s["local_rank"]) for s in hang["data"]["stuck"]] == [("node2", 0)], hang
    assert hang["message"].endswith(f"; `scancel {first}` moves the chain on (watchdog.cancel_hung: true does it)")
    print(f"\nlog.hang after {hang['data']['silent_s']} s without an iteration line (threshold: 15 s)")
    assert [row[:2] for row in queue(cluster, sub.job_id) if row[0] == first] == [(first, "RUNNING")]

    # watchdog.cancel_hung: true: the next check cancels the hung task; the next one resumes from the last save.
    spec_file.write_text(spec_file.read_text().replace("hang_min_minutes: 0.25", "hang_min_minutes: 0.25\n"
                                                                                 "  cancel_hung: true"))
    hang = wait_for(hang_finding, 60, "no log.hang finding with cancel_hung", interval=2)
    assert hang["message"].endswith(f"; cancelled {first} (watchdog.cancel_hung): the chain moves on from the last "
                                    "save") and hang["data"]["cancelled"], hang
    wait_for(lambda: [r for r in chain.read_ledger(run) if r.task == first], 60, "task 1 never ended")
    assert [(r.task, r.state) for r in chain.read_ledger(run)] == [(first, "CANCELLED")]
    wait_for(lambda: second in dict(tasks_of(run.main_log.read_text())) and any(
        i > 30 for i, *_ in iterations_logged(dict(tasks_of(run.main_log.read_text()))[second])), 120,
        "task 2 never trained past the hang")
    print(f"hang found -> task 2 past iteration 30: {time.monotonic() - hung_at:.0f} s")
    resumed = dict(tasks_of(run.main_log.read_text()))[second]
    one(r"successfully loaded checkpoint from .* at iteration +20$", resumed)


@pytest.mark.parametrize("kind", ["hang", "crash"])
def test_a_hang_or_crash_on_node2_restarts_training_on_the_spare_inside_the_job(cluster, kjv_data, tmp_path, kind):
    """2-node training in a 3-node allocation (slurm.spare_nodes: 1): after a hang (no heartbeat for the in-job
    timeout, 15 s) or a crash on node2 in iteration 13, the job blames node2 and resumes from the last save `latest`
    names (10, or 5 when the background save of 10 was not agreed yet) on node1 and node3 under the same job id; no
    task of the chain is used up."""
    timeout = 15
    spec = node_spec(tmp_path, kjv_data, iterations=30, save_interval=5, fault=f"{kind}:node2:iteration=12:task=1",
                     slurm={"spare_nodes": 1, "array": 2}, watchdog={"in_job_timeout_mins": timeout / 60})
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    run = sub.run
    first = f"{sub.job_id}_1"
    seen: dict[str, float] = {}

    def note(what: str, pattern: str, after: str = "") -> None:
        text = run.main_log.read_text() if run.main_log.exists() else ""
        if what not in seen and after in text and re.search(pattern, text[text.index(after):], re.M):
            seen[what] = time.monotonic()

    def progress() -> bool:
        note("iteration 12", r" iteration +12/")
        note("stopped", r"in-job watchdog: .*stopping the step$|blamed node2")
        note("step 1 iteration", r" iteration +\d+/", after="training step 1 on nodes node1,node3")
        return run.finished_flag.exists()

    wait_for(progress, 300, "training never finished", interval=0.2)
    wait_for(lambda: not queue(cluster, sub.job_id), 120, "the chain never drained")
    rows = chain.read_ledger(run)
    assert [(r.task, r.state, r.nodes) for r in rows] == [
        (first, "COMPLETED", "node[1-3]"), (f"{sub.job_id}_2", "SKIPPED", "node[1-3]")], run.main_log.read_text()
    part = dict(tasks_of(run.main_log.read_text()))[first]
    one(r"training step 0 on nodes node1,node2$", part)
    if kind == "hang":
        # node1's rank may wait in the exit policy's all-reduce of iteration 12 before it beats for 13: then both
        # ranks' last beats say 11 and the stacks name node2 (the other waits in torch.distributed)
        one(r"in-job watchdog: [12] of 2 ranks silent for up to \d+ s \(limit 15 s; last iteration 1[12]\); hung: "
            r"node2 local rank 0 \((behind the others' iteration|from the stacks)\); stopping the step$", part)
        one(r"blamed node2: hung \(silent \d+ s\)$", part)
    else:
        one(r"blamed node2: CUDA launch failure: .*an illegal memory access was encountered$", part)
    one(r"in-job restart 1 of 2: training resumes from the last checkpoint$", part)
    step0, resumed = part.split("training step 1 on nodes node1,node3", 1)
    # the step `latest` named at the stop: 10, unless the background save of 10 was not yet agreed when the step was
    # stopped (a loaded machine), then 5
    saved = [int(i) for i in re.findall(r"successfully saved checkpoint at iteration +(\d+)", step0)]
    assert saved and saved[-1] in (5, 10), saved
    one(rf"successfully loaded checkpoint from .* at iteration +{saved[-1]}$", resumed)
    assert [i for i, *_ in iterations_logged(resumed)][:1] == [saved[-1] + 1]
    assert (run.checkpoints / "latest").read_text() == "global_step30"
    assert list(chain.read_bad_nodes(run)) == ["node2"]
    stop = seen["stopped"] - seen["iteration 12"]
    restart = seen["step 1 iteration"] - seen["stopped"]
    print(f"\n{kind} on node2: stopped {stop:.0f} s after iteration 12's line; training again on node1,node3 "
          f"{restart:.0f} s later")
    if kind == "hang":
        assert stop <= timeout + 10, seen
    assert restart <= 60, seen  # start-up (interpreters, torchrun, the model, the checkpoint) + 30 s


@pytest.mark.parametrize("fault", ["slow:node2:iteration=20:factor=3", ""], ids=["node2-3x-slower", "clean"])
def test_a_slow_node_is_named_a_straggler_within_three_log_intervals(cluster, kjv_data, tmp_path, fault):
    """node2's forward passes 3x slower from iteration 20 (the fault hook's slow kind) in a 2-node DP run: the
    trainer's lines name node2 from the first interval after it, and `opskit status` calls it a straggler (the
    default ratio, 1.2) once 3 intervals are logged (iteration 50 of 60). The same spec without the fault: lines, no
    straggler."""
    # forward passes of ~10 ms: the 2-core host's scheduling noise is a small part of them
    wider = {**MODEL, "hidden_size": 256, "seq_length": 128, "max_position_embeddings": 128}
    # 3x slower: the two nodes share this host's two cores, and a process on one core can halve node1's share for
    # tens of iterations (one of ten runs with `stress-ng --cpu 1` named node1 at 1.00-1.15x against a 1.5x slower
    # node2 in intervals 21-40)
    spec = node_spec(tmp_path, kjv_data, iterations=60, save_interval=1000, fault=fault, log_interval=10, model=wider)
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    wait_for(lambda: sub.run.finished_flag.exists(), 240, "training never finished")
    # the flag can come before the last rank's last lines have passed through srun into main_log.txt
    wait_for(lambda: "iterations 51-60: " in sub.run.main_log.read_text(), 60, "no line for iterations 51-60")
    from opskit.logs.crash import line_source
    from opskit.rules.stragglers import parse_slowest_rank_line

    log = sub.run.main_log.read_text()
    reports = [r for line in log.splitlines() if (r := parse_slowest_rank_line(line_source(line)[2]))]
    assert [(r.first, r.last) for r in reports] == [(i, i + 9) for i in range(1, 61, 10)], log[-3000:]
    print("\n" + ", ".join(f"{r.first}-{r.last}: {r.node} {r.ratio:.2f}x" for r in reports))
    report = json.loads(opskit(cluster, "status", str(tmp_path / "spec.yaml"), "--json").stdout)
    found = [f for f in report["findings"] if f["key"] == "log.straggler"]
    if not fault:
        assert found == [], found
        return
    assert [(r.node, r.local_rank) for r in reports[2:5]] == [("node2", 0)] * 3, reports
    assert all(r.ratio >= 1.2 for r in reports[2:5]), reports
    [straggler] = found
    assert (straggler["data"]["node"], straggler["data"]["local_rank"]) == ("node2", 0), straggler


@pytest.mark.parametrize("fault, problem", [("slow_gemm:node2", r"GEMM .* TFLOP/s, \d+% of the median"),
                                            ("allreduce_fail:node2", r"all-reduce failed: RuntimeError: test fault"),
                                            ("", None)], ids=["slow-gemm", "allreduce-fails", "healthy"])
def test_preflight_names_a_slow_or_cut_off_node_and_keeps_it_out(cluster, kjv_data, tmp_path, fault, problem):
    """`opskit preflight` on the 3 nodes: node2's GEMM 3x slower, or its all-reduce failing (the fault hook), makes
    it the one node excluded, with its figure, and `--exclude` puts it on the bad-node list the next submission
    reads; healthy nodes all pass (exit 0). Its wall time is printed."""
    node_spec(tmp_path, kjv_data, iterations=10, save_interval=1000)
    env = {**cluster.env, **({"OPSKIT_TEST_FAULT": fault} if fault else {})}
    started = time.monotonic()
    done = subprocess.run([OPSKIT, "preflight", str(tmp_path / "spec.yaml"), "--nodes", "node[1-3]", "--json",
                           "--exclude"], capture_output=True, text=True, timeout=300, env=env)
    print(f"\npreflight of 3 nodes ({fault or 'healthy'}): {time.monotonic() - started:.1f} s")
    assert done.stdout.startswith("{"), done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert [n["node"] for n in result["nodes"]] == ["node1", "node2", "node3"], result
    if problem is None:
        assert (done.returncode, result["excluded"]) == (0, []), result
        assert all(n["allreduce_s"] is not None for n in result["nodes"]), result
        return
    named = [(n["node"], n["problems"]) for n in result["nodes"]]
    assert (done.returncode, result["excluded"]) == (1, ["node2"]), named
    [node2] = [n for n in result["nodes"] if n["node"] == "node2"]
    assert any(re.match(problem, p) for p in node2["problems"]), result
    assert list(chain.read_bad_nodes(RunPaths(tmp_path / "run"))) == ["node2"]


# margin: three nodes on this host's 2 cores take turns, so a healthy node can time at 65-70% of the others' median
# twice; the all-reduce case is not about the GEMM and takes 0.5, the slow GEMM's (a third) the default
@pytest.mark.parametrize("fault, problem, margin", [
    ("slow_gemm:node2", r"GEMM .* TFLOP/s, \d+% of the median", 0.2),
    ("allreduce_fail:node2", r"all-reduce failed: RuntimeError: test fault", 0.5),
], ids=["slow-gemm", "allreduce-fails"])
def test_the_job_checks_its_nodes_first_and_trains_on_the_spare(cluster, kjv_data, tmp_path, fault, problem, margin):
    """slurm.preflight (on by default) in a 3-node allocation for 2-node training: node2's slow GEMM or failing
    all-reduce keeps it out before training starts; training runs on node1 and node3 and no task fails."""
    spec = node_spec(tmp_path, kjv_data, iterations=10, save_interval=5, fault=fault,
                     slurm={"spare_nodes": 1, "array": 1, "preflight_margin": margin})
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    run = sub.run
    wait_for(lambda: not queue(cluster, sub.job_id), 300, "the job never ended")
    rows = chain.read_ledger(run)
    assert [(r.state, r.nodes) for r in rows] == [("COMPLETED", "node[1-3]")], run.main_log.read_text()[-3000:]
    log = run.main_log.read_text()
    kept_out = one(r"^\[opskit\] (\S+ \S+) .*: pre-flight: node2 kept out: (.*)$", log)
    assert re.match(problem, kept_out[2]), kept_out[0]
    one(r"training step 0 on nodes node1,node3$", log)
    assert run.finished_flag.exists() and list(chain.read_bad_nodes(run)) == ["node2"]
    started = re.search(r"^\[opskit\] (\S+ \S+) job .*: start$", log, re.M)[1]
    took = (datetime.strptime(kept_out[1], "%Y-%m-%d %H:%M:%S") - datetime.strptime(started, "%Y-%m-%d %H:%M:%S"))
    print(f"\n{fault}: job start -> node2 kept out by the pre-flight check of 3 nodes: {took.total_seconds():.0f} s")
    # a bound on a check that finishes, not a speed claim (the module prints durations, never asserts them): 18-46 s
    # on this host's 2 cores with the other busy; a check that waits out srun's time-out takes minutes
    assert took.total_seconds() <= 120


def test_slurmctld_restarted_mid_chain_keeps_the_queue_and_status_says_unreachable(cluster, kjv_data, tmp_path):
    # 30 min: task 1 must still be running after the controller's restart, however loaded the machine
    spec = node_spec(tmp_path, kjv_data, iterations=100_000, save_interval=1000, slurm={"array": 2, "time": "30"})
    spec_file = str(tmp_path / "spec.yaml")
    first = submit(spec)
    cluster.jobs.append(first.job_id)
    second = submit(spec, array=1)  # chained after the first array: --dependency=afterany
    cluster.jobs.append(second.job_id)
    task = f"{first.job_id}_1"
    wait_for(lambda: (task, "RUNNING", "node[1-2]") in queue(cluster, first.job_id), 90, "task 1 never started")
    # Training, not only RUNNING: srun creates the job step through the controller, and an srun that finds it down
    # fails the task (a loaded CI machine once stopped the controller before the batch script reached srun).
    log = first.run.main_log
    wait_for(lambda: log.is_file() and iterations_logged(dict(tasks_of(log.read_text())).get(task, "")), 180,
             "task 1 never trained")
    before = queue(cluster, f"{first.job_id},{second.job_id}")
    assert cluster.run("squeue", "-h", "-j", second.job_id, "-o", "%E").stdout.strip() == \
        f"afterany:{first.job_id}_*(unfulfilled)"

    # Only the controller stops (SIGTERM: it saves its state), by its pid file; the nodes and the job go on.
    ctld = int((cluster.state_dir / "slurmctld.pid").read_text())
    os.kill(ctld, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{ctld}").exists() or
             Path(f"/proc/{ctld}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 30, "slurmctld still up")
    try:
        status = opskit(cluster, "status", spec_file)
        assert status.returncode == 2, status.stdout + status.stderr
        assert "scheduler unreachable, job state unknown" in status.stdout and "absent" not in status.stdout, \
            status.stdout
        report = json.loads(opskit(cluster, "status", spec_file, "--json").stdout)
        assert report["unreachable"] and "scheduler.absent" not in {f["key"] for f in report["findings"]}
    finally:
        done = cluster.script("start")
    assert done.returncode == 0, done.stdout + done.stderr

    # The queue survived: the same tasks, the running one still running, the dependency still there.
    assert queue(cluster, f"{first.job_id},{second.job_id}") == before
    assert cluster.run("squeue", "-h", "-j", second.job_id, "-o", "%E").stdout.strip() == \
        f"afterany:{first.job_id}_*(unfulfilled)"
    assert opskit(cluster, "status", spec_file).returncode in (0, 1)  # reachable again: no exit 2


def test_fault_hook_fires_only_on_its_node_iteration_and_task():
    from opskit.logs.crash import find_crashes
    from opskit.train.fault import inject_test_fault

    here = {"SLURMD_NODENAME": "node2", "SLURM_ARRAY_TASK_ID": "1"}
    for fault, iteration in (("crash:node1:iteration=5", 5), ("crash:node2:iteration=5", 4),
                             ("crash:node2:iteration=5:task=2", 5), ("crash:node2:iteration=5:local_rank=1", 5),
                             ("", 5), ("nonsense", 5)):
        assert inject_test_fault(iteration, {**here, "LOCAL_RANK": "0", "OPSKIT_TEST_FAULT": fault}) is None
    from opskit.train.fault import slowdown_factor

    slow = {**here, "LOCAL_RANK": "0", "OPSKIT_TEST_FAULT": "slow:node2:iteration=20:factor=1.3"}
    assert [slowdown_factor(i, slow) for i in (19, 20, 500)] == [1.0, 1.3, 1.3]
    assert slowdown_factor(20, {**slow, "SLURMD_NODENAME": "node1"}) == 1.0
    assert slowdown_factor(20, {**slow, "OPSKIT_TEST_FAULT": "slow:node2:iteration=20:factor=x"}) == 1.0
    assert inject_test_fault(20, slow) is None  # slow is no crash
    code = "from opskit.train.fault import inject_test_fault as f; f(5); print('survived')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, **here, "LOCAL_RANK": "1", "RANK": "9",
                               "OPSKIT_TEST_FAULT": "crash:node2:iteration=5:task=1:local_rank=1"})
    assert done.returncode == 1 and "survived" not in done.stdout and "[Rank 9] NCCL watchdog" in done.stderr
    assert [c.signature for c in find_crashes(done.stderr.splitlines(), node="node2")] == ["CUDA launch failure"]
