"""Pending reasons that never clear (opskit.slurm.pending): the rule on squeue's own strings, the grace a wait gives
them, and `opskit submit --wait` stopping on one in one line. A fake squeue throughout: no SLURM."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec
from typer.testing import CliRunner

from opskit.cli.app import app
from opskit.monitor.pulse import wait_until_gone
from opskit.run.paths import RunPaths
from opskit.slurm.client import QueueEntry
from opskit.slurm.pending import HopelessWatch, PendingForever, hopeless_reason
from opskit.submission.submit import Submission


def pending(reason: str, job_id: str = "77_[1-2%1]", name: str = "opskit-pf") -> QueueEntry:
    return QueueEntry(job_id, "debug", name, "PENDING", "0:00", "1", "N/A", reason, "2026-11-21T09:14:27", "20:00:00")


@pytest.mark.parametrize("reason", ["(Resources)", "(Priority)", "(Dependency)", "(JobArrayTaskLimit)",
                                    "(BeginTime)", "(AssocMaxJobsLimit)", "(QOSGrpNodeLimit)", "(JobHeldUser)",
                                    "(QOSMaxJobsPerUserLimit)", "(AssocGrpCPUMinutesLimit)",
                                    "(ReqNodeNotAvail, Reserved for maintenance)", "(ReqNodeNotAvail, "
                                    "UnavailableNodes:)", "(None)", "localhost", "node[1-2]", ""])
def test_reasons_that_clear_by_themselves_are_not_hopeless(reason):
    assert hopeless_reason(reason) is None


def test_hopeless_reasons_say_why_and_the_fix_in_one_line():
    line = hopeless_reason("(PartitionConfig)", "tr11")
    assert line.startswith("PartitionConfig: the job asks more than its partition allows or its nodes have (CPUs "
                           "per task, memory, GPUs, nodes); lower slurm.cpus_per_task, slurm.gres or parallel.nodes")
    assert line.endswith(", then `opskit cancel tr11` and `opskit submit tr11`") and "\n" not in line
    assert hopeless_reason("(ReqNodeNotAvail, UnavailableNodes:node9)", "tr11") == (
        "ReqNodeNotAvail: nodes it needs are DOWN, DRAINED or not responding (node9; `sinfo -R -n node9` says why); "
        "ask the admins to return them, or `opskit nodes add tr11 node9`, then `opskit cancel tr11` and "
        "`opskit submit tr11`")
    assert "node[3-4,7]" in hopeless_reason("(ReqNodeNotAvail, UnavailableNodes:node[3-4,7])")
    for code, said in [("PartitionNodeLimit", "parallel.nodes"), ("PartitionTimeLimit", "slurm.time"),
                       ("PartitionDown", "DOWN"), ("PartitionInactive", "INACTIVE"),
                       ("BadConstraints", "slurm.constraint"), ("InvalidAccount", "slurm.account"),
                       ("AccountNotAllowed", "slurm.account"), ("InvalidQOS", "slurm.qos"),
                       ("QOSMaxWallDurationPerJobLimit", "slurm.time"), ("AssocMaxGRESPerJob", "slurm.gres")]:
        line = hopeless_reason(f"({code})")
        assert line.startswith(f"{code}: ") and said in line and "\n" not in line, line
    assert hopeless_reason("PartitionConfig", then="then rehearse again").endswith(
        "slurm.partition, then rehearse again")  # without squeue's parentheses too


def test_a_wait_gives_a_hopeless_reason_its_grace_and_starts_over_when_it_changes():
    now = [0.0]
    watch = HopelessWatch("tr11", grace_s=30, clock=lambda: now[0])
    stuck = pending("(PartitionConfig)")
    assert watch.check([stuck]) is None
    now[0] = 29
    assert watch.check([stuck, pending("(Resources)", "78")]) is None
    now[0] = 30
    assert watch.check([stuck]) == f"job 77_[1-2%1] never starts: {hopeless_reason('(PartitionConfig)', 'tr11')}"
    # A reason that went away (a node back from a reboot) starts the count again; a running task is never stuck.
    assert watch.check([pending("(Resources)")]) is None
    now[0] = 50
    assert watch.check([stuck]) is None
    now[0] = 79
    assert watch.check([stuck]) is None
    now[0] = 80
    assert watch.check([stuck]) is not None
    assert watch.check([QueueEntry("77_1", "debug", "x", "RUNNING", "0:01", "1", "N/A", "(PartitionConfig)")]) is None


def test_wait_until_gone_stops_promptly_on_a_hopeless_reason(monkeypatch):
    monkeypatch.setattr("opskit.slurm.pending.GRACE_S", 1.0)
    monkeypatch.setattr("opskit.monitor.pulse.squeue",
                        lambda *a, **k: [pending("(ReqNodeNotAvail, UnavailableNodes:node9)")])
    pulses = []
    started = time.monotonic()
    with pytest.raises(PendingForever, match=r"^job 77_\[1-2%1\] never starts: ReqNodeNotAvail: nodes it needs are "
                                             r"DOWN, DRAINED or not responding \(node9; "):
        wait_until_gone("opskit-pf", "77", pulses.append, interval_s=0.1, timeout_s=60)
    assert 1 <= time.monotonic() - started < 10
    assert len(pulses) == 1 and "is waiting to be scheduled" in pulses[0].lines[0]

    # Waiting on a reason that clears is left alone until the timeout.
    monkeypatch.setattr("opskit.monitor.pulse.squeue", lambda *a, **k: [pending("(Resources)")])
    assert wait_until_gone("opskit-pf", "77", lambda p: None, interval_s=0.1, timeout_s=1.5) is False


def test_submit_wait_exits_1_with_one_line_on_a_hopeless_reason(tmp_path, monkeypatch):
    fake_data = SimpleNamespace(data_prefix=tmp_path / "data" / "kjv_text_document")
    spec = write_spec(tmp_path / "pf.yaml", fake_data, tmp_path / "run", slurm={"job_name": "opskit-pf"})
    submitted = Submission(run=RunPaths(tmp_path / "run"), executor="slurm",
                           command=["sbatch", "--parsable", "train.slurm"], job_id="77")
    monkeypatch.setattr("opskit.submission.submit.submit", lambda *a, **k: submitted)
    monkeypatch.setattr("opskit.monitor.pulse.squeue", lambda *a, **k: [pending("(PartitionConfig)")])
    monkeypatch.setattr("opskit.slurm.pending.GRACE_S", 0.0)
    started = time.monotonic()
    done = CliRunner().invoke(app, ["submit", str(spec), "--wait"])
    assert time.monotonic() - started < 30
    assert done.exit_code == 1, done.output
    assert "submitted sbatch --parsable train.slurm -> job 77" in done.stdout
    assert done.stderr.startswith("error: job 77_[1-2%1] never starts: PartitionConfig: the job asks more than its "
                                  "partition allows")
    assert done.stderr.endswith(f", then `opskit cancel {Path(spec)}` and `opskit submit {Path(spec)}`\n")
    assert len(done.stderr.splitlines()) == 1 and "has left the queue" not in done.stdout
