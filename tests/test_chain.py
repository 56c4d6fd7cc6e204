"""The job chain against the real local SLURM: a second submit chains after the first (afterany), --keep, hold and
release, the kill switch (running task saves and exits, queued tasks exit at start), the finished flag draining an
array, a crash line from a real worker process putting its node on the bad list and stopping the chain after
slurm.max_failures failures; plus crash signatures, queue parsing and the ledger."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec
from test_submit import OPSKIT, chain_spec, iterations_logged, one, tasks_of

from opskit.logs.crash import expand_nodelist, find_crashes
from opskit.monitor.pulse import wait_until_gone
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm.client import QueueEntry
from opskit.spec.files import SpecError
from opskit.spec.load import load_spec
from opskit.submission.submit import SubmitError, submit

# The 2022-03-21 crash of BLOOM-176B (tr11 chronicles), as torchrun's --tee prints a worker's stderr.
BLOOM_CRASH = """\
[default3]:terminate called after throwing an instance of 'c10::CUDAError'
[default3]:  what():  CUDA error: unknown error
[default3]:Exception raised from query at ../aten/src/ATen/cuda/CUDAEvent.h:95 (most recent call first):
[default3]:frame #1: c10d::ProcessGroupNCCL::WorkNCCL::finishedGPUExecutionInternal() const + 0x11a
"""


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, timeout=timeout)


def squeue_field(job_id: str, field: str) -> list[str]:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", field], capture_output=True, text=True, timeout=30)
    return done.stdout.split()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def wait_gone(name: str, *job_ids: str, timeout: float = 180) -> None:
    for job_id in job_ids:
        assert wait_until_gone(name, job_id, lambda p: None, interval_s=1, timeout_s=timeout), job_id


def ledger(run: RunPaths) -> list[tuple[str, str]]:
    return [(row.task, row.state) for row in chain.read_ledger(run)]


# --------------------------------------------------------------------------- pure parts


def test_crash_signatures_and_their_nodes():
    crashes = find_crashes(BLOOM_CRASH.splitlines(), node="r7i5n2")
    assert crashes == [("r7i5n2", "CUDA error: unknown error", "[default3]:  what():  CUDA error: unknown error", 3)]
    assert crashes[0].where == "r7i5n2, local rank 3"
    # srun --label prefixes map to the job's node list; a software error that mentions CUDA is no hardware crash.
    lines = ["0: iteration 10 | lm loss 3.2", "1: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191",
             "0: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
             "1: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)",
             "2: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus."]
    assert [(c.node, c.signature) for c in find_crashes(lines, nodes=["r7i5n2", "r7i5n6"])] == [
        ("r7i5n6", "NCCL error"), ("r7i5n6", "NCCL watchdog timeout"), (None, "GPU fell off the bus")]
    # torchrun --tee's worker prefix, after srun's label or alone, names the GPU of the node; a bare line does not.
    lines = ["1: [default7]:RuntimeError: NCCL error in: x", "[trainer12]:NVRM: Xid 79", "[default]:NCCL error"]
    assert [(c.where, c.local_rank) for c in find_crashes(lines, nodes=["a", "b"])] == [
        ("b, local rank 7", 7), ("local rank 12", 12), ("", None)]


@pytest.mark.parametrize("nodelist, names", [
    ("jean-zay-iam52", ["jean-zay-iam52"]), ("node[9-10]", ["node9", "node10"]),
    ("r7i5n[2-3],r8i0n7", ["r7i5n2", "r7i5n3", "r8i0n7"]), ("n[08-10,12]", ["n08", "n09", "n10", "n12"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"])])
def test_node_lists_expand_in_srun_task_order(nodelist, names, tmp_path):
    """The order srun --label's task ids follow; SLURM's own expansion agrees where SLURM is installed. scontrol reads
    a configuration even to expand a list: a minimal one of the test's own, so that the check does not depend on a
    local cluster having been set up on this machine (on a fresh one scontrol looks for its controller in DNS)."""
    assert expand_nodelist(nodelist) == names
    if shutil.which("scontrol"):
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=expand\nSlurmctldHost=localhost\n")
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "SLURM_CONF": str(conf)})
        assert done.stdout.split() == names, done.stderr


@pytest.mark.parametrize("nodelist", ["", "n[1-2", "n]1", "n[10-8]", "n[a-b]", "a,,b"])
def test_bad_node_lists_are_refused(nodelist):
    with pytest.raises(ValueError, match=re.escape(repr(nodelist))):
        expand_nodelist(nodelist)


def test_queue_counts_array_tasks_and_finds_the_last_job():
    rows = [QueueEntry("682842_[2-5%1]", "gpu", "tr", "PENDING", "0:00", "48", "N/A", "(JobArrayTaskLimit)",
                       comment="opskit-run:/runs/tr"),
            QueueEntry("682842_1", "gpu", "tr", "RUNNING", "1:00", "48", "2022", "r7i5n[2-3]",
                       comment="opskit-run:/runs/tr"),
            QueueEntry("690001", "gpu", "tr", "PENDING", "0:00", "48", "N/A", "(Dependency)")]
    queue = chain.queue_of(rows)
    assert (queue.tasks, queue.last_job) == (6, "690001")
    assert chain.array_tasks("700000_[1,3-4]") == 3 and chain.array_tasks("5_[1-9:2%1]") == 5
    assert chain.queue_of([]).last_job is None


def test_a_runs_jobs_are_known_by_comment_or_by_name_and_script():
    def row(job_id: str, name: str = "tr", comment: str = "", command: str = "") -> QueueEntry:
        return QueueEntry(job_id, "gpu", name, "PENDING", "0:00", "1", "N/A", "(None)", comment=comment,
                          command=command)

    rows = [row("1", comment="opskit-run:/runs/tr"),
            row("2", name="renamed", comment="opskit-run:/runs/tr"),  # slurm.job_name changed: still the run's
            row("3", command="/runs/tr/slurm/train.slurm"),  # submitted before comments
            row("4", comment="account=x", command="/runs/tr/slurm/train.slurm"),  # a site rewrote the comment
            row("5", comment="opskit-run:/runs/tr2"),  # another run of the same name
            row("6", command="/runs/tr2/slurm/train.slurm"),
            row("7", name="other", command="/runs/tr/slurm/train.slurm"),
            row("8"),  # same name, --wrap: no script, no comment
            row("9", name="tr-cron", comment="opskit-cron:/runs/tr"),
            row("10", name="tr-cron", command="/runs/tr/cron/cron.slurm")]
    run = RunPaths(Path("/runs/tr"))
    assert [e.job_id for e in chain.run_jobs(run, "tr", rows)] == ["1", "2", "3", "4"]
    assert [e.job_id for e in chain.run_jobs(run, "tr-cron", rows, "cron")] == ["9", "10"]
    assert chain.job_comment(run) == "opskit-run:/runs/tr" and chain.job_comment(run, "cron") == "opskit-cron:/runs/tr"
    with pytest.raises(chain.ChainError, match=r"^paths.output '/runs/a\\nb': a control character"):
        chain.job_comment(RunPaths(Path("/runs/a\nb")))


def test_ledger_counts_failures_since_the_last_success(tmp_path):
    run = RunPaths(tmp_path)
    rows = [("1_1", "FAILED"), ("1_2", "COMPLETED"), ("1_3", "TIMEOUT"), ("1_4", "SKIPPED"), ("1_5", "CANCELLED"),
            ("1_6", "FAILED")]
    for task, state in rows:
        chain.record(run, chain.TaskOutcome("2026-01-01 00:00:00", task, task, state, 1, "n1"))
    assert [r.task for r in chain.consecutive_failures(chain.read_ledger(run))] == ["1_3", "1_6"]
    run.ledger.write_text(run.ledger.read_text() + "not json\n")
    with pytest.raises(chain.ChainError, match=rf"^{re.escape(str(run.ledger))}:7: not a ledger record"):
        chain.read_ledger(run)
    with pytest.raises(chain.ChainError, match="expected a host name"):
        chain.add_bad_nodes(run, {"n1 $(reboot)": "why"})


def test_clearing_bad_nodes_takes_only_the_named_ones_off(tmp_path):
    run = RunPaths(tmp_path)
    chain.add_bad_nodes(run, {"n1": "fan", "n2": "ECC errors", "n3": "NCCL timeout"})
    assert chain.clear_bad_nodes(run, ["n2", "n9"]) == ["n2"]  # n9 was never on the list
    assert chain.read_bad_nodes(run) == {"n1": "fan", "n3": "NCCL timeout"}
    assert chain.clear_bad_nodes(run) == ["n1", "n3"] and not run.bad_nodes.exists()


def test_kill_switch_and_nodes_leave_a_folder_opskit_did_not_create_alone(tmp_path):
    data = SimpleNamespace(data_prefix=str(tmp_path / "kjv_text_document"))
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes").write_text("my notes\n")
    (root / "kill-switch").write_text("my own file\n")
    (root / "bad-nodes.txt").write_text("# mine\nn1\tbroken fan\n")
    (root / "bad-nodes.txt").chmod(0o600)
    spec = str(write_spec(tmp_path / "s.yaml", data, root))
    before = {p.name: (p.stat().st_mode, p.read_bytes()) for p in root.iterdir()}
    for args in (("kill-switch", spec, "off"), ("kill-switch", spec, "on"), ("nodes", "add", spec, "n2"),
                 ("nodes", "clear", spec)):
        done = cli(*args)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, (args, done.stdout, done.stderr)
        assert done.stderr.startswith(f"error: {root}: paths.output exists and holds files opskit did not write")
    assert {p.name: (p.stat().st_mode, p.read_bytes()) for p in root.iterdir()} == before


@pytest.mark.parametrize("output", ["/", "", ".", "//"])
def test_paths_output_must_name_a_folder_of_its_own(tmp_path, output):
    data = SimpleNamespace(data_prefix=str(tmp_path / "kjv_text_document"))
    path = write_spec(tmp_path / "s.yaml", data, tmp_path)
    path.write_text(path.read_text().replace(f"output: {tmp_path}", f"output: '{output}'"))
    with pytest.raises(SpecError, match=rf"^{re.escape(str(path))}: paths.output: .* is not a run directory of its "
                                        "own; name one, e.g. runs/<name>$"):
        load_spec(str(path))
    done = cli("kill-switch", str(path), "on")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not Path("/kill-switch").exists() and not (tmp_path / "kill-switch").exists()


def test_chain_fields_of_the_spec_are_checked(tmp_path):
    data = SimpleNamespace(data_prefix=str(tmp_path / "kjv_text_document"))
    path = write_spec(tmp_path / "s.yaml", data, tmp_path / "run", slurm={"group": "six $(id)", "max_failures": 0})
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value).startswith(f"{path}: slurm.group: String should match pattern")
    assert "; slurm.max_failures: Input should be greater than 0" in str(info.value)
    with pytest.raises(chain.ChainError, match=r"^slurm.group 'nosuchgroup-w5': no such Unix group here"):
        chain.group_users("nosuchgroup-w5")


# --------------------------------------------------------------------------- SLURM


def long_chain(tmp_path, data, kind: str, cancel_after):
    """A 2-task chain that trains far longer than any test waits (stopped by the test), submitted."""
    name = f"opskit-{kind}-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, data, name, 100_000, time="10", exit_margin_mins=5, signal_margin_secs=10)
    sub = submit(spec, array=2)
    cancel_after.append(sub.job_id)
    return name, spec, str(tmp_path / "spec.yaml"), sub


def test_second_submit_chains_keep_hold_release_kill_switch(kjv_data, tmp_path, slurm, cancel_after):
    name, spec, spec_path, first = long_chain(tmp_path, kjv_data, "ks", cancel_after)
    assert first.after is None and not any(c.startswith("--dependency") for c in first.command)
    run = first.run
    wait_for(lambda: run.main_log.is_file() and iterations_logged(run.main_log.read_text()), 120,
             "task 1 never started training")

    # A second submit while task 1 runs and task 2 is pending: chained after the array, and the user is told.
    second = submit(spec, array=1)
    cancel_after.append(second.job_id)
    assert second.after == first.job_id
    assert second.command == ["sbatch", "--parsable", f"--dependency=afterany:{first.job_id}", str(run.script)]
    assert any(f"--dependency=afterany:{first.job_id}" in note and "2 task(s)" in note for note in second.notes)
    assert squeue_field(second.job_id, "%E") == [f"afterany:{first.job_id}_*(unfulfilled)"]

    # --keep: 3 tasks are queued (1 running, 2 pending), so nothing is submitted for K=3; K=4 would.
    kept = submit(spec, keep=3)
    assert (kept.job_id, kept.command) == (None, []) and kept.skipped.startswith(f"3 task(s) of {name} ")
    assert submit(spec, keep=4, dry_run=True).command[-1] == str(run.script)

    held = cli("hold", spec_path)
    assert held.stdout == f"held {name}: job(s) {first.job_id}, {second.job_id}\n", held.stderr
    assert squeue_field(second.job_id, "%r")[0] in ("JobHeldUser", "JobHeldAdmin")
    released = cli("release", spec_path, "--json")
    assert json.loads(released.stdout)["job_ids"] == [first.job_id, second.job_id], released.stderr
    assert squeue_field(second.job_id, "%r")[0] not in ("JobHeldUser", "JobHeldAdmin")

    on = cli("kill-switch", spec_path, "on")
    assert on.returncode == 0 and f"kill switch {run.kill_switch} is now on" in on.stdout, on.stderr
    wait_gone(name, first.job_id, second.job_id)
    refusal = r"the kill switch .* is on, so every task would exit at start: `opskit kill-switch .* off` first"
    [warning] = submit(spec, dry_run=True).warnings  # a dry run shows it with the script
    assert re.fullmatch(refusal, warning), warning
    with pytest.raises(SubmitError, match=f"^{refusal}$"):
        submit(spec)
    assert cli("kill-switch", spec_path, "off").returncode == 0 and not run.kill_switch.exists()

    # Task 1 saved where it stopped and exited 0; the queued tasks exited at start without training.
    log = run.main_log.read_text()
    tasks = tasks_of(log)
    assert [t for t, _ in tasks] == [f"{first.job_id}_1", f"{first.job_id}_2", f"{second.job_id}_0"], log[-3000:]
    one(r"\[Detected kill switch at .*kill-switch\. Exiting\] datetime: ", tasks[0][1])
    stopped = iterations_logged(tasks[0][1])[-1][0]
    saved = int(one(r"successfully saved checkpoint at iteration +(\d+) to ", tasks[0][1]).group(1))
    assert saved >= stopped and (run.checkpoints / "latest").read_text() == f"global_step{saved}"
    for _, text in tasks[1:]:
        one(r"exiting at once: the kill switch is on", text)
        assert not iterations_logged(text) and one(r"end, exit code (\d+)$", text).group(1) == "0"
    assert ledger(run) == [(f"{first.job_id}_1", "COMPLETED"), (f"{first.job_id}_2", "SKIPPED"),
                           (f"{second.job_id}_0", "SKIPPED")]


def test_finished_flag_drains_the_array(kjv_data, tmp_path, slurm, cancel_after):
    name = f"opskit-fin-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, 50, array=3)
    sub = submit(spec, begin="now+3")
    cancel_after.append(sub.job_id)
    assert sub.command[-2] == "--begin=now+3"
    # As if an edited spec were submitted while this chain waits: each task writes back its own DeepSpeed config.
    run = sub.run
    rendered = run.ds_config.read_text()
    run.ds_config.write_text('{"train_batch_size": 4096}\n')
    wait_gone(name, sub.job_id)
    assert run.ds_config.read_text() == rendered
    tasks = tasks_of(run.main_log.read_text())
    assert [t for t, _ in tasks] == [f"{sub.job_id}_{i}" for i in (1, 2, 3)]
    one(r"\[after training is done\] datetime: ", tasks[0][1])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d training finished at iteration 50, consumed samples 400\n",
                        run.finished_flag.read_text())
    for _, text in tasks[1:]:
        one(r"exiting at once: the finished flag exists: training is done$", text)
        assert "torch.distributed.run" not in text and one(r"end, exit code (\d+)$", text).group(1) == "0"
    assert ledger(run) == [(f"{sub.job_id}_1", "COMPLETED"), (f"{sub.job_id}_2", "SKIPPED"),
                           (f"{sub.job_id}_3", "SKIPPED")]

    with pytest.raises(SubmitError, match=r"^the training finished \(.*finished: .* training finished at iteration "
                                          r"50, consumed samples 400\); .* again with --yes to remove the flag$"):
        submit(spec)
    dry = submit(spec, dry_run=True, yes=True)
    assert dry.notes[0] == f"would remove {run.finished_flag} (the training finished) as --yes asks"
    assert run.finished_flag.exists()


# A worker process (torchrun sets RANK) that dies the way BLOOM-176B's did; the chain hook (no RANK) is unaffected.
SITECUSTOMIZE = """\
import os, sys
if "RANK" in os.environ:
    sys.stderr.write("terminate called after throwing an instance of 'c10::CUDAError'\\n")
    sys.stderr.write("  what():  CUDA error: unknown error\\n")
    sys.stderr.flush()
    os._exit(1)
