"""opskit sync to a file:// target: incremental manifest, snapshots, lock, --delete, the CLI with spec targets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from opskit.run.paths import RunPaths
from opskit.targets.base import TargetError
from opskit.upkeep.sync import SyncBusy, SyncError, sync

KINDS = ["logs", "tensorboard", "codecarbon"]


@pytest.fixture
def run(tmp_path):
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text(" iteration        1/      10 | lm loss: 9.000000E+00 |\n")
    writer = SummaryWriter(log_dir=str(run.tensorboard))  # a real event file
    writer.add_scalar("lm-loss-training/lm loss", 9.0, 1)
    writer.close()
    run.codecarbon.mkdir()
    (run.codecarbon / "emissions-0.csv").write_text("timestamp,duration,emissions\n2026-11-21T09:00:00,3600,0.01\n")
    (run.checkpoints / "global_step1").mkdir(parents=True)
    (run.checkpoints / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"not published")
    return run


def test_first_sync_copies_logs_events_and_emissions_only(run, tmp_path):
    target = tmp_path / "share"
    result = sync(run, KINDS, f"file://{target}")
    assert "logs/main_log.txt" in result.copied and "codecarbon/emissions-0.csv" in result.copied
    assert any(p.startswith("tensorboard/") and "tfevents" in p for p in result.copied)
    assert (target / "logs" / "main_log.txt").read_text() == run.main_log.read_text()
    assert not (target / "checkpoints").exists()
    assert not [p for p in target.rglob(".*") if p.is_file()], "temporary files left behind"
    assert not list(run.root.glob(".sync-snapshot-*")), "snapshot folder left behind"


def test_unchanged_files_are_not_copied_again_and_grown_log_is(run, tmp_path):
    url = f"file://{tmp_path / 'share'}"
    sync(run, KINDS, url)
    again = sync(run, KINDS, url)
    assert again.copied == [] and again.unchanged == 3
    with open(run.main_log, "a") as f:
        f.write(" iteration        2/      10 | lm loss: 8.000000E+00 |\n")
    grown = sync(run, KINDS, url)
    assert grown.copied == ["logs/main_log.txt"]
    assert (tmp_path / "share" / "logs" / "main_log.txt").read_text().count("iteration") == 2
    manifest = json.loads(run.sync_manifest(url).read_text())
    assert manifest["logs/main_log.txt"]["size"] == run.main_log.stat().st_size
    assert set(manifest["logs/main_log.txt"]) == {"size", "mtime_ns", "crc32c"}


def test_a_touched_file_with_the_same_bytes_is_hashed_not_sent(run, tmp_path):
    url = f"file://{tmp_path / 'share'}"
    sync(run, KINDS, url)
    os.utime(run.main_log, ns=(1, 1))
    result = sync(run, KINDS, url)
    assert result.copied == [] and result.unchanged == 3
    assert sync(run, KINDS, url).unchanged == 3  # the new mtime is remembered


def test_a_file_that_changes_while_read_is_left_for_the_next_sync(run, tmp_path, monkeypatch):
    url = f"file://{tmp_path / 'share'}"
    real_copy = shutil.copyfile

    def copy_while_the_trainer_appends(src, dst, **kwargs):
        result = real_copy(src, dst, **kwargs)
        if str(src).endswith("main_log.txt"):
            with open(src, "a") as f:
                f.write(" iteration        2/      10 | lm loss: 8.5")  # a line still being written
        return result

    monkeypatch.setattr(shutil, "copyfile", copy_while_the_trainer_appends)
    first = sync(run, KINDS, url)
    assert first.deferred == ["logs/main_log.txt"] and "logs/main_log.txt" not in first.copied
    assert not (tmp_path / "share" / "logs" / "main_log.txt").exists()
    monkeypatch.setattr(shutil, "copyfile", real_copy)
    second = sync(run, KINDS, url)
    assert second.copied == ["logs/main_log.txt"]
    assert (tmp_path / "share" / "logs" / "main_log.txt").read_text() == run.main_log.read_text()


def test_dry_run_copies_nothing(run, tmp_path):
    result = sync(run, ["logs"], f"file://{tmp_path / 'share'}", dry_run=True)
    assert result.copied == ["logs/main_log.txt"]
    assert not (tmp_path / "share").exists()


@pytest.mark.parametrize("url", ["gs://", "file://relative/path", "/no/scheme", "hf://only-org", "s3://b/k"])
def test_malformed_targets_are_refused_in_one_line(run, url):
    with pytest.raises(TargetError, match=r"expected file:///absolute/path, gs://bucket/prefix or hf://") as e:
        sync(run, ["logs"], url)
    assert "\n" not in str(e.value)


def test_unknown_kind_is_refused(run, tmp_path):
    with pytest.raises(SyncError, match="expected one of logs, tensorboard, codecarbon or all"):
        sync(run, ["checkpoints"], f"file://{tmp_path}")


def test_a_live_lock_makes_the_next_sync_skip_and_a_dead_ones_is_taken_over(run, tmp_path):
    url = f"file://{tmp_path / 'share'}"
    lock = run.sync_lock(url)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{{os.getpid()}}\\n".encode())
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SyncBusy, match=rf"another sync to {url} is still running \(PID {holder.pid}, lock "):
            sync(run, KINDS, url)
        assert not (tmp_path / "share").exists()
    finally:
        holder.kill()
        holder.wait()
    assert lock.read_text() == f"{holder.pid}\n"  # the dead holder's PID is still in the file...
    assert len(sync(run, KINDS, url).copied) == 3  # ...and its lock is free


def test_without_flock_a_pid_file_locks_and_a_dead_pid_is_taken_over(run, tmp_path, monkeypatch):
    import errno
    import fcntl
    import socket

    def no_flock(fd, operation):  # what a Lustre mount without -o flock answers
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    url = f"file://{tmp_path / 'share'}"
    pid_file = run.sync_lock(url).with_name(run.sync_lock(url).name + ".pid")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pid_file.write_text(f"{socket.gethostname()} {sleeper.pid}\n")
        with pytest.raises(SyncBusy, match=rf"\(PID {sleeper.pid} on "):
            sync(run, KINDS, url)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(sync(run, KINDS, url).copied) == 3  # dead holder: taken over
    assert not pid_file.exists()  # and released


def test_remote_deletions_are_listed_by_a_dry_run_that_writes_nothing(run, tmp_path):
    url, share = f"file://{tmp_path / 'share'}", tmp_path / "share"
    (run.logs / "old_log.txt").write_text("from a previous layout\n")
    sync(run, KINDS, url)
    (run.logs / "old_log.txt").unlink()
    (share / "README.md").write_text("not ours\n")
    before = sorted(p.name for p in run.root.iterdir())
    listed = sync(run, KINDS, url, delete=True, dry_run=True)
    assert listed.deleted == ["logs/old_log.txt"] and (share / "logs" / "old_log.txt").exists()
    assert sorted(p.name for p in run.root.iterdir()) == before
    done = sync(run, KINDS, url, delete=True)
    assert done.deleted == ["logs/old_log.txt"]
    assert not (share / "logs" / "old_log.txt").exists() and (share / "README.md").exists()
    assert run.main_log.exists()


def test_cli_syncs_to_the_spec_targets_and_reports_json(run, tmp_path, kjv_data):
    from conftest import write_spec

    share = tmp_path / "share"
    spec = write_spec(tmp_path / "trainings" / "t.yaml", kjv_data, run.root, sync={"targets": [f"file://{share}"]})
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "opskit.cli.app", "sync", "all", str(spec), "--json"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    [report] = json.loads(done.stdout)
    assert report["target"] == f"file://{share}" and len(report["copied"]) == 3 and report["failed"] == {}
    again = subprocess.run([sys.executable, "-m", "opskit.cli.app", "sync", "logs", str(spec)], capture_output=True,
                           text=True, env=env)
    assert again.stdout == f"file://{share}: published 0 file(s), 1 unchanged\n"

    from opskit.spec.load import load_spec
    from opskit.upkeep.cron import hourly_commands

    hourly = hourly_commands(load_spec(str(spec)), sync_to=None)
    assert hourly[-1].endswith(f" sync all {load_spec(str(spec)).cli_name}")  # the spec's targets, no --to

    bad = write_spec(tmp_path / "trainings" / "bad.yaml", kjv_data, run.root, sync={"targets": ["s3://x/y"]})
    refused = subprocess.run([sys.executable, "-m", "opskit.cli.app", "sync", "all", str(bad)], capture_output=True,
                             text=True, env=env)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    assert "sync.targets" in refused.stderr and "target s3://x/y: expected file:///absolute/path" in refused.stderr


def test_a_specs_targets_sync_in_turn_and_a_busy_one_is_skipped(run, tmp_path, kjv_data):
    import fcntl

    from conftest import write_spec

    from opskit.spec.load import load_spec
    from opskit.upkeep.sync import sync_spec

    busy_url, free_url = f"file://{tmp_path / 'busy'}", f"file://{tmp_path / 'free'}"
    spec = load_spec(str(write_spec(tmp_path / "trainings" / "t.yaml", kjv_data, run.root,
                                    sync={"targets": [busy_url, free_url]})))
    fd = os.open(run.sync_lock(busy_url), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another sync to the first target is running
    try:
        skipped: list[SyncBusy] = []
        results = list(sync_spec(spec, KINDS, on_busy=skipped.append))
    finally:
        os.close(fd)
    assert [r.target for r in results] == [free_url] and len(results[0].copied) == 3  # the next target went on
    assert len(skipped) == 1 and f"another sync to {busy_url} is still running" in str(skipped[0])
    assert not (tmp_path / "busy").exists()
    [only] = sync_spec(spec, ["logs"], to=busy_url, dry_run=True)  # --to replaces the spec's targets
    assert only.target == busy_url and only.copied == ["logs/main_log.txt"]
    nowhere = load_spec(str(write_spec(tmp_path / "trainings" / "n.yaml", kjv_data, run.root)))
    with pytest.raises(SyncError, match=r": no sync target: give --to URL or set sync.targets in the spec$"):
        list(sync_spec(nowhere, KINDS))
