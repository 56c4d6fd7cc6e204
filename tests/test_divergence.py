"""Divergence handled without a person (issue 48): the trainer's check, the job's triage by replay, the rollback and
skip, the strike for a transient fault, the bound; real trainings through the job's step loop (opskit.allocation.job
with the local executor's launcher), the tiny BLOOM with dropout on."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
from conftest import run_trainer, run_trainer_cases, tiny_trainer_args

from opskit.allocation import divergence, in_job, job
from opskit.ckpt.prune import ABANDONED
from opskit.history.goodput import account
from opskit.monitor.checks import check_divergence
from opskit.rules.divergence import DETECTED, REPLAYED, Replay, Report, read_reports, reproduced, write_report
from opskit.rules.spike_rule import SpikeWatch
from opskit.run import chain
from opskit.run.incidents import read_incidents
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.train.fault import flip_one_bit
from opskit.train.replica_digest import odd_replicas, parameter_digests

NODE = "node1"
ALLOCATION = job.Allocation("77", "70_1", NODE, under_slurm=False, partition=None, num_nodes=None)
# 40 iterations, a step every 5, a window of 10 values and a patience of 3: the poisoned data of iterations 25-28 is
# acted on at 28 (first flagged 25), the replay starts from global_step20
FLAGS = dict(hidden_dropout=0.1, attention_dropout=0.1, save_interval=5, divergence_action="rollback",
             divergence_patience=3, spike_window=10)
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+|nan) \|")


def job_run(tmp_path, monkeypatch, kjv_data, fault: str, nproc: int = 1, bounds=None, **flags) -> tuple[int, RunPaths]:
    """One task of the chain with the real trainer under the local executor's launcher; (exit status, run)."""
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_PROCID": "0", "SLURMD_NODENAME": NODE,
                        "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "OPSKIT_TEST_FAULT": fault}.items():
        monkeypatch.setenv(name, value)
    args = tiny_trainer_args(kjv_data, run.root, **{**FLAGS, **flags})
    config = job.JobConfig(run, "tiny", nodes=1, gpus_per_node=nproc, master_port=_port(), time_limit_s=3600,
                           max_failures=3, max_stalled_starts=3, in_job_restarts=0, preflight=False,
                           limits=in_job.Limits(600, 600, 10), trainer_args=tuple(map(str, args)),
                           divergence=bounds or divergence.Bounds())
    code = job.Job(config, ALLOCATION, job.local_step, job.MainLog(run.main_log, ALLOCATION),
                   stdout=io.BytesIO()).run("{}")
    return code, run


def _port() -> int:
    from conftest import free_port

    return free_port()


def steps_of(run: RunPaths) -> list[str]:
    """main_log.txt cut at each ``training step N`` line: each step's text."""
    return re.split(r"^.*training step \d+ on nodes .*$", run.main_log.read_text(), flags=re.M)[1:]


def losses(text: str) -> dict[int, str]:
    """Iteration -> lm loss as printed (the last print of an iteration wins)."""
    return {int(i): loss for i, loss in LOSS.findall(text)}