"""


def test_crash_puts_the_node_on_the_bad_list_and_failures_stop_the_chain(kjv_data, tmp_path, slurm, cancel_after):
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    (crash_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    name = f"opskit-crash-{uuid.uuid4().hex[:8]}"
    pythonpath = f"{crash_dir}:{Path(__file__).resolve().parents[1]}"
    spec = chain_spec(tmp_path, kjv_data, name, 50, array=3, max_failures=2,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    sub = submit(spec)
    cancel_after.append(sub.job_id)
    wait_gone(name, sub.job_id)
    run = sub.run
    log = run.main_log.read_text()
    tasks = tasks_of(log)
    assert [t for t, _ in tasks] == [f"{sub.job_id}_{i}" for i in (1, 2, 3)], log[-3000:]
    # the job blames the node (opskit.allocation.in_job); with no other node to train on, the chain takes over
    one(r"blamed localhost: CUDA error: unknown error: .*CUDA error: unknown error$", tasks[0][1])
    one(r"0 usable node\(s\) left for 1: the chain's next task takes over$", tasks[0][1])
    alert = one(r"\*\*\*ALERT: .*: 2 consecutive failed tasks \(\S+_1 FAILED exit 1 on localhost, \S+_2 FAILED exit 1 "
                r"on localhost\); the chain is stopped, later tasks exit at start\. Fix the cause, then `opskit "
                r"submit .* --yes`\*\*\*$", tasks[1][1])
    one(r"exiting at once: the chain was stopped \(after failures or starts that saved nothing: chain-stopped says "
        r"which\)$", tasks[2][1])
    rows = chain.read_ledger(run)
    assert [(r.task, r.state, r.exit_code, r.nodes) for r in rows] == [
        (f"{sub.job_id}_1", "FAILED", 1, "localhost"), (f"{sub.job_id}_2", "FAILED", 1, "localhost"),
        (f"{sub.job_id}_2", "ALERT", None, "localhost"), (f"{sub.job_id}_3", "SKIPPED", 0, "localhost")]
    assert rows[0].reason == "CUDA error: unknown error on localhost"
    assert alert.group(0) in run.stopped_flag.read_text()
    node_logs = sorted(run.node_logs.glob("*-localhost.log"))  # <each task's job id>-<node>.log
    assert len(node_logs) == 2 and all("  what():  CUDA error: unknown error" in f.read_text() for f in node_logs)

    # The next submission carries --exclude (and needs --yes to clear the stop); `opskit nodes` edits the list.
    [warning] = submit(spec, dry_run=True).warnings
    assert re.match(r"the chain was stopped .* fix the cause", warning), warning
    with pytest.raises(SubmitError, match=r"^the chain was stopped .* fix the cause"):
        submit(spec)
    dry = submit(spec, dry_run=True, yes=True)
    assert "#SBATCH --exclude=localhost\n" in dry.script
    assert any(note.startswith("excluding bad node(s) localhost ") for note in dry.notes)
    listed = cli("nodes", "list", str(tmp_path / "spec.yaml"), "--json")
    assert list(json.loads(listed.stdout)) == ["localhost"]
    assert "CUDA error: unknown error" in json.loads(listed.stdout)["localhost"]
    assert cli("nodes", "clear", str(tmp_path / "spec.yaml")).stdout == "cleared localhost\n"
    assert "--exclude" not in submit(spec, dry_run=True, yes=True).script
    bad = cli("nodes", "add", str(tmp_path / "spec.yaml"), "r7i5n2;reboot")
    assert (bad.returncode, bad.stderr) == (1, "error: node 'r7i5n2;reboot': expected a host name (letters, digits, "
                                                ". _ -)\n")


def test_starts_that_save_nothing_stop_the_chain_and_cancel_its_queue(kjv_data, tmp_path, slurm, cancel_after):
    """A restart storm: every start dies before its first save (no crash signature, so no bad node). After
    slurm.max_stalled_starts starts (2), before slurm.max_failures (3), the chain stops with chain.restart_storm, the
    array's pending tasks are cancelled (none left to start and skip), and `opskit status` raises that alert."""
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    (crash_dir / "sitecustomize.py").write_text('import os\nif "RANK" in os.environ:\n    os._exit(3)\n')
    name = f"opskit-storm-{uuid.uuid4().hex[:8]}"
    pythonpath = f"{crash_dir}:{Path(__file__).resolve().parents[1]}"
    spec = chain_spec(tmp_path, kjv_data, name, 50, array=4, max_failures=3, max_stalled_starts=2,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    sub = submit(spec)
    cancel_after.append(sub.job_id)
    wait_gone(name, sub.job_id)
    rows = chain.read_ledger(sub.run)
    job = sub.job_id
    assert [(r.task, r.state, r.checkpoint) for r in rows] == [
        (f"{job}_1", "FAILED", ""), (f"{job}_2", "FAILED", ""), (f"{job}_2", "ALERT", None)], rows
    assert re.match(rf"\*\*\*ALERT: .*: 2 starts in a row saved nothing \({job}_1 FAILED exit 1 on localhost, "
                    rf"{job}_2 FAILED exit 1 on localhost; latest still absent\); the chain is stopped, its queued "
                    r"tasks cancelled\.", rows[2].reason), rows[2].reason
    one(rf"cancelled the pending tasks of job\(s\) {job}$", sub.run.main_log.read_text())
    assert chain.stopped_code(sub.run.stopped_flag.read_text()) == "chain.restart_storm"
    status = cli("status", str(tmp_path / "spec.yaml"), "--json")
    storm = next(f for f in json.loads(status.stdout)["findings"] if f["key"] == "chain.restart_storm")
    assert storm["severity"] == "alert" and "2 starts in a row saved nothing" in storm["message"]


def test_stalled_starts_count_starts_that_left_latest_where_it_was():
    """Only starts count (SKIPPED and CANCELLED tasks do not), a start that moved ``latest`` ends the run of stalled
    ones, and a ledger line from before checkpoints were recorded (None) is not taken for a stall."""
    def row(task, state, checkpoint):
        return chain.TaskOutcome("2026-01-01 00:00:00", "1", task, state, 1, "n1", "", checkpoint)

    rows = [row("1", "FAILED", None), row("2", "COMPLETED", "global_step100"), row("3", "FAILED", "global_step100"),
            row("4", "SKIPPED", "global_step100"), row("5", "CANCELLED", "global_step100"),
            row("6", "TIMEOUT", "global_step100")]
    assert [r.task for r in chain.stalled_starts(rows)] == ["3", "6"]
    assert chain.stalled_starts([*rows, row("7", "COMPLETED", "global_step200")]) == []
    assert [r.task for r in chain.stalled_starts([row("1", "FAILED", ""), row("2", "FAILED", "")])] == ["1", "2"]
    assert chain.stalled_starts([row("1", "FAILED", None), row("2", "FAILED", None)]) == []
    assert chain.stopped_code("2026-01-01 00:00:00 [chain.restart_storm] ***ALERT: x***") == "chain.restart_storm"
    assert chain.stopped_code("2026-01-01 00:00:00 ***ALERT: x***") is None  # a flag from before the codes


def test_a_crash_on_one_gpu_of_a_node_ends_the_job_and_status_names_its_local_rank(kjv_data, tmp_path, slurm,
                                                                                     cancel_after):
    """Two workers on one node (DP = 2), the one of local rank 1 dies as a broken GPU does (the test-only fault hook):
    torchrun ends the other, the task fails instead of hanging, and the watchdog's crash alert names node and GPU."""
    name = f"opskit-gpu-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, 50, parallel={"gpus_per_node": 2}, array=1,
                      env={"OMP_NUM_THREADS": "1", "OPSKIT_TEST_FAULT": "crash:localhost:iteration=2:local_rank=1"})
    sub = submit(spec)
    cancel_after.append(sub.job_id)
    wait_gone(name, sub.job_id)
    assert [(r.state, r.exit_code) for r in chain.read_ledger(sub.run)] == [("FAILED", 1)]
    status = cli("status", str(tmp_path / "spec.yaml"), "--json")
    crash = next(f for f in json.loads(status.stdout)["findings"] if f["key"] == "log.crash")
    assert re.match(r"\d+ crash line\(s\) since the last check, first: CUDA launch failure on localhost, local rank "
                    r"1: 0: \[default1\]:  what\(\):  \[Rank 1\] NCCL watchdog", crash["message"]), crash
    assert crash["data"]["crashes"][0]["local_rank"] == 1


