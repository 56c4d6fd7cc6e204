"""Every ``--dry-run`` changes nothing: the run directory (or target) compared byte for byte, with modes and mtimes,
before and after, and the queue too (submit, cron install/uninstall, sync, ckpt prune). And submit and cron install
write only where opskit may: a ``paths.output`` opskit did not create is refused, a user's ``cron/cron.slurm`` or
crontab line is never replaced or removed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import queued, write_spec
from test_cron import crontab_lines, user_crontab  # noqa: F401  (a fixture)
from test_run_identity import cli, fake_data, queue_of, submitted

from opskit.fsutil import write_marker


@pytest.fixture
def job_name(slurm):
    """A unique SLURM job name; whatever ran under it (or its ``-cron``) is cancelled at the end."""
    name = f"opskit-dry-{uuid.uuid4().hex[:8]}"
    yield name
    for each in (name, f"{name}-cron"):
        subprocess.run(["scancel", "--name", each], capture_output=True, timeout=30)


def tree(*roots: Path) -> dict[str, tuple | None]:
    """Path -> (type, mode, size, mtime_ns, sha256 or link target) of everything under ``roots`` (themselves
    included; None for a missing root)."""
    state: dict[str, tuple | None] = {}
    for root in roots:
        if not root.exists() and not root.is_symlink():
            state[str(root)] = None
            continue
        for path in [root, *sorted(root.rglob("*"))]:
            s = path.lstat()
            content = os.readlink(path) if path.is_symlink() else \
                hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            state[str(path)] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_size, s.st_mtime_ns, content)
    return state


def spec_at(tmp_path: Path, job_name: str, output: Path | None = None, **slurm) -> str:
    data = fake_data(tmp_path / "data")
    return str(write_spec(tmp_path / "spec.yaml", data, output or tmp_path / "run",
                          slurm={"job_name": job_name, "array": 2, "cron_partition": "debug", **slurm}))


def last_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()[-1]


# --------------------------------------------------------------------------- --dry-run


@pytest.mark.slurm
def test_submit_dry_run_writes_and_submits_nothing(tmp_path, job_name):
    name = job_name
    spec = spec_at(tmp_path, name)
    run = tmp_path / "run"
    before = tree(tmp_path)
    for executor in ("slurm", "local"):
        done = cli("submit", spec, "--dry-run", "--executor", executor)
        assert done.stdout.startswith("#!/bin/bash\n"), done.stdout + done.stderr
        assert done.returncode == 0
    assert last_line(cli("submit", spec, "--dry-run")) == \
        f"# would run: sbatch --parsable --array=1-2%1 {run / 'slurm' / 'train.slurm'}"
    assert tree(tmp_path) == before and not run.exists()  # not even the run directory
    assert queue_of(name) == {}

    # A run with a queued chain, a finished flag and a bad node: dry runs with every option change none of it.
    job = submitted(cli("submit", spec, "--begin", "now+1hour"))
    queued(name, lambda entries: [e.reason for e in entries] == ["(BeginTime)"])  # settled: nothing changes now
    (run / "finished").write_text("2026-11-21 09:00:00 training finished at iteration 50\n")
    (run / "bad-nodes.txt").write_text("r7i5n2\tcrashed\n")
    before, queue = tree(tmp_path), queue_of(name)
    outputs = []
    for args in (["--array", "3", "--nodes", "2", "--after", "1"], ["--keep", "1"], ["--executor", "local"]):
        done = cli("submit", spec, "--dry-run", "--yes", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"# note: would remove {run / 'finished'} (the training finished) as --yes asks" in done.stdout
        outputs.append(done.stdout)
    assert "\n#SBATCH --exclude=r7i5n2\n" in outputs[0]
    assert outputs[0].endswith(f"# would run: sbatch --parsable --array=1-3%1 --dependency=afterany:{job}:1 "
                               f"{run / 'slurm' / 'train.slurm'}\n")
    assert outputs[1].endswith(f"2 task(s) of {name} running or pending (--keep 1): nothing submitted\n")
    assert outputs[2].endswith(f"# would run: bash {run / 'slurm' / 'train.slurm'}\n")
    assert (tree(tmp_path), queue_of(name)) == (before, queue)


@pytest.mark.slurm
def test_cron_dry_runs_write_and_submit_nothing(tmp_path, job_name, user_crontab, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    name = job_name
    spec = spec_at(tmp_path, name)
    run = tmp_path / "run"
    before, crontab = tree(tmp_path), crontab_lines()
    done = cli("cron", "install", spec, "--via", "slurm", "--dry-run")
    assert done.stdout.startswith("#!/bin/bash\n") and f"\n#SBATCH --job-name={name}-cron\n" in done.stdout
    assert last_line(done) == f"# would write {run}/cron/cron.slurm and run: sbatch --parsable {run}/cron/cron.slurm"
    line = last_line(cli("cron", "install", spec, "--via", "crontab", "--dry-run"))
    assert re.fullmatch(rf"# would add to the crontab: \d+ \* \* \* \* cd .* >> {run}/cron/cron.log 2>&1 # opskit "
                        r"cron [0-9a-f]{12}", line), line
    assert (tree(tmp_path), crontab_lines(), queue_of(f"{name}-cron")) == (before, crontab, {})

    installed = cli("cron", "install", spec, "--via", "crontab")
    assert installed.returncode == 0, installed.stderr
    before, crontab = tree(tmp_path), crontab_lines()
    dry = cli("cron", "uninstall", spec, "--dry-run")
    assert dry.stdout.splitlines() == [f"would remove crontab line: {crontab[-1]}",
                                       f"would remove record {run}/cron/cron.json"], dry.stdout + dry.stderr
    assert (tree(tmp_path), crontab_lines()) == (before, crontab)
    assert cli("cron", "uninstall", spec).returncode == 0 and crontab_lines() == crontab[:-1]


def test_sync_dry_run_writes_nothing(tmp_path):
    spec = spec_at(tmp_path, "opskit-drysync")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "main_log.txt").write_text(" iteration        1/      10 | lm loss: 9.000000E+00 |\n")
    target = tmp_path / "share"
    before = tree(run, target)
    done = cli("sync", "logs", spec, "--to", f"file://{target}", "--dry-run")
    assert done.stdout.startswith(f"file://{target}: would publish 1 file(s), 0 unchanged\n"), done.stdout + done.stderr
    assert tree(run, target) == before


def test_ckpt_prune_dry_run_changes_nothing(tmp_path):
    import torch
    from megatron_ckpt import build_checkpoint

    checkpoints = tmp_path / "checkpoints"
    for step in (100, 200, 300):  # complete steps: prune never deletes an incomplete one newer than them
        build_checkpoint(checkpoints, arch="gpt2", tp=1, layers=1, hidden=32, iteration=step, dtype=torch.float16)
    before = tree(checkpoints)
    done = cli("ckpt", "prune", str(checkpoints), "--keep", "last:1", "--force", "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "would delete global_step100" in done.stdout and "would delete global_step200" in done.stdout
    assert tree(checkpoints) == before


# --------------------------------------------------------------------------- what opskit may write


@pytest.mark.slurm
def test_submit_writes_only_into_a_run_directory_of_its_own(tmp_path, job_name):
    name = job_name
    users = tmp_path / "my results"
    users.mkdir(mode=0o700)
    (users / "notes.txt").write_text("mine\n")
    spec = spec_at(tmp_path, name, output=users)
    before = tree(users)
    refusal = (f"{users}: paths.output exists and holds files opskit did not write (no .opskit marker, no job script "
               "rendered by opskit); choose another paths.output (opskit writes runs only into folders it created)")
    for args in ((), ("--executor", "local")):
        done = cli("submit", spec, *args)
        assert (done.returncode, done.stdout) == (1, ""), done.stdout + done.stderr
        assert done.stderr == f"error: {refusal}\n"
    dry = cli("submit", spec, "--dry-run")  # the script, and the refusal as a warning
    assert dry.returncode == 0 and dry.stdout.startswith("#!/bin/bash\n"), dry.stdout + dry.stderr
    assert dry.stdout.endswith(f"# warning: {refusal}\n")
    refused = cli("cron", "install", spec, "--via", "slurm")
    assert refused.returncode == 1 and refused.stderr.startswith(f"error: {users}: paths.output exists and holds")
    assert tree(users) == before and queue_of(name) == {}

    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    done = cli("submit", spec_at(tmp_path, name, output=a_file))
    assert done.stderr == f"error: {tmp_path / 'spec.yaml'}: paths.output: {a_file} is a file, not a folder\n"

    # An empty folder is taken (its mode kept) and marked; submitting again continues the run, no --force.
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o750)
    spec = spec_at(tmp_path, name, output=empty)
    first = submitted(cli("submit", spec, "--begin", "now+1hour"))
    assert json.loads((empty / ".opskit").read_text())["command"] == "submit"
    assert stat.S_IMODE(empty.stat().st_mode) == 0o750
    again = cli("submit", spec, "--begin", "now+1hour")
    assert submitted(again) != first
    assert f"the new array waits for them (--dependency=afterany:{first})" in again.stdout


@pytest.mark.slurm
def test_cron_install_never_replaces_a_users_script_or_crontab_line(tmp_path, job_name, user_crontab,  # noqa: F811
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = job_name
    spec = spec_at(tmp_path, name)
    run = tmp_path / "run"
    run.mkdir()
    write_marker(run, "submit")
    (run / "cron").mkdir()
    (run / "cron" / "cron.slurm").write_text("#!/bin/bash\n# my own hourly job\n")
    before = tree(run)
    for args in ((), ("--dry-run",)):
        done = cli("cron", "install", spec, "--via", "slurm", *args)
        assert done.stderr == (f"error: {run}/cron/cron.slurm: exists and was not written by opskit; choose another "
                               "paths.output (opskit never replaces what it did not write)\n"), done.stderr
    assert tree(run) == before and queue_of(f"{name}-cron") == {}

    # A crontab line of this run with no record (cron.json lost): refused, not doubled.
    (run / "cron" / "cron.slurm").unlink()
    installed = cli("cron", "install", spec, "--via", "crontab")
    assert installed.returncode == 0, installed.stderr
    line = crontab_lines()[-1]
    (run / "cron" / "cron.json").rename(tmp_path / "cron.json")
    refused = cli("cron", "install", spec, "--via", "crontab")
    assert refused.returncode == 1 and "the crontab already has a line of this run" in refused.stderr
    assert crontab_lines().count(line) == 1
    # The user copied the line: uninstall removes opskit's, not the copy.
    (tmp_path / "cron.json").rename(run / "cron" / "cron.json")
    subprocess.run(["crontab", "-"], input="\n".join(crontab_lines() + [line]) + "\n", text=True, check=True)
    assert cli("cron", "uninstall", spec).returncode == 0
    assert crontab_lines().count(line) == 1
