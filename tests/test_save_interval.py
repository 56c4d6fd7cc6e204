"""The save interval from measured failures: Young/Daly's rule against tr11's figures, the run's history read from its
log and ledger, and `opskit plan --from-run`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from opskit.cli.app import app
from opskit.history.measures import save_interval_advice
from opskit.rules.reliability import lost_fraction, optimal_save_interval
from opskit.run.paths import RunPaths

WEEK = 7 * 86400


def test_tr11s_figures_give_66_iterations_and_the_loss_at_its_intervals():
    """tr11's chronicles: a save stops training 40 s, an iteration takes 105 s, about one failure a week."""
    best = optimal_save_interval(40, WEEK)
    assert best == pytest.approx(6955.9, abs=0.1)  # sqrt(2 * 40 * 604800) s
    assert round(best / 105) == 66
    # C / tau + tau / (2 M): 100, 200 and 300 iterations (tr11 moved from 300 to 200 after its failures)
    assert [round(100 * lost_fraction(n * 105, 40, WEEK), 3) for n in (66, 100, 200, 300)] == \
        [1.150, 1.249, 1.927, 2.731]
    assert lost_fraction(best, 40, WEEK) < min(lost_fraction(n * 105, 40, WEEK) for n in (60, 72, 100))
    assert lost_fraction(300 * 105, 40, WEEK, restart_s=1800) == pytest.approx(0.02731 + 1800 / WEEK, abs=1e-5)


@pytest.mark.parametrize(("save", "mtbf"), [(0, WEEK), (40, 0), (-1, WEEK)])
def test_a_non_positive_cost_or_mtbf_is_refused(save, mtbf):
    with pytest.raises(ValueError, match="must be > 0"):
        optimal_save_interval(save, mtbf)


def _iteration(n: int, seconds: float) -> str:
    return (f" iteration {n:8d}/    1000 | consumed samples: {16 * n:12d} | consumed tokens: {16 * 512 * n:12d} | "
            f"elapsed time per iteration (s): {seconds:.2f} | learning rate: 3.000E-04 | global batch size:    16 | "
            "lm loss: 5.000000E+00 | grad norm: 0.500 | num zeros: 0.0 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 | samples per second: 16.000 | TFLOPs: 1.00 |\n")


def _history(tmp_path, ledger_states: list[str]) -> RunPaths:
    """A run of two tasks: 10 h and 20 h of running, saves of 30 and 50 s, iterations of 100 s."""
    run = RunPaths(tmp_path / "run")
    run.main_log.parent.mkdir(parents=True)
    header = "[opskit] {} job {} (array task {}) nodes n[1-2]: {}\n"
    run.main_log.write_text(
        header.format("2022-03-11 00:00:00", 7, "7_1", "start") + _iteration(1, 100.0)
        + "saving checkpoint at iteration       1 to /ckpt\n"
        + "  successfully saved checkpoint at iteration       1 to /ckpt\n"
        + "time (ms) | save-checkpoint: 30000.00\n" + _iteration(2, 100.0)
        + header.format("2022-03-11 10:00:00", 7, "7_1", "end, exit code 1")
        + header.format("2022-03-11 12:00:00", 8, "8_1", "start") + _iteration(2, 100.0)
        + "time (ms) | save-checkpoint: 50000.00\n"
        + header.format("2022-03-12 08:00:00", 8, "8_1", "end, exit code 0"))
    run.ledger.write_text("".join(json.dumps({"time": "t", "job_id": "7", "task": f"7_{i}", "state": state}) + "\n"
                                  for i, state in enumerate(ledger_states)))
    return run


def test_the_history_measures_mtbf_save_cost_and_iteration_time(tmp_path):
    advice = save_interval_advice(_history(tmp_path, ["FAILED", "COMPLETED", "NODE_FAIL"]), 300)
    assert (advice.tasks, advice.hours_run, advice.failures) == (2, 30.0, 2)
    assert (advice.mtbf_hours, advice.save_seconds, advice.iteration_seconds) == (15.0, 40.0, 100.0)
    best = optimal_save_interval(40, 15 * 3600)  # 2078 s
    assert advice.optimal_interval == round(best / 100) == 21
    assert advice.lost_at_spec == pytest.approx(lost_fraction(30000, 40, 54000))
    assert advice.lost_at_optimal < advice.lost_at_spec
    assert advice.notes == []