def test_a_hang_on_one_gpu_prints_every_ranks_stacks_and_status_names_it_and_ends_the_job(kjv_data, tmp_path, slurm,
                                                                                        cancel_after):
    """Two workers on one node (DP = 2), the one of local rank 1 stops inside iteration 3 (the test-only hook): the
    other waits for it in a collective, both print their stacks after --stack-dump-after-mins (half the watchdog's
    hang floor), and ``opskit status`` names local rank 1 and the frame it is stuck in, then cancels the task."""
    name = f"opskit-hung-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, 50, parallel={"gpus_per_node": 2}, array=1, log_interval=1,
                      watchdog={"hang_min_minutes": 0.1, "cancel_hung": True},
                      env={"OMP_NUM_THREADS": "1", "OPSKIT_TEST_FAULT": "hang:localhost:iteration=2:local_rank=1"})
    sub = submit(spec)
    cancel_after.append(sub.job_id)
    wait_for(lambda: sub.run.main_log.exists() and sub.run.main_log.read_text().partition(
        "OPSKIT_TEST_FAULT: hanging")[2].count("Timeout (0:00:03)!") == 2, 180, "no two stack dumps after the hang")
    time.sleep(max(0.0, sub.run.main_log.stat().st_mtime + 7 - time.time()))  # the watchdog's floor is 6 s
    status = cli("status", str(tmp_path / "spec.yaml"), "--json")
    hang = next(f for f in json.loads(status.stdout)["findings"] if f["key"] == "log.hang")
    [stuck] = hang["data"]["stuck"]
    assert (stuck["node"], stuck["local_rank"]) == ("localhost", 1), hang
    assert re.fullmatch(r"opskit/train/fault\.py:\d+ in inject_test_fault", stuck["frame"]), hang
    assert re.search(r"; stacks: localhost, local rank 1 is in opskit/train/fault\.py:\d+ in inject_test_fault while "
                     r"1 other rank\(s\) wait in torch/distributed/\S+:\d+ in \S+; cancelled", hang["message"]), hang
    wait_gone(name, sub.job_id)
    assert [r.state for r in chain.read_ledger(sub.run)] == ["CANCELLED"]


