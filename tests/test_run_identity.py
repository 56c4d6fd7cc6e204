"""Which jobs are a run's, against the real local SLURM: two runs of one spec name (two directories, one SLURM job
name) never see or touch each other's jobs (status, submit's chaining and --keep, hold, release, cancel, cron), a
group member's job of the same run directory is the run's, and a job submitted before jobs carried the run's
comment is matched by its batch script's path."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec
from test_submit import OPSKIT

from opskit.slurm import client

pytestmark = pytest.mark.slurm


def cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def fake_data(folder: Path) -> SimpleNamespace:
    """What `opskit submit` checks of prepared data (the files exist): enough for jobs that never start."""
    for name in ("tokenizer/tokenizer.json", "kjv_text_document.bin", "kjv_text_document.idx"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()
    return SimpleNamespace(data_prefix=str(folder / "kjv_text_document"))


def twin_specs(tmp_path: Path, job_name: str, **slurm) -> tuple[str, str]:
    """Two spec files named tiny.yaml in two directories: same spec name and SLURM job name, two run directories."""
    data = fake_data(tmp_path / "data")
    paths = []
    for side in ("a", "b"):
        path = write_spec(tmp_path / side / "tiny.yaml", data, tmp_path / side / "run",
                          slurm={"job_name": job_name, "array": 2, **slurm})
        paths.append(str(path))
    return paths[0], paths[1]


def submitted(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"-> job (\d+)$", done.stdout, re.M).group(1)


def queue_of(name: str) -> dict[str, client.QueueEntry]:
    return {e.array_id: e for e in client.squeue() if e.name == name}


def dependency(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%E"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def held(entry: client.QueueEntry) -> bool:
    return entry.reason in ("(JobHeldUser)", "(JobHeldAdmin)")


def test_two_runs_of_one_spec_name_never_touch_each_other(tmp_path, cancel_after):
    name = f"opskit-twin-{uuid.uuid4().hex[:8]}"
    spec_a, spec_b = twin_specs(tmp_path, name)
    job_a = submitted(cli("submit", spec_a, "--begin", "now+1hour"))
    cancel_after.append(job_a)
    job_b = submitted(cli("submit", spec_b, "--begin", "now+1hour"))
    cancel_after.append(job_b)

    # Each run's first submission waits for nothing: the other run's job is not its own.
    assert set(queue_of(name)) == {job_a, job_b}
    assert dependency(job_b) == "(null)"
    # status: A sees its own job only.
    done = cli("status", spec_a, "--json")
    report = json.loads(done.stdout)
    assert [line.endswith(f"({job_a}_[1-2%1] on 'debug' partition)") for line in report["lines"]] == [True], \
        report["lines"]
    queue = [f for f in report["findings"] if f["key"] == "scheduler.queue"]
    assert queue and queue[0]["data"]["tasks"] == 2, report["findings"]

    # submit again: chained after A's own job only; --keep counts A's 2 tasks, not 4.
    dry = cli("submit", spec_a, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    script_a = Path(spec_a).parent / "run" / "slurm" / "train.slurm"
    assert dry.stdout.splitlines()[-1] == f"# would run: sbatch --parsable --array=1-2%1 " \
                                          f"--dependency=afterany:{job_a} {script_a}"
    assert "nothing submitted" not in cli("submit", spec_a, "--keep", "3", "--dry-run").stdout

    # hold / release / cancel act on A's jobs only.
    assert cli("hold", spec_a).stdout == f"held {name}: job(s) {job_a}\n"
    jobs = queue_of(name)
    assert held(jobs[job_a]) and not held(jobs[job_b])
    assert cli("release", spec_a).stdout == f"released {name}: job(s) {job_a}\n"
    assert cli("cancel", spec_b, "--yes").stdout == f"cancelled {name}: job(s) {job_b}\n"
    assert set(queue_of(name)) == {job_a}
    assert cli("cancel", spec_a, "--yes").stdout == f"cancelled {name}: job(s) {job_a}\n"


def sbatch_as(user: str, script: Path, *args: str) -> str:
    """Submit ``script`` as another user (root's ``sbatch --uid``), pending for an hour; returns the job id."""
    done = subprocess.run(["sbatch", "--parsable", f"--uid={user}", "--begin=now+1hour", *args, str(script)],
                          capture_output=True, text=True, timeout=30, cwd="/tmp")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_group_members_share_a_run_directory_not_a_job_name(tmp_path, cancel_after, monkeypatch):
    """slurm.group: a member's job for the same run directory is the run's (chained after, held, cancelled); another
    member's run of the same spec name in another directory is not."""
    if subprocess.run(["id", "nobody"], capture_output=True).returncode != 0:
        pytest.skip("no user 'nobody' to submit as")
    from opskit.monitor.watchdog import run_checks
    from opskit.run import chain
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec
    from opskit.submission.render import render_job
    from opskit.submission.submit import submit

    name = f"opskit-group-{uuid.uuid4().hex[:8]}"
    spec_a, spec_b = (load_spec(p) for p in twin_specs(tmp_path, name, group="trainers"))
    monkeypatch.setattr(chain, "group_users", lambda group: ["root", "nobody"])  # getent group trainers
    run_a, run_b = RunPaths.of(spec_a), RunPaths.of(spec_b)
    mine = submit(spec_a, begin="now+1hour").job_id
    cancel_after.append(mine)
    # The other member's jobs, from the scripts opskit renders for each run directory.
    scripts = {}
    for key, spec, run in (("same", spec_a, run_a), ("other", spec_b, run_b)):
        scripts[key] = tmp_path / f"{key}.slurm"
        scripts[key].write_text(render_job(spec, run).script)
    same, other = sbatch_as("nobody", scripts["same"]), sbatch_as("nobody", scripts["other"])
    cancel_after.extend([same, other])

    assert [e.array_id for e in chain.run_queue(run_a, name, "trainers").entries] == [mine, same]
    assert [e.array_id for e in chain.run_queue(run_b, name, "trainers").entries] == [other]
    dry = submit(spec_a, dry_run=True)
    assert dry.after == same and f"--dependency=afterany:{same}" in dry.command
    report = run_checks(spec_a)
    assert sorted(f.data["job_id"].split("_")[0] for f in report.findings if f.key == "scheduler.pending") == \
        [mine, same]

    assert chain.control(run_a, name, "trainers", "hold") == [mine, same]
    assert [held(e) for e in (queue_of(name)[j] for j in (mine, same, other))] == [True, True, False]
    assert chain.control(run_a, name, "trainers", "cancel") == [mine, same]
    assert set(queue_of(name)) == {other}


def test_jobs_submitted_before_comments_are_found_by_their_script(tmp_path, cancel_after):
    """A run directory of an earlier opskit (a rendered script, no marker) and its job without a comment: the job is
    the run's by name and batch script path; a same-name job of another directory's script, or of no script, is
    not. The next submission takes the directory and chains after the old job."""
    name = f"opskit-legacy-{uuid.uuid4().hex[:8]}"
    spec_a, spec_b = twin_specs(tmp_path, name)
    old_jobs = {}
    for key, spec in (("a", spec_a), ("b", spec_b)):
        dry = cli("submit", spec, "--dry-run")
        script = Path(spec).parent / "run" / "slurm" / "train.slurm"
        script.parent.mkdir(parents=True)
        lines = dry.stdout.split("# would run:")[0].splitlines(keepends=True)
        script.write_text("".join(line for line in lines if not line.startswith("#SBATCH --comment=")))
        (script.parents[1] / "logs").mkdir()
        (script.parents[1] / "logs" / "main_log.txt").write_text("[opskit] earlier chain\n")
        old_jobs[key] = submitted_sbatch(script)
        cancel_after.append(old_jobs[key])
    wrapped = submitted_sbatch(None, f"--job-name={name}", "--wrap=sleep 1")
    cancel_after.append(wrapped)
    assert {e.comment for e in queue_of(name).values()} == {""}

    done = cli("status", spec_a, "--json")
    lines = json.loads(done.stdout)["lines"]
    assert [line.endswith(f"({old_jobs['a']} on 'debug' partition)") for line in lines] == [True], lines
    run_a = Path(spec_a).parent / "run"
    new = cli("submit", spec_a, "--begin", "now+1hour")
    job = submitted(new)
    cancel_after.append(job)
    assert f"note: {run_a} holds a job script of an earlier opskit: taken as opskit's run directory" in new.stdout
    assert dependency(job) == f"afterany:{old_jobs['a']}(unfulfilled)"
    assert json.loads((run_a / ".opskit").read_text())["command"] == "submit"
    assert cli("cancel", spec_a, "--yes").stdout == f"cancelled {name}: job(s) {old_jobs['a']}, {job}\n"
    assert set(queue_of(name)) == {old_jobs["b"], wrapped}


def submitted_sbatch(script: Path | None, *args: str) -> str:
    """``sbatch`` as opskit did before comments: pending for an hour."""
    command = ["sbatch", "--parsable", "--begin=now+1hour", "--time=3", "-o", "/dev/null", *args]
    done = subprocess.run(command + ([str(script)] if script else []), capture_output=True, text=True, timeout=30,
                          cwd="/tmp")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def tree(root: Path) -> dict[str, tuple]:
    """Path -> (mode, size, mtime_ns) of everything under ``root``, ``root`` included."""
    return {str(p): (s.st_mode, s.st_size, s.st_mtime_ns) for p in [root, *root.rglob("*")] if (s := p.lstat())}


@pytest.mark.usefixtures("slurm")  # its cron jobs are sbatch-ed: SLURM must run whatever ran before
def test_two_runs_keep_their_own_cron_job(tmp_path, monkeypatch):
    name = f"opskit-twincron-{uuid.uuid4().hex[:8]}"
    spec_a, spec_b = twin_specs(tmp_path, name, cron_partition="debug")
    cron_name = f"{name}-cron"
    monkeypatch.chdir(tmp_path)
    try:
        for spec in (spec_a, spec_b):
            done = cli("cron", "install", spec, "--via", "slurm")
            assert done.returncode == 0, done.stdout + done.stderr
        # Each cron job runs at once, resubmits itself for an hour later, and ends.
        deadline = time.monotonic() + 120
        while not ((jobs := list(queue_of(cron_name).values())) and len(jobs) == 2
                   and all(e.reason == "(BeginTime)" for e in jobs)):
            assert time.monotonic() < deadline, jobs
            time.sleep(1)
        by_run = {e.comment: e.array_id for e in jobs}
        run_a, run_b = (Path(spec).parent / "run" for spec in (spec_a, spec_b))
        assert set(by_run) == {f"opskit-cron:{run_a}", f"opskit-cron:{run_b}"}
        job_a, job_b = by_run[f"opskit-cron:{run_a}"], by_run[f"opskit-cron:{run_b}"]

        shown = cli("cron", "status", spec_a)
        assert shown.returncode == 0, shown.stdout
        [line] = [line for line in shown.stdout.splitlines() if line.startswith("cron: next run")]
        assert line.endswith(f" (job {job_a}, pending (BeginTime))"), shown.stdout

        before = (tree(tmp_path), queue_of(cron_name))
        dry = cli("cron", "uninstall", spec_a, "--dry-run")
        assert dry.stdout.splitlines() == [f"would remove script {run_a}/cron/cron.slurm",
                                           f"would remove SLURM job(s) {job_a} ({cron_name})",
                                           f"would remove record {run_a}/cron/cron.json"], dry.stdout + dry.stderr
        assert (tree(tmp_path), queue_of(cron_name)) == before

        removed = cli("cron", "uninstall", spec_a)
        assert f"removed SLURM job(s) {job_a} ({cron_name})" in removed.stdout, removed.stdout + removed.stderr
        assert set(queue_of(cron_name)) == {job_b}
        assert cli("cron", "status", spec_b).returncode == 0
        assert f"removed SLURM job(s) {job_b} ({cron_name})" in cli("cron", "uninstall", spec_b).stdout
    finally:
        subprocess.run(["scancel", "--name", cron_name], capture_output=True, timeout=30)
