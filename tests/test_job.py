"""The job script's one entry (opskit.allocation.job) without SLURM: its step loop driven by a fake launcher whose steps
are small Python processes (a crash line on a node, a hang, a trainer that saves on SIGUSR1), with the real in-job
recovery, main_log.txt and ledger underneath. The same loop on the 3-node SLURM: tests/test_multinode_failures.py."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from opskit.allocation import in_job, job
from opskit.rules.beats import beat_file, encode
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.train.fault import CRASH_LINES

DS_CONFIG = '{"train_batch_size": 16}\n'
ALLOCATION = job.Allocation("77", "70_1", "node[1-3]", under_slurm=False, partition=None, num_nodes=None)


class FakeSteps:
    """A launcher (:data:`opskit.allocation.job.Launcher`) whose step N runs ``snippets[N]`` with ``python -c``: the
    step's nodes in ``$NODES``, the run in ``$RUN``. Keeps each call's nodes and environment."""

    def __init__(self, run: RunPaths, *snippets: str):
        self.run, self.snippets = run, snippets
        self.calls: list[tuple[list[str], dict[str, str]]] = []
        self.processes: list[subprocess.Popen] = []

    def __call__(self, config: job.JobConfig, nodes: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.calls.append((nodes, env))
        code = self.snippets[len(self.calls) - 1]
        process = subprocess.Popen([sys.executable, "-c", code], env={**env, "NODES": ",".join(nodes),
                                                                      "RUN": str(self.run.root)},
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


CRASH_ON_NODE2 = f"""
import os, sys
with open(os.path.join(os.environ["RUN"], "logs", "nodes", "77-node2.log"), "a") as f:
    f.write({CRASH_LINES[1].format(rank=1)!r} + "\\n")
print("1: " + {CRASH_LINES[1].format(rank=1)!r}, flush=True)
sys.exit(1)
"""
TRAINED = "print('0: iteration 10/10 trained', flush=True)"
FAILS = "import sys; print('0: Traceback ... ValueError', flush=True); sys.exit(1)"
# a trainer that waits for SIGUSR1 (or SIGTERM), then saves and exits 0
WAITS = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: (print("0: saving checkpoint at iteration 7", flush=True), sys.exit(0)))
print("0: ready", flush=True)
time.sleep(60)
"""
# rank 1 on the second node stopped an iteration behind rank 0, which goes on beating
HANGS_ON_NODE2 = f"""
import os, time
from pathlib import Path
folder = Path(os.environ["OPSKIT_HEARTBEAT_DIR"]); folder.mkdir(parents=True, exist_ok=True)
first, second = os.environ["NODES"].split(",")
behind, ahead = folder / {beat_file(Path(), 1).name!r}, folder / {beat_file(Path(), 0).name!r}
behind.write_bytes({encode(1, "NODE", 0, 30, "train")!r}.replace(b"NODE", second.encode()))
old = time.time() - 30
os.utime(behind, (old, old))
while True:
    ahead.write_bytes({encode(0, "NODE", 0, 31, "train")!r}.replace(b"NODE", first.encode()))
    time.sleep(0.2)
"""


def make_run(tmp_path: Path) -> RunPaths:
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")  # opskit's marker: the job's run directory
    run.node_logs.mkdir(parents=True)
    return run


DEFAULT_LIMITS = in_job.Limits(900, 1800, 10)


def config(run: RunPaths, restarts: int = 1, limits: in_job.Limits = DEFAULT_LIMITS) -> job.JobConfig:
    return job.JobConfig(run, "tiny", nodes=2, gpus_per_node=1, master_port=6000, time_limit_s=3600, max_failures=3,
                         max_stalled_starts=3, in_job_restarts=restarts, preflight=True, limits=limits,
                         trainer_args=("--train-iters", "10"))


def said(run: RunPaths) -> list[str]:
    """main_log.txt's lines, opskit's own without their ``[opskit] DATE TIME job ...:`` prefix."""
    prefix = re.compile(r"^\[opskit\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d job 77 \(array task 70_1\) nodes node\[1-3\]: ")
    return [prefix.sub("", line) for line in run.main_log.read_text().splitlines()]


def ledger(run: RunPaths) -> list[tuple[str, int | None, str]]:
    return [(row.state, row.exit_code, row.reason) for row in chain.read_ledger(run)]


