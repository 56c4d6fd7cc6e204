"""opskit.monitor.pulse against the real local SLURM: BigScience's PULSE / ALERT lines for running, array-throttled,
dependent and --begin jobs; exit codes of `opskit status` (2: SLURM unreachable or failing); a broken scheduler
(fake squeue) is 'unreachable'."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import as_run, queued, running, unique, write_spec

from opskit.monitor.pulse import Pulse, check, wait_until_gone
from opskit.slurm import client

pytestmark = pytest.mark.slurm

OPSKIT = str(Path(sys.executable).with_name("opskit"))
PULSE = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] PULSE: "
NOW_TOLERANCE_S = 120


def assert_stamp_is_now(line: str) -> None:
    stamp = datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S")
    assert abs((datetime.now() - stamp).total_seconds()) < NOW_TOLERANCE_S, line


def status_cli(spec_name: str, *args: str, path: str | None = None, cwd: Path | None = None):
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([OPSKIT, "status", spec_name, *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=cwd)


def spec_for(tmp_path: Path, job_name: str) -> Path:
    """A spec whose SLURM job name is ``job_name`` (status needs no data), its run directory created as ``opskit
    submit`` would (status alerts with exit 2 on a run directory it cannot see)."""
    fake_data = SimpleNamespace(data_prefix=tmp_path / "data" / "kjv_text_document")
    (tmp_path / "run").mkdir(exist_ok=True)
    return write_spec(tmp_path / "watched.yaml", fake_data, tmp_path / "run", slurm={"job_name": job_name})


# --------------------------------------------------------------------------- PULSE lines from the real scheduler


def test_running_job(jobs, tmp_path):
    name = unique("opskit-status run|x")  # a space and a '|' in the name: squeue's columns must still split right
    job_id = jobs(name, as_run(tmp_path / "run"))
    queued(name, running)
    pulse = check(name)
    assert pulse == Pulse(pulse.lines, alert=False, unreachable=False)
    [line] = pulse.lines
    assert re.fullmatch(
        PULSE + re.escape(name) + r" is running for \d+:\d\d since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d "
        + re.escape(f"({job_id} on 'debug' partition (localhost)"), line), line
    assert_stamp_is_now(line)

    # The CLI: same line, exit 0; --json carries it too.
    spec = spec_for(tmp_path, name)
    done = status_cli(str(spec))
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(PULSE + re.escape(name) + r" is running for .*\(localhost\)", done.stdout.splitlines()[0]), \
        done.stdout
    done = status_cli(str(spec), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["job_name"] == name and data["alert"] is False and data["unreachable"] is False
    assert len(data["lines"]) == 1 and " is running for " in data["lines"][0]


def test_job_name_must_match_exactly(jobs):
    name = unique("opskit-exact")
    jobs(name + "-longer")
    queued(name + "-longer", lambda entries: bool(entries))
    pulse = check(name)  # a job whose name merely starts with ours is not ours
    assert pulse.alert


def test_array_task_waiting_on_the_task_limit(jobs):
    name = unique("opskit-array")
    job_id = jobs(name, "--array=1-2%1")
    entries = queued(name, lambda es: running(es) and any(e.reason == "(JobArrayTaskLimit)" for e in es))
    pulse = check(name)
    assert not pulse.alert and len(pulse.lines) == len(entries) == 2
    waiting = next(line for line in pulse.lines if "_2 " in line)
    assert re.fullmatch(
        PULSE + re.escape(f"{name} is waiting for the previous Job Array job to finish before scheduling a new one "
                          f"({job_id}_2 on 'debug' partition)"), waiting), waiting
    started = next(line for line in pulse.lines if line is not waiting)
    assert " is running for " in started and f"({job_id}_1 on 'debug' partition (localhost)" in started


def test_job_pending_on_a_dependency(jobs):
    first = unique("opskit-first")
    first_id = jobs(first)
    queued(first, running)
    name = unique("opskit-dep")
    job_id = jobs(name, f"--dependency=afterany:{first_id}")
    queued(name, lambda es: any(e.reason == "(Dependency)" for e in es))
    [line] = check(name).lines
    assert re.fullmatch(
        PULSE + re.escape(f"{name} is waiting for the previous job to finish before scheduling a new one using the "
                          f"dependency mechanism ({job_id} on 'debug' partition)"), line), line


def test_job_scheduled_to_begin_later(jobs):
    name = unique("opskit-begin")
    job_id = jobs(name, "--begin=now+1hour")
    [entry] = queued(name, lambda es: any(e.reason == "(BeginTime)" for e in es))
    [line] = check(name).lines
    match = re.fullmatch(
        PULSE + re.escape(name) + r" is scheduled to start in (0:59:\d\d|1:00:00) \(at (\S+)\) "
        + re.escape(f"({job_id} on 'debug' partition)"), line)
    assert match, line
    assert match.group(2) == entry.start_time
    begin = datetime.strptime(entry.start_time, "%Y-%m-%dT%H:%M:%S")
    assert 3500 < (begin - datetime.now()).total_seconds() <= 3600


def test_alert_when_absent(slurm, tmp_path):
    name = unique("opskit-absent")
    pulse = check(name)
    assert pulse.alert and not pulse.unreachable
    [line] = pulse.lines
    assert re.fullmatch(PULSE + re.escape(f"***ALERT: {name} is not RUNNING or SCHEDULED! ") + r"[^*]+\*\*\*", line)
    assert_stamp_is_now(line)

    done = status_cli(str(spec_for(tmp_path, name)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.fullmatch(PULSE + re.escape(f"***ALERT: {name} is not RUNNING or SCHEDULED! ") + r".*\*\*\*",
                        done.stdout.splitlines()[0]), done.stdout
    assert done.stderr == ""


# --------------------------------------------------------------------------- a broken scheduler


def fake_squeue(folder: Path, body: str) -> str:
    """A PATH whose first entry holds a fake ``squeue`` running ``body``; the rest of PATH stays usable."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "squeue"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_controller_down_is_unreachable_not_alert(tmp_path, monkeypatch):
    path = fake_squeue(tmp_path / "bin", 'echo "squeue: error: Unable to contact slurm controller (connect failure)"'
                                         ' >&2; exit 1')
    monkeypatch.setenv("PATH", path)
    name = unique("opskit-down")
    pulse = check(name)
    assert pulse.unreachable and not pulse.alert
    [line] = pulse.lines
    assert re.fullmatch(PULSE + re.escape(f"{name}: scheduler unreachable, job state unknown (") + r".*\)", line)
    assert "Unable to contact slurm controller" in line and "ALERT" not in line

    done = status_cli(str(spec_for(tmp_path, name)), path=path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "scheduler unreachable" in done.stdout and "ALERT" not in done.stdout
    assert "Traceback" not in done.stderr


def test_hanging_squeue_times_out_as_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_squeue(tmp_path / "bin", "sleep 30"))
    monkeypatch.setattr(client, "_run", functools.partial(client._run, timeout=1))
    started = time.monotonic()
    pulse = check(unique("opskit-slow"))
    assert time.monotonic() - started < 10
    assert pulse.unreachable and not pulse.alert
    assert "no answer within 1 s" in pulse.lines[0]