def test_cli_dry_run_options_and_cancel_recorded(kjv_data, tmp_path, slurm, cancel_after):
    name, _, spec_path, sub = long_chain(tmp_path, kjv_data, "cancel", cancel_after)

    # The exact sbatch command, with the automatic dependency, --after, --begin and --nodes.
    done = cli("submit", spec_path, "--dry-run", "--array", "3", "--nodes", "2", "--after", "99", "--begin",
               "now+2hours")
    assert done.returncode == 0, done.stderr
    assert "\n#SBATCH --nodes=2\n" in done.stdout
    assert f"# note: {name} already has 2 task(s) running or pending (job {sub.job_id})" in done.stdout
    assert done.stdout.rstrip("\n").endswith(f"# would run: sbatch --parsable --array=1-3%1 --dependency=afterany:"
                                             f"{sub.job_id}:99 --begin=now+2hours {sub.run.script}")
    bad = cli("submit", spec_path, "--dry-run", "--after", "$(id)")
    assert (bad.returncode, bad.stderr) == (1, "error: --after $(id): expected a SLURM job id such as 1234 or "
                                               "1234_2\n")

    # scancel reaches the batch shell as SIGTERM: the ledger says CANCELLED, not FAILED.
    wait_for(lambda: list(sub.run.node_logs.glob("*.log")), 120, "task 1 never started")
    cancelled = cli("cancel", spec_path, "--yes")
    assert cancelled.stdout == f"cancelled {name}: job(s) {sub.job_id}\n", cancelled.stderr
    wait_gone(name, sub.job_id)
    one(r"SIGTERM: the job ends \(CANCELLED\)$", sub.run.main_log.read_text())
    rows = chain.read_ledger(sub.run)
    assert [(r.task, r.state, r.exit_code) for r in rows] == [(f"{sub.job_id}_1", "CANCELLED", 143)]
    assert chain.consecutive_failures(rows) == []
    assert cli("cancel", spec_path, "--yes").stdout == f"nothing to cancel: no job of {name} for {sub.run.root}\n"
    assert json.loads(cli("cancel", spec_path, "--yes", "--json").stdout) == {
        "action": "cancel", "job_name": name, "run": str(sub.run.root), "job_ids": []}