def test_a_crash_on_one_node_restarts_the_step_on_the_spare_and_the_task_completes(tmp_path):
    run = make_run(tmp_path)
    steps = FakeSteps(run, CRASH_ON_NODE2, TRAINED)
    out = io.BytesIO()
    code = job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION), stdout=out).run(DS_CONFIG)
    assert code == 0
    assert [nodes for nodes, _ in steps.calls] == [["node1", "node2"], ["node1", "node3"]]
    assert [env["OPSKIT_HEARTBEAT_DIR"].rsplit("/", 1)[1] for _, env in steps.calls] == ["77.0.heartbeats",
                                                                                         "77.1.heartbeats"]
    assert {env["MASTER_PORT"] for _, env in steps.calls} == {"6000"}
    lines = said(run)
    assert lines[:3] == ["start", "training step 0 on nodes node1,node2", "1: " + CRASH_LINES[1].format(rank=1)]
    assert lines[3].startswith("blamed node2: ") and "illegal memory access" in lines[3], lines
    assert lines[4:] == ["in-job restart 1 of 1: training resumes from the last checkpoint",
                         "training step 1 on nodes node1,node3", "0: iteration 10/10 trained", "end, exit code 0"]
    assert out.getvalue().decode().splitlines() == ["1: " + CRASH_LINES[1].format(rank=1), "0: iteration 10/10 trained"]
    assert run.ds_config.read_text() == DS_CONFIG  # the config this job was rendered with
    assert ledger(run) == [("COMPLETED", 0, "")]
    assert "(in-job): " in chain.read_bad_nodes(run)["node2"]


@pytest.mark.parametrize("restarts, step, ends_with", [
    (0, CRASH_ON_NODE2, ["step 0 failed (exit 1): no in-job restart left (slurm.in_job_restarts 0)",
                         # the ledger's epilogue: the crash's node goes on the bad-node list
                         "bad node(s) node2 (CUDA launch failure on node2): the next `opskit submit` excludes them"]),
    (1, FAILS, ["the step failed with no crash line, hang or node down to blame: no restart in this job"]),
], ids=["no-restart-left", "nothing-to-blame"])
def test_a_failed_step_that_cannot_be_restarted_ends_the_task_failed_for_the_chain(tmp_path, restarts, step, ends_with):
    run = make_run(tmp_path)
    steps = FakeSteps(run, step)
    code = job.Job(config(run, restarts), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION)).run(DS_CONFIG)
    assert code == 1 and len(steps.calls) == 1
    lines = said(run)
    assert lines[-len(ends_with) - 1:] == [*ends_with, "end, exit code 1"], lines
    assert ledger(run)[0][:2] == ("FAILED", 1)


def test_too_few_usable_nodes_start_no_step(tmp_path):
    run = make_run(tmp_path)
    steps = FakeSteps(run)
    one_node = job.Allocation("77", "70_1", "node1", False, None, None)
    log = job.MainLog(run.main_log, one_node)
    code = job.Job(config(run), one_node, steps, log).run(DS_CONFIG)
    assert code == 1 and steps.calls == []
    assert "no restart in this job: 1 usable node(s) of the allocation for 2: " in run.main_log.read_text()
    assert ledger(run)[0][:2] == ("FAILED", 1)


def test_a_main_log_that_cannot_be_written_stops_neither_the_job_nor_the_step(tmp_path):
    """A full disk (here: main_log.txt a folder): the lines and the step's output go to the job's output file."""
    run = make_run(tmp_path)
    run.main_log.mkdir()  # logs/ exists (make_run made logs/nodes)
    fallback = io.BytesIO()
    steps = FakeSteps(run, TRAINED)
    code = job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION, fallback)).run(DS_CONFIG)
    assert code == 0 and ledger(run) == [("COMPLETED", 0, "")]
    lines = fallback.getvalue().decode().splitlines()
    assert lines[0].startswith(f"[opskit] {run.main_log} not written ([Errno 21] Is a directory") and len(lines) == 5
    assert lines[2].endswith(": training step 0 on nodes node1,node2") and lines[3] == "0: iteration 10/10 trained"


def test_a_deepspeed_config_that_cannot_be_written_starts_no_step(tmp_path):
    run = make_run(tmp_path)
    run.ds_config.parent.write_text("not a folder")
    steps = FakeSteps(run)
    code = job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION)).run(DS_CONFIG)
    assert code == 1 and steps.calls == [] and ledger(run)[0][:2] == ("FAILED", 1)
    assert said(run)[1].startswith("the DeepSpeed config was not written: [Errno 17] File exists")


@pytest.mark.parametrize("flag, reason", [
    ("finished_flag", "the finished flag exists: training is done"),
    ("kill_switch", "the kill switch is on (opskit kill-switch NAME off)"),
    ("stopped_flag", "the chain was stopped (after failures or starts that saved nothing: chain-stopped says which)"),
])
def test_the_chain_stops_itself_before_any_step(tmp_path, flag, reason):
    run = make_run(tmp_path)
    getattr(run, flag).write_text("set\n")
    steps = FakeSteps(run)
    code = job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION)).run(DS_CONFIG)
    assert code == 0 and steps.calls == [] and not run.ds_config.exists()
    assert said(run) == ["start", f"exiting at once: {reason}", "end, exit code 0"]
    assert ledger(run) == [("SKIPPED", 0, reason)]