def test_a_spike_in_the_data_is_replayed_rolled_back_and_skipped_with_no_person(tmp_path, monkeypatch, kjv_data):
    code, run = job_run(tmp_path / "auto", monkeypatch, kjv_data, "poison:*:iteration=25:count=4")
    log = run.main_log.read_text()
    assert code == 0, log[-3000:]
    detect, replay, after = steps_of(run)
    # each step's part of main_log.txt ends with the triage's lines about it
    assert "lm loss spike from iteration 25" in detect and "not back within 3 iterations" in detect
    assert "incident 1: lm loss spike from iteration 25" in detect and "replaying from global_step20" in detect
    assert "replay of iteration 25" in replay and ": reproduced" in replay
    assert "rolled back to global_step20, --skip-train-iteration-range 21-28 from now on" in replay
    assert "Skipped iterations 21 to 28 due to --skip-train-iteration-range flag." in after
    # the replay is exact: the spike's iterations trained again give the same losses, bitwise
    assert {i: v for i, v in losses(replay).items() if i <= 25} == {i: v for i, v in losses(detect).items()
                                                                    if 21 <= i <= 25}
    (incident,) = read_incidents(run)
    assert (incident["verdict"], incident["first"], incident["rollback_step"], incident["skip_range"]) == (
        "reproduced", 25, 20, [21, 28])
    assert incident["replay_value"] == incident["value"]
    assert incident["abandoned"] == [f"global_step25{ABANDONED}incident1"]
    assert (run.checkpoints / incident["abandoned"][0]).is_dir()  # set aside, never deleted
    assert (run.checkpoints / "latest").read_text() == "global_step40"
    assert chain.read_bad_nodes(run) == {}  # the data's fault, no strike
    # goodput counts it: 20->28 trained then dropped, 20->25 replayed; 8 iterations' data skipped
    assert account(run).divergence == {"incidents": 1, "replaying": 0, "reproduced": 1, "transient": 0, "corrupted": 0,
                                       "held": 0, "rollbacks": 1, "iterations_redone": 13, "iterations_skipped": 8}
    # the watchdog: one alert for the incident, under its own key, then a warning once told
    spec = load_spec("tiny")
    snap = SimpleNamespace(incidents=tuple(read_incidents(run)), incidents_error=None, now=datetime.now())
    (finding,) = check_divergence(snap, spec)
    assert (finding.key, finding.severity) == ("divergence.incident_1", "alert")
    assert finding.message.endswith("reproduced (8.4457): rolled back to global_step20, iterations 21-28 skipped")
    later = SimpleNamespace(**{**vars(snap), "now": datetime.now() + timedelta(hours=7)})
    assert [f.severity for f in check_divergence(later, spec)] == ["warn"]
    # `opskit logs spikes` of the run says what the run did about its spike
    done = subprocess.run([sys.executable, "-m", "opskit.cli.app", "logs", "spikes", str(run.root), "--window", "10"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and re.search(r"divergence incident 1 \(.*\): lm loss spike at iteration 25, "
                                              r"reproduced .*iterations 21-28 skipped", done.stdout), done
    # `opskit ckpt prune --abandoned` removes the step set aside, by the record, and nothing else it was not asked to
    prune = [sys.executable, "-m", "opskit.cli.app", "ckpt", "prune", str(run.checkpoints), "--keep", "every:5",
             "--abandoned"]
    done = subprocess.run([*prune, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"would delete {incident['abandoned'][0]}" in done.stdout, done
    assert (run.checkpoints / incident["abandoned"][0]).is_dir()
    done = subprocess.run(prune, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not (run.checkpoints / incident["abandoned"][0]).exists(), done
    assert (run.checkpoints / "global_step20").is_dir() and (run.checkpoints / "global_step25").is_dir()
    # after the skip, the losses equal a run given the same skip range by hand from global_step20
    by_hand = tmp_path / "by-hand"
    (by_hand / "checkpoints").mkdir(parents=True)
    shutil.copytree(run.checkpoints / "global_step20", by_hand / "checkpoints" / "global_step20")
    (by_hand / "checkpoints" / "latest").write_text("global_step20")
    done = run_trainer(tiny_trainer_args(kjv_data, by_hand, **FLAGS, skip_train_iteration_range="21-28"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert losses(after) == losses(done.stdout) and len(losses(after)) == 20


def test_a_transient_fault_is_not_reproduced_the_node_gets_a_strike_and_the_data_is_kept(
        tmp_path, monkeypatch, kjv_data, trained):
    uninterrupted = trained(nproc=2, **FLAGS)  # before the fault is in the environment
    code, run = job_run(tmp_path, monkeypatch, kjv_data, f"nan:{NODE}:iteration=25:local_rank=1", nproc=2)
    log = run.main_log.read_text()
    assert code == 0, log[-3000:]
    detect, replay = steps_of(run)
    # DeepSpeed skips a step with non-finite gradients: its grad norm is inf, acted on at once
    assert "divergence: grad norm inf at iteration 25; stopping without saving" in detect
    assert "not reproduced, a transient fault; training goes on" in replay
    (incident,) = read_incidents(run)
    assert (incident["verdict"], incident["kind"], incident["first"], incident["skip_range"], incident["struck"]) == (
        "transient", "inf", 25, None, [NODE])
    assert math.isnan(incident["replicas"][NODE])  # rank 1's own loss; rank 0 on the same node was finite
    assert "strike: transient grad norm inf at iteration 25" in chain.read_bad_nodes(run)[NODE]
    # nothing skipped: the final losses equal an uninterrupted run's
    assert losses(replay) == {i: v for i, v in losses(uninterrupted.stdout).items() if i > 20}


def test_a_spike_that_comes_back_after_every_rollback_holds_the_chain_with_one_alert(tmp_path, monkeypatch, kjv_data):
    # later in training, where the window of the step rolled back to is flat enough for the poison to stand out
    code, run = job_run(tmp_path, monkeypatch, kjv_data, "poison:*:iteration=61:count=100", train_samples=640,
                        bounds=divergence.Bounds(max_rollbacks=1))
    assert code != 0
    incidents = read_incidents(run)
    assert [i["verdict"] for i in incidents] == ["reproduced", "held"]
    assert "1 rollbacks in 24 h already" in incidents[1]["outcome"]
    flag = run.stopped_flag.read_text()
    assert chain.stopped_code(flag) == divergence.HELD_CODE and flag.count("***ALERT") == 1
    assert chain.stop_reason(run) is not None  # the chain's later tasks exit at start
    assert len(steps_of(run)) == 3


# --------------------------------------------------------------------------- the parts, without a trainer


def test_a_replay_is_judged_against_the_spike_and_the_median_before_it():
    replay = Replay.parse("25:lm_loss:8.4457:6.4591")
    assert Replay.parse(replay.flag()) == replay
    assert reproduced(replay, 8.4457) and reproduced(replay, 7.5) and not reproduced(replay, 7.3)
    assert not reproduced(replay, None) and reproduced(replay, math.inf)
    nan = Replay(25, "lm_loss", math.nan, 6.4)
    assert reproduced(nan, math.nan) and not reproduced(nan, 6.4)
    for bad in ("25:lm_loss:8", "0:lm_loss:8:6", "x:lm_loss:8:6", "25:loss:8:6", "25:lm_loss:a:6"):
        with pytest.raises(ValueError):
            Replay.parse(bad)


def test_the_spike_watch_resumes_where_it_was_saved():
    watch, resumed = SpikeWatch(), SpikeWatch()
    values = [2.0 + 0.01 * (i % 7) for i in range(60)] + [3.0, 3.1]
    for i, v in enumerate(values[:40]):
        watch.add(i, {"lm_loss": v, "grad_norm": 1.0})
    resumed.restore(json.loads(json.dumps(watch.state())))
    for i, v in enumerate(values[40:], 40):
        assert watch.add(i, {"lm_loss": v}) == resumed.add(i, {"lm_loss": v})
    assert watch.open == resumed.open and watch.open[0].first == 60
    with pytest.raises(ValueError):
        resumed.restore({"windows": 3})


@pytest.mark.parametrize("replicas, odd", [
    ({"a": 2.0}, []), ({"a": 2.0, "b": 9.0}, ["a", "b"]), ({"a": 2.0, "b": math.nan}, ["b"]),
    ({"a": 2.0, "b": 2.1, "c": 9.0}, ["c"]), ({"a": math.nan, "b": math.nan}, []),
])
def test_the_replica_that_stood_out_is_named(replicas, odd):
    assert divergence._odd_replicas(replicas) == odd


def test_each_step_gets_the_incidents_skip_ranges_merged_with_the_specs_and_the_replay(tmp_path):
    run = RunPaths(tmp_path)
    args = ["--lr", "1", "--skip-train-iteration-range", "5-9", "30-31", "--seed", "3"]
    assert divergence.step_trainer_args(run, args) == (args, [])
    (run.root / "incidents.json").write_text(json.dumps({"incidents": [
        {"id": 1, "skip_range": [8, 12], "verdict": "reproduced"},
        {"id": 2, "skip_range": None, "verdict": "replaying", "first": 40, "metric": "grad_norm", "value": 9.5,
         "baseline": 1.0, "rollback_step": 35}]}))
    new, lines = divergence.step_trainer_args(run, args)
    assert new == ["--lr", "1", "--seed", "3", "--skip-train-iteration-range", "5-12", "30-31",
                   "--divergence-replay", "40:grad_norm:9.5:1.0"]
    assert lines == ["incident 2: this step replays iteration 40 from global_step35"]
    (run.root / "incidents.json").write_bytes(b"\x00\xff torn")
    with pytest.raises(ValueError, match="incidents.json: unreadable"):
        divergence.step_trainer_args(run, args)


def test_reports_round_trip_and_a_torn_one_is_passed_over(tmp_path):
    report = Report(DETECTED, "lm_loss", 25, 28, 28, math.nan, math.nan, 6.4, 0, NODE, math.nan)
    write_report(tmp_path, report)
    (tmp_path / f"{REPLAYED}-25-rank1.json").write_text('{"event": "repl')
    (back,) = read_reports(tmp_path)
    assert back.first == 25 and math.isnan(back.value) and back.node == NODE
    assert read_reports(tmp_path / "missing") == []


@pytest.mark.parametrize("rows, odd", [
    ([(1, 2)] * 4, []), ([(1, 2), (1, 2), (1, 3), (1, 2)], [2]), ([(1, 2), (1, 3)], [0, 1]),
    ([(1, 2), (1, 2), (1, 3), (1, 3)], [0, 1, 2, 3]), ([(5,), (6,), (5,)], [1]),
])
def test_the_replica_whose_digest_differs_is_the_odd_one_out_and_of_two_both(rows, odd):
    assert odd_replicas(rows) == odd


def test_a_flipped_bit_changes_the_digest_of_its_tensor_only():
    import torch

    params = [torch.randn(7, 3), torch.randn(5).to(torch.bfloat16), torch.randn(2, dtype=torch.float64)]
    before = parameter_digests(params)
    flip_one_bit(params)
    after = parameter_digests(params)
    assert before.dtype == torch.int64 and before.shape == (3,)
    assert abs(int(after[0]) - int(before[0])) == 1 and after[1:].tolist() == before[1:].tolist()
    assert parameter_digests([p.clone() for p in params]).tolist() == after.tolist()  # copies agree bitwise


def test_no_false_alarm_on_ten_clean_tiny_runs(kjv_data, tmp_path):
    """Ten clean trainings (seeds 1-10, dropout on) under this file's strict settings (a window of 10, a patience of
    3): the check never acts, and nothing would be acted on at the spec's defaults either. One process runs them in
    turn (conftest.run_trainer_cases: the imports once)."""
    flags = {**FLAGS, "save": None, "load": None, "save_interval": None}
    cases = {f"seed{seed}": tiny_trainer_args(kjv_data, tmp_path / f"seed{seed}", **flags, seed=seed)
             for seed in range(1, 11)}
    for name, done in run_trainer_cases(cases, tmp_path / "cases").items():
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert "divergence" not in done.stdout + done.stderr, name
        assert len(losses(done.stdout)) == 40, name
