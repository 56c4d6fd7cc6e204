"""scripts/local-slurm.sh against a real single-node SLURM (no mocks).

Needs root (the script starts daemons and may apt-get install slurm-wlm munge).
The module leaves SLURM running so that later tests find it up.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import alive

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.geteuid() != 0, reason="local SLURM needs root"),
]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "local-slurm.sh"
STATE_DIR = Path(os.environ.get("OPSKIT_SLURM_DIR", "/var/lib/opskit-slurm"))
PID_FILES = {
    "slurmctld": STATE_DIR / "slurmctld.pid",
    "slurmd": STATE_DIR / "slurmd.pid",
    "munged": STATE_DIR / "munge" / "munged.pid",
}
# What a brand-new login shell would have: no SLURM_CONF, nothing from this process.
CLEAN_ENV = {"PATH": "/usr/bin:/bin"}


def script(action: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # First start on a fresh machine runs apt-get, hence the generous timeout there.
    return subprocess.run(
        [str(SCRIPT), action], capture_output=True, text=True, timeout=timeout, check=False
    )


def clean(*cmd: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    """Run a SLURM client as if from a new shell: `env -i PATH=/usr/bin:/bin ...`."""
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, env=CLEAN_ENV, check=False
    )


def daemon_pids() -> dict[str, int | None]:
    pids: dict[str, int | None] = {}
    for name, path in PID_FILES.items():
        try:
            pid = int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            pid = None
        pids[name] = pid if pid is not None and alive(pid) else None
    return pids


def wait_gone(job_id: str, timeout: float) -> None:
    """Poll until squeue no longer lists the job as pending/running/completing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = clean("squeue", "-h", "-j", job_id, "-o", "%i %T")
        assert out.returncode == 0, out.stderr
        if not out.stdout.strip():
            return
        time.sleep(0.2)
    pytest.fail(f"job {job_id} still in squeue after {timeout}s: {out.stdout!r}")


def sbatch(*args: str) -> str:
    out = clean("sbatch", "--parsable", *args)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    assert job_id.isdigit(), out.stdout
    return job_id


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
    out = script("start", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    yield
    # Later tests expect a running SLURM, whatever happened above.
    if script("status").returncode != 0:
        script("start")


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="opskit-slurm-test-", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def test_start_twice_is_idempotent():
    before = daemon_pids()
    assert before["slurmctld"] and before["slurmd"], before
    out = script("start")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already up" in out.stdout
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert daemon_pids() == before


def test_sbatch_and_squeue_work_from_a_clean_environment(workdir):
    job_id = sbatch("--chdir", str(workdir), "-o", "/dev/null", "--wrap", "sleep 30")
    try:
        out = clean("squeue", "-h", "-j", job_id, "-o", "%i|%T")
        assert out.returncode == 0, out.stderr
        jid, state = out.stdout.strip().split("|")
        assert jid == job_id
        assert state in {"PENDING", "CONFIGURING", "RUNNING"}
        # The clients found the config at the default path, with no SLURM_CONF.
        cfg = clean("scontrol", "show", "config")
        assert "ClusterName             = opskit" in cfg.stdout
    finally:
        clean("scancel", job_id)
    wait_gone(job_id, timeout=15)
    # scancel reached the job: it ended CANCELLED, not COMPLETED.
    final = clean("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
    assert final.stdout.strip() == "CANCELLED"


def test_throttled_array_runs_tasks_one_after_another_in_order(workdir):
    log = workdir / "tasks.log"
    body = (
        'echo "$SLURM_ARRAY_TASK_ID start $(date +%s.%N)" >> tasks.log; sleep 1; '
        'echo "$SLURM_ARRAY_TASK_ID end $(date +%s.%N)" >> tasks.log'
    )
    job_id = sbatch(
        "--array=1-3%1", "--chdir", str(workdir), "-o", "/dev/null", "--wrap", body
    )
    wait_gone(job_id, timeout=30)

    events = [line.split() for line in log.read_text().splitlines()]
    assert [(task, kind) for task, kind, _ in events] == [
        ("1", "start"), ("1", "end"),
        ("2", "start"), ("2", "end"),
        ("3", "start"), ("3", "end"),
    ]
    stamps = [float(ts) for _, _, ts in events]
    # Strictly one after another: each task starts after the previous one ended.
    assert stamps == sorted(stamps)
    states = clean("squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%K %T")
    assert sorted(states.stdout.split("\n")[:-1]) == [
        "1 COMPLETED", "2 COMPLETED", "3 COMPLETED",
    ], states.stdout


def test_status_stop_start_cycle(workdir):
    up = script("status")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "slurmctld: running (pid" in up.stdout
    assert "localhost" in up.stdout  # sinfo output

    # A running job must not outlive stop (it would survive a slurmd stop otherwise).
    job_id = sbatch(
        "--chdir", str(workdir), "-o", "/dev/null", "--wrap", "echo $$ > job.pid; exec sleep 300"
    )
    pid_file = workdir / "job.pid"
    deadline = time.monotonic() + 15
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.1)
    job_pid = int(pid_file.read_text())
    assert alive(job_pid)

    old = daemon_pids()
    down = script("stop")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not alive(job_pid), "stop left the job's process running"
    assert not any(pid and alive(pid) for pid in old.values()), old

    status = script("status")
    assert status.returncode == 1, status.stdout
    assert "slurmctld: not running" in status.stdout
    assert "slurmd: not running" in status.stdout

    again = script("stop")
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout

    back = script("start")
    assert back.returncode == 0, back.stdout + back.stderr
    assert back.stdout.startswith("SLURM up:"), back.stdout
    assert script("status").returncode == 0
    # State survives a restart: job ids keep counting instead of restarting at 1.
    new_id = sbatch("--chdir", str(workdir), "-o", "/dev/null", "--wrap", "true")
    assert int(new_id) > int(job_id)
    wait_gone(new_id, timeout=15)