def test_a_run_without_failures_or_never_started_says_what_it_cannot_measure(tmp_path):
    advice = save_interval_advice(_history(tmp_path, ["COMPLETED"]), 300)
    assert advice.mtbf_hours is None and advice.optimal_interval is None
    assert advice.notes == ["no failure in 30.0 h of running: the mean time between failures is not known yet"]
    garbled = RunPaths(tmp_path / "garbled")
    garbled.main_log.parent.mkdir(parents=True)
    garbled.main_log.write_bytes(b"[opskit] 2022-13-45 99:00:00 job 1 (array task 1_1) nodes n1: start\n\xff\xfe"
                                 b"time (ms) | save-checkpoint: 12x\n" + bytes(range(256)))
    garbled.main_log.write_bytes(garbled.main_log.read_bytes() + b"\ntime (ms) | save-checkpoint: 1.2.3\n")
    mangled = save_interval_advice(garbled, 300)  # an impossible date, garbled numbers, binary: no traceback
    assert (mangled.tasks, mangled.save_seconds) == (0, None)
    empty = save_interval_advice(RunPaths(tmp_path / "never"), 300)
    assert (empty.tasks, empty.save_seconds, empty.iteration_seconds) == (0, None, None)
    assert any("no task of this run has started" in note for note in empty.notes)


def test_plan_from_run_reports_the_advice_and_a_broken_ledger_in_one_line(tmp_path, monkeypatch):
    from conftest import write_spec

    run = _history(tmp_path, ["FAILED"])
    spec = write_spec(tmp_path / "s.yaml", SimpleNamespace(data_prefix=tmp_path / "data" / "kjv_text_document"),
                      run.root, checkpoint={"save_interval": 300})
    done = CliRunner().invoke(app, ["plan", str(spec), "--from-run", "--json"])
    assert done.exit_code == 0, done.output
    advice = json.loads(done.stdout)["save_interval"]
    assert (advice["failures"], advice["mtbf_hours"], advice["spec_interval"]) == (1, 30.0, 300)
    run.ledger.write_text("not json\n")
    done = CliRunner().invoke(app, ["plan", str(spec), "--from-run"])
    assert done.exit_code == 1
    assert f"{run.ledger}:1: not a ledger record" in done.output and "Traceback" not in done.output


def test_the_watchdog_says_when_the_specs_interval_loses_over_1_percent_and_reads_the_log_once_per_failure(tmp_path):
    from opskit.monitor.checks import save_interval_findings
    from opskit.monitor.snapshot import measure_save_interval
    from opskit.monitor.watch_state import WatchdogState
    from opskit.run import chain

    run = _history(tmp_path, ["FAILED", "COMPLETED", "NODE_FAIL"])
    ledger = chain.read_ledger(run)
    measured = measure_save_interval(run, 300, ledger, None)
    [finding] = save_interval_findings(measured, 2, 300)
    assert (finding.key, finding.severity) == ("checkpoint.save_interval", "warn")
    assert finding.message.endswith("set checkpoint.save_interval 21 (next submit)"), finding.message
    assert "MTBF 15 h (2 failure(s) in 30 h), save 40 s, iteration 100 s" in finding.message
    [best] = save_interval_findings(measure_save_interval(run, 21, ledger, measured), 2, 21)
    assert best.severity == "ok" and not best.message.endswith("(next submit)")
    run.main_log.unlink()  # the figures of two failures are kept: the log is not read again
    assert measure_save_interval(run, 300, ledger, measured) is measured
    assert save_interval_findings(measured, 2, 300) == [finding]
    assert measure_save_interval(run, 300, ledger[:1], measured)["failures"] == 1  # another count: measured again
    assert measure_save_interval(RunPaths(tmp_path / "no-failure"), 300, [], None) is None
    state = WatchdogState.from_json(json.loads(json.dumps({"measured": measured})))  # the state file round trip
    assert state.measured["failures"] == 2
