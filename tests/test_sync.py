"""opskit sync to a file:// target: incremental, atomic, nothing local deleted."""

from __future__ import annotations

import pytest
from torch.utils.tensorboard import SummaryWriter

from opskit.runs import RunPaths
from opskit.sync import SyncError, sync


@pytest.fixture
def run(tmp_path):
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text(" iteration        1/      10 | lm loss: 9.000000E+00 |\n")
    writer = SummaryWriter(log_dir=str(run.tensorboard))  # a real event file
    writer.add_scalar("lm-loss-training/lm loss", 9.0, 1)
    writer.close()
    (run.checkpoints / "global_step1").mkdir(parents=True)
    (run.checkpoints / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"not published")
    return run


def test_first_sync_copies_logs_and_events_only(run, tmp_path):
    target = tmp_path / "share"
    result = sync(run, ["logs", "tensorboard"], f"file://{target}")
    assert "logs/main_log.txt" in result.copied
    assert any(p.startswith("tensorboard/") and "tfevents" in p for p in result.copied)
    assert (target / "logs" / "main_log.txt").read_text() == run.main_log.read_text()
    assert not (target / "checkpoints").exists()
    assert not [p for p in target.rglob(".*") if p.is_file()], "temporary files left behind"


def test_unchanged_files_are_not_copied_again_and_grown_log_is(run, tmp_path):
    url = f"file://{tmp_path / 'share'}"
    sync(run, ["logs", "tensorboard"], url)
    again = sync(run, ["logs", "tensorboard"], url)
    assert again.copied == [] and again.unchanged == 2
    with open(run.main_log, "a") as f:
        f.write(" iteration        2/      10 | lm loss: 8.000000E+00 |\n")
    grown = sync(run, ["logs", "tensorboard"], url)
    assert grown.copied == ["logs/main_log.txt"]
    assert (tmp_path / "share" / "logs" / "main_log.txt").read_text().count("iteration") == 2


def test_dry_run_copies_nothing(run, tmp_path):
    result = sync(run, ["logs"], f"file://{tmp_path / 'share'}", dry_run=True)
    assert result.copied == ["logs/main_log.txt"]
    assert not (tmp_path / "share").exists()


@pytest.mark.parametrize("url", ["gs://bucket/prefix", "file://relative/path", "/no/scheme"])
def test_unsupported_targets_are_refused_in_one_line(run, url):
    with pytest.raises(SyncError, match=r"expected file:///absolute/path") as e:
        sync(run, ["logs"], url)
    assert "\n" not in str(e.value)


def test_unknown_kind_is_refused(run, tmp_path):
    with pytest.raises(SyncError, match="expected one of logs, tensorboard"):
        sync(run, ["checkpoints"], f"file://{tmp_path}")