def signal_when(run: RunPaths, text: str, sig: int) -> threading.Thread:
    """A thread that sends ``sig`` to this process once ``text`` is in main_log.txt (as SLURM signals the batch
    shell); the handler runs on the main thread, in the job's wait for its step."""
    def send():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if run.main_log.exists() and text in run.main_log.read_text():
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def handlers():
    """Installs a Job's SIGUSR1 and SIGTERM handlers as :func:`opskit.allocation.job.main` does, restored afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}

    def install(j: job.Job) -> job.Job:
        signal.signal(signal.SIGUSR1, j.on_usr1)
        signal.signal(signal.SIGTERM, j.on_term)
        return j

    yield install
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_sigusr1_reaches_the_trainer_which_saves_and_no_restart_follows(tmp_path, handlers):
    run = make_run(tmp_path)
    steps = FakeSteps(run, WAITS)
    j = handlers(job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION)))
    signal_when(run, "0: ready", signal.SIGUSR1)
    try:
        assert j.run(DS_CONFIG) == 0
    finally:
        steps.kill()
    assert said(run)[-4:] == ["0: ready", "SIGUSR1: asking the trainer to save and exit",
                              "0: saving checkpoint at iteration 7", "end, exit code 0"]
    assert len(steps.calls) == 1 and ledger(run) == [("COMPLETED", 0, "")]


@pytest.mark.parametrize("elapsed, state", [(None, "CANCELLED"), (3595.0, "TIMEOUT")])
def test_sigterm_ends_the_task_as_cancelled_or_at_the_time_limit_as_timeout(tmp_path, handlers, elapsed, state):
    run = make_run(tmp_path)
    steps = FakeSteps(run, WAITS)
    clock = time.monotonic if elapsed is None else iter([0.0, elapsed]).__next__
    j = handlers(job.Job(config(run), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION), clock=clock))
    signal_when(run, "0: ready", signal.SIGTERM)
    try:
        assert j.run(DS_CONFIG) == job.TERMINATED
    finally:
        steps.kill()
    assert said(run)[-1] == f"SIGTERM: the job ends ({state})"
    assert ledger(run) == [(state, 143, "")]


def test_a_hang_is_named_by_the_watchdog_its_node_swapped_and_training_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(in_job, "DUMP_WAIT_S", 0.1)
    run = make_run(tmp_path)
    steps = FakeSteps(run, HANGS_ON_NODE2, TRAINED)
    limits = in_job.Limits(timeout=2, startup=60, hang_factor=5)
    try:
        code = job.Job(config(run, limits=limits), ALLOCATION, steps, job.MainLog(run.main_log, ALLOCATION)).run(
            DS_CONFIG)
    finally:
        steps.kill()
    assert code == 0
    lines = said(run)
    assert lines[1] == "training step 0 on nodes node1,node2"
    hang = (r"in-job watchdog: 1 of 2 ranks silent for up to 3\d s \(limit 2 s; last iteration 30\); hung: node2 local "
            r"rank 0 \(behind the others' iteration\); stopping the step")
    assert re.fullmatch(hang, lines[2]), lines
    assert lines[3].startswith("blamed node2: hung (silent 3"), lines
    assert lines[4:] == ["in-job restart 1 of 1: training resumes from the last checkpoint",
                         "training step 1 on nodes node1,node3", "0: iteration 10/10 trained", "end, exit code 0"]


def test_the_flags_round_trip_and_a_job_outside_slurm_is_one_line(tmp_path):
    run = make_run(tmp_path)
    c = config(run)
    assert job.parse_job_flags([*job.job_flags(c), "--", *c.trainer_args]) == c
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "opskit.allocation.job", *job.job_flags(c), "--"], input=DS_CONFIG,
                          capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("opskit.allocation.job: SLURM_JOB_ID is not set: a job of sbatch or of opskit submit "
                           "--executor local runs this\n")
    missing = config(RunPaths(tmp_path / "nowhere" / "run"))
    done = subprocess.run([sys.executable, "-m", "opskit.allocation.job", *job.job_flags(missing), "--"],
                          input=DS_CONFIG, capture_output=True, text=True, timeout=60,
                          env={**env, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node1"})
    assert (done.returncode, done.stderr) == (2, f"opskit.allocation.job: --run-dir {missing.run.root}: no such run "
                                                 "directory\n")
    assert not (tmp_path / "nowhere").exists()  # never created


GOLDEN_SCRIPTS = sorted((Path(__file__).parent / "golden").rglob("train.slurm"))


@pytest.mark.parametrize("path", GOLDEN_SCRIPTS, ids=lambda p: str(p.parent.relative_to(p.parents[2])))
def test_the_rendered_job_script_holds_no_control_flow(path):
    """Every bundled preset's job script (tests/golden, rendered by test_golden.py): after the #SBATCH header,
    comments, exports and one exec of opskit.allocation.job with its DeepSpeed config as a heredoc; no
    if/for/while/case, no trap, no function."""
    script = path.read_text()
    body = script[:script.index("<<'DS_CONFIG_JSON'")]
    commands = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    execs = [line for line in commands if line.startswith("exec ")]
    assert len(execs) == 1 and execs[0].endswith(" -m opskit.allocation.job \\")
    starts = {line.split()[0] for line in commands if not line.startswith(" ")}  # the rest continues the exec
    assert starts == {"export", "exec"}, starts
    assert all(line.startswith("        --") or line == "    -- \\" for line in commands[commands.index(execs[0]) + 1:])