def test_missing_squeue_is_unreachable(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    done = status_cli(str(spec_for(tmp_path, unique("opskit-nosl"))), path=str(empty))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "squeue: command not found" in done.stdout


def test_other_squeue_failure_is_an_error_not_unreachable(tmp_path, monkeypatch):
    path = fake_squeue(tmp_path / "bin", 'echo "squeue: error: Invalid user: nobody42" >&2; exit 1')
    done = status_cli(str(spec_for(tmp_path, unique("opskit-err"))), path=path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: squeue -h -o")
    assert "Invalid user: nobody42" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_wait_until_gone_keeps_waiting_while_unreachable(tmp_path, monkeypatch):
    # A controller that does not answer must not read as "the chain has ended".
    monkeypatch.setenv("PATH", fake_squeue(tmp_path / "bin", 'echo "Connection refused" >&2; exit 1'))
    pulses = []
    started = time.monotonic()
    assert wait_until_gone("opskit-any", "123", pulses.append, interval_s=0.1, timeout_s=1) is False
    assert 1 <= time.monotonic() - started < 5
    assert pulses == []


def test_wait_until_gone_reports_changes_and_the_end(jobs):
    name = unique("opskit-gone")
    job_id = jobs(name, "--array=1-2%1", wrap="sleep 1")
    pulses: list[Pulse] = []
    assert wait_until_gone(name, job_id, pulses.append, interval_s=0.2, timeout_s=60) is True
    assert not [e for e in client.squeue() if e.array_id == job_id]
    lines = [line for p in pulses for line in p.lines]
    assert any(f"({job_id}_2 on 'debug' partition)" in line and "previous Job Array job" in line for line in lines)
    # One pulse per change of a task's state or reason (~15 polls over the ~3 s the array takes): at most
    # [1-2%1] pending, then 1 running + 2 throttled, then 2 running (+ COMPLETING states).
    assert 1 <= len(pulses) <= 6, lines


NO_CONFIG = ("squeue: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
             "squeue: error: fetch_config: DNS SRV lookup failed\n"
             "squeue: error: _establish_config_source: failed to fetch config\n"
             "squeue: fatal: Could not establish a configuration source")


def test_a_machine_without_a_slurm_conf_is_unreachable_and_a_dry_run_goes_on(tmp_path, monkeypatch):
    """squeue's words on a machine with no slurm.conf (a fresh CI machine before the local SLURM starts): the
    scheduler is unreachable, not a failed command, so a dry run still renders the job (with a note)."""
    monkeypatch.setenv("PATH", fake_squeue(tmp_path / "bin", f"printf '{NO_CONFIG}\\n' >&2; exit 1"))
    with pytest.raises(client.SchedulerUnreachable, match="Could not establish a configuration source"):
        client.squeue()
    done = subprocess.run([str(Path(sys.executable).with_name("opskit")), "submit", "tiny", "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("#!/bin/bash\n"), done.stderr
    assert "SLURM did not answer" in done.stdout + done.stderr