@pytest.mark.slurm
def test_submit_wait_stops_on_a_job_asking_more_cpus_than_the_node_has(kjv_data, tmp_path, slurm, cancel_after):
    # More CPUs per task than the node has (local-slurm.sh gives it the machine's online CPUs): SLURM accepts the job
    # and leaves it pending on PartitionConfig forever; --wait says so within a minute instead of waiting for ever.
    name = f"opskit-pf-{uuid.uuid4().hex[:8]}"
    chain_spec(tmp_path, kjv_data, name, 100, cpus_per_task=(os.cpu_count() or 1) + 1)
    spec_path = str(tmp_path / "spec.yaml")
    started = time.monotonic()
    done = cli("submit", spec_path, "--wait", timeout=120)
    waited = time.monotonic() - started
    submitted = re.search(r"-> job (\d+)\n", done.stdout)
    assert submitted, done.stdout + done.stderr
    job_id = submitted[1]
    cancel_after.append(job_id)
    assert done.returncode == 1 and waited < 60, (waited, done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert re.match(rf"error: job {job_id}\S* never starts: PartitionConfig: the job asks more than its partition "
                    r"allows or its nodes have \(CPUs per task, memory, GPUs, nodes\); lower slurm.cpus_per_task",
                    done.stderr), done.stderr
    # The job stays queued (the user decides), and the watchdog says the same as an alert.
    status = cli("status", spec_path, "--json")
    assert status.returncode == 1, status.stdout + status.stderr
    found = {f["key"]: f for f in json.loads(status.stdout)["findings"]}
    assert found["scheduler.pending_forever"]["severity"] == "alert"
    assert found["scheduler.pending_forever"]["message"].startswith(f"job {job_id}")
    assert cli("cancel", spec_path, "--yes").returncode == 0
    wait_gone(name, job_id)


# A worker that hangs (a stuck collective) and ignores the SIGUSR1 that asks it to save.
HANG = """\
import os, signal, time
if "RANK" in os.environ:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    time.sleep(600)
"""


def test_time_limit_is_recorded_as_timeout(kjv_data, tmp_path):
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    (hang_dir / "sitecustomize.py").write_text(HANG)
    pythonpath = f"{hang_dir}:{Path(__file__).resolve().parents[1]}"
    # The local executor enforces the limit as SLURM does: SIGUSR1 at 20 - 5 s, SIGTERM to everything at 20 s.
    spec = chain_spec(tmp_path, kjv_data, f"opskit-hang-{uuid.uuid4().hex[:8]}", 50, time="0:20",
                      exit_margin_mins=0.1, signal_margin_secs=5, env={"PYTHONPATH": pythonpath})
    sub = submit(spec, executor="local", array=2)
    assert [(t.task_id, t.timed_out) for t in sub.local_tasks] == [(1, True)]  # the executor stops after a failure
    log = sub.run.main_log.read_text()
    one(r"SIGUSR1: asking the trainer to save and exit$", log)
    one(r"SIGTERM: the job ends \(TIMEOUT\)$", log)
    rows = chain.read_ledger(sub.run)
    assert [(r.state, r.exit_code) for r in rows] == [("TIMEOUT", 143)]
    assert chain.consecutive_failures(rows) == rows
