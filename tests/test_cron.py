"""``opskit cron`` round trips: the self-resubmitting SLURM job on the real local SLURM (runs, resubmits itself for an
hour later, is noticed when gone, is removed by uninstall), and the real user crontab (Debian's cron package)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec
from test_submit import OPSKIT

from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.spec.load import load_spec
from opskit.upkeep import cron


def cron_spec(tmp_path: Path, job_name: str, output: Path | None = None):
    data = SimpleNamespace(data_prefix=str(tmp_path / "data" / "kjv_text_document"))  # cron never reads the data
    path = write_spec(tmp_path / "spec.yaml", data, output or tmp_path / "run",
                      slurm={"job_name": job_name, "cron_partition": "debug"})
    return load_spec(str(path))


def cron_jobs(name: str) -> list[client.QueueEntry]:
    return [e for e in client.squeue() if e.name == name]


@pytest.fixture
def cron_name(slurm):
    name = f"opskit-cron-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", "--name", f"{name}-cron"], capture_output=True, timeout=30)


def test_cron_via_slurm_runs_resubmits_and_uninstalls(tmp_path, cron_name, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = cron_spec(tmp_path, cron_name)
    run = RunPaths.of(spec)
    installed = cron.install(spec, method="slurm")
    first = installed.job_ids[0]
    assert installed.job_name == f"{cron_name}-cron" and Path(installed.script).is_file()

    # The first run starts at once, resubmits itself for an hour later, then runs `opskit status` (an ALERT here).
    deadline = time.monotonic() + 90
    while not [e for e in cron_jobs(installed.job_name) if e.array_id != first]:
        assert time.monotonic() < deadline, "the cron job never resubmitted itself"
        time.sleep(1)
    output = run.cron_dir / f"{installed.job_name}-{first}.out"
    while "***ALERT:" not in (output.read_text() if output.exists() else ""):
        assert time.monotonic() < deadline, output.read_text() if output.exists() else "no output"
        time.sleep(1)
    assert f"PULSE: ***ALERT: {cron_name} is not RUNNING or SCHEDULED! Alert the on-call person***" in \
        output.read_text()
    while any(e.array_id == first for e in cron_jobs(installed.job_name)):  # status refreshes the page
        assert time.monotonic() < deadline, output.read_text()
        time.sleep(1)
    assert run.report.read_text().startswith("<!-- written by opskit report -->"), output.read_text()
    (pending,) = [e for e in cron_jobs(installed.job_name) if e.array_id != first]
    assert pending.state == "PENDING" and pending.reason == "(BeginTime)"
    begins = datetime.strptime(pending.start_time, "%Y-%m-%dT%H:%M:%S")
    assert timedelta(minutes=58) < begins - datetime.now() <= timedelta(hours=1)

    shown = subprocess.run([OPSKIT, "cron", "status", str(tmp_path / "spec.yaml")], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"cron: next run at {begins:%Y-%m-%d %H:%M:%S} (job {pending.job_id}, pending (BeginTime))" in shown.stdout

    removed = cron.uninstall(spec)
    assert f"SLURM job(s) {pending.job_id} ({installed.job_name})" in removed
    assert not cron_jobs(installed.job_name) and not list(run.cron_dir.glob("*.slurm"))
    assert cron.status(spec).lines == [f"cron: not installed for {cron_name} (`opskit cron install "
                                       f"{tmp_path / 'spec.yaml'}`)"]

    # A cron job that disappears (cancelled by an admin, a lost queue) is reported, with the fix.
    again = cron.install(spec, method="slurm")
    subprocess.run(["scancel", "--name", again.job_name], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while cron_jobs(again.job_name):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    shown = subprocess.run([OPSKIT, "cron", "status", str(tmp_path / "spec.yaml")], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 1
    assert f"cron: WARNING: the slurm cron of {cron_name} is gone, so the hourly checks no longer run" in shown.stdout
    cron.uninstall(spec)
    assert not list(run.cron_dir.glob("cron.*"))


@pytest.fixture
def user_crontab():
    """The user's crontab, restored after the test."""
    if shutil.which("crontab") is None:
        pytest.skip("no crontab here (apt-get install cron)")
    before = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    yield
    if before.returncode == 0:
        subprocess.run(["crontab", "-"], input=before.stdout, text=True, check=True)
    else:
        subprocess.run(["crontab", "-r"], capture_output=True)


def crontab_lines() -> list[str]:
    done = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    return done.stdout.splitlines() if done.returncode == 0 else []


@pytest.mark.usefixtures("slurm")  # the status its cron line runs asks squeue: SLURM must run whatever ran before
def test_cron_via_crontab_round_trip(tmp_path, user_crontab, monkeypatch):
    monkeypatch.chdir(tmp_path)
    foreign = "17 3 * * * /bin/true # somebody else's line"
    subprocess.run(["crontab", "-"], input="\n".join(crontab_lines() + [foreign]) + "\n", text=True, check=True)
    before = crontab_lines()
    name = f"opskit-crontab-{uuid.uuid4().hex[:8]}"
    spec = cron_spec(tmp_path, name, output=tmp_path / "run 100% $(touch PWNED)")
    installed = cron.install(spec, method="crontab", sync_to=f"file://{tmp_path}/share",
                             now=datetime(2026, 1, 1, 10, 7))
    assert crontab_lines() == before + [installed.crontab_line]
    assert installed.crontab_line.startswith("7 * * * * cd ") and "\\%" in installed.crontab_line
    with pytest.raises(cron.CronError, match=r"^cron is already installed for .*: `opskit cron uninstall .*` first$"):
        cron.install(spec, method="crontab")
    assert cron.status(spec, now=datetime(2026, 1, 1, 10, 30)).lines[-1] == \
        "cron: next run at 2026-01-01 11:07 (crontab, minute 7 of every hour)"

    # Run the line as cron would: /bin/sh, a bare environment, `\%` read as `%`.
    command = installed.crontab_line.split(" ", 5)[5].replace("\\%", "%")
    subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "/bin/sh", "-c", command], timeout=120, cwd="/")
    log = RunPaths.of(spec).cron_log.read_text()
    assert f"PULSE: ***ALERT: {name} is not RUNNING or SCHEDULED!" in log
    assert re.search(r"^file://.*: published \d+ file\(s\), \d+ unchanged$", log, re.M), log
    assert not list(tmp_path.glob("PWNED")) and not Path("/PWNED").exists()

    # Deleted by hand: status warns; uninstall removes only its own record, never another line.
    subprocess.run(["crontab", "-"], input="\n".join(before) + "\n", text=True, check=True)
    gone = cron.status(spec)
    assert not gone.ok and "cron: WARNING: the crontab cron of" in gone.lines[-1]
    assert cron.uninstall(spec) == [f"record {RunPaths.of(spec).cron_record}"]
    cron.install(spec, method="crontab")
    assert cron.uninstall(spec)[0].startswith("crontab line: ")
    assert crontab_lines() == before and foreign in before


def test_cron_script_is_safe_to_render(tmp_path, shellcheck):
    tag = uuid.uuid4().hex[:8]
    spec = cron_spec(tmp_path, f"it's a \"cron\" $(touch /tmp/pwned-{tag}) `id`",
                     output=tmp_path / "a b $(touch PWNED) it's")
    run = RunPaths.of(spec)
    script = tmp_path / "cron.slurm"
    script.write_text(cron.render_cron_script(spec, run, cron.hourly_commands(spec, "file:///x y/$(id)"), script))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    shellcheck(script, exclude=("SC2016",))  # the hostile name's literal `$(...)` in single quotes
    # sbatch reads the header with shell quoting: the name arrives intact (checked without submitting).
    assert f"#SBATCH --job-name='it'\"'\"'s a \"cron\" $(touch /tmp/pwned-{tag}) `id`-cron'\n" in script.read_text()
    assert os.access(script, os.R_OK) and not Path(f"/tmp/pwned-{tag}").exists()
