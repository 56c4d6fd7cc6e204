"""``opskit goodput``: a run's wall clock split into training, redone training, saving, loading, start-up, evaluation,
hangs, queue wait and idle, from main_log.txt (lines as the job script and the trainer print them) and the ledger.
The real chain (SLURM, the trainer, a crash through the fault hook) is checked in tests/test_multinode_failures.py."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta

import pytest
from conftest import write_spec
from typer.testing import CliRunner

from opskit.cli.app import app
from opskit.history.goodput import CATEGORIES, GoodputError, account
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.spec.schema import WatchdogSpec
from opskit.train.log import iteration_line

GBS = 8
SECONDS = 0.01  # the log's samples per second have 3 decimals: the seconds they give back agree to this
T0 = datetime(2026, 11, 27, 10, 0, 0)


class MainLog:
    """main_log.txt as a chain writes it: the job script's ``[opskit]`` lines and the trainer's (torchrun's prefix),
    with a clock that each line moves on."""

    def __init__(self, run: RunPaths):
        self.run, self.lines, self.now = run, [], T0

    def wait(self, seconds: float) -> MainLog:
        self.now += timedelta(seconds=seconds)
        return self

    def opskit(self, text: str, task: str | None = None) -> MainLog:
        header = f"[opskit] {self.now:%Y-%m-%d %H:%M:%S}"
        job = "" if task is None else f"job 7 (array task {task}) nodes n1: "
        self.lines.append(f"{header} {job}{text}")
        return self

    def trainer(self, text: str) -> MainLog:
        self.lines.append(f"0: [default0]:{text}")
        return self

    def start_training(self, startup_s: float, load_from: int | None = None, load_s: float = 0.0) -> MainLog:
        self.wait(startup_s + load_s)
        if load_from is not None:
            self.trainer(f" loading checkpoint from {self.run.checkpoints} at global_step{load_from}")
            self.trainer(f"  successfully loaded checkpoint from {self.run.checkpoints} at iteration {load_from}")
            self.trainer(f"time (ms) | load-checkpoint: {load_s * 1000:.2f}")
        return self.trainer(f"[before the start of training step] datetime: {self.now:%Y-%m-%d %H:%M:%S} ")

    def iterate(self, first: int, last: int, seconds: float, saves: dict[int, float] = {},  # noqa: B006
                evals: dict[int, float] = {}) -> MainLog:  # noqa: B006
        """Iterations ``first..last`` of ``seconds`` each, one line each; a save (evaluation) after iteration N of
        ``saves[N]`` seconds, inside the next line's window as Megatron's interval timer has it."""
        carried = 0.0
        for iteration in range(first, last + 1):
            self.wait(seconds)
            self.trainer(iteration_line(
                iteration=iteration, train_iters=100, consumed_samples=iteration * GBS,
                consumed_tokens=iteration * GBS * 32, seconds_per_iteration=seconds + carried, learning_rate=1e-3,
                global_batch_size=GBS, lm_loss=5.0, loss_scale=None, grad_norm=0.5, skipped_iterations=0,
                nan_iterations=0, tflops=1.0))
            carried = 0.0
            if iteration in evals:
                self.wait(evals[iteration]).trainer(f"time (ms) | evaluate: {evals[iteration] * 1000:.2f}")
                carried += evals[iteration]
            if iteration in saves:
                self.trainer(f"saving checkpoint at iteration {iteration:7d} to {self.run.checkpoints}")
                self.wait(saves[iteration])
                self.trainer(f"  successfully saved checkpoint at iteration {iteration:7d} to {self.run.checkpoints}")
                self.trainer(f"time (ms) | save-checkpoint: {saves[iteration] * 1000:.2f}")
                carried += saves[iteration]
        return self

    def write(self) -> None:
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.run.main_log.write_text("\n".join(self.lines) + "\n")


def approx(seconds: float):
    return pytest.approx(seconds, abs=SECONDS)


def ledger(run: RunPaths, *rows: tuple[str, str, datetime]) -> None:
    for task, state, at in rows:
        chain.record(run, chain.TaskOutcome(f"{at:%Y-%m-%d %H:%M:%S}", "7", task, state, 0, "n1"))


@pytest.fixture
def crashed_and_resumed(tmp_path) -> RunPaths:
    """Submitted; task 1 queued 60 s, trains 1-10 (2 s each, saves after 4 and 8 of 3 s), crashes 5 s after 10;
    task 2 queued 30 s, loads step 8 in 5 s, trains 9-20 (evaluation after 12, saves after 12, 16, 20), ends."""
    run = RunPaths(tmp_path / "run")
    log = MainLog(run).opskit("submitted job 7 (3 tasks)").wait(60).opskit("start", "7_1")
    log.start_training(15).iterate(1, 10, 2.0, saves={4: 3.0, 8: 3.0}).wait(5)
    crashed = log.now
    log.opskit("end, exit code 1", "7_1").wait(30).opskit("start", "7_2")
    log.start_training(12, load_from=8, load_s=5.0)
    log.iterate(9, 20, 2.0, saves={12: 3.0, 16: 3.0, 20: 3.0}, evals={12: 4.0}).wait(2)
    log.opskit("end, exit code 0", "7_2").write()
    ledger(run, ("7_1", "FAILED", crashed), ("7_2", "COMPLETED", log.now))
    run.finished_flag.write_text("done\n")
    return run


def test_a_crash_loses_the_iterations_after_the_last_save_and_the_parts_sum_to_the_wall(crashed_and_resumed):
    result = account(crashed_and_resumed)
    first, second = result.tasks
    assert (first.state, first.iterations, first.redone_iterations) == ("FAILED", 10, 2)
    assert first.seconds["redone"] == approx(4.0)  # iterations 9 and 10
    assert first.seconds["training"] == approx(16.0)  # 1-8
    assert first.seconds["saving"] == approx(6.0) and first.seconds["startup"] == approx(15.0)
    assert first.seconds["queue"] == 60 and first.seconds["idle"] == approx(5.0)  # the crash's 5 s
    assert (second.iterations, second.redone_iterations) == (12, 0)
    assert second.seconds["loading"] == approx(5.0) and second.seconds["startup"] == approx(12.0)
    assert second.seconds["training"] == approx(24.0) and second.seconds["evaluation"] == approx(4.0)
    assert second.seconds["saving"] == approx(9.0) and second.seconds["queue"] == 30
    totals = result.totals
    assert sum(totals.values()) == pytest.approx(result.wall_seconds, rel=0.01)
    assert result.wall_seconds == (result.end - T0).total_seconds() and result.queue_after_s == 0
    assert result.goodput == pytest.approx(40.0 / result.wall_seconds, rel=1e-3)
    assert result.notes == []


def test_the_redone_iterations_are_the_ones_the_next_task_trains_again(crashed_and_resumed):
    """What the failed task lost is exactly what the next one trained twice: from its resume point to the crash."""
    first, second = account(crashed_and_resumed).tasks
    text = crashed_and_resumed.main_log.read_text()
    [resumed_from] = [int(n) for n in re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)", text)]
    logged = [int(n) for n in re.findall(r" iteration +(\d+)/", text)]
    trained_twice = sorted(set(logged[:first.iterations]) & set(logged[first.iterations:]))
    assert trained_twice == list(range(resumed_from + 1, 11)) and first.redone_iterations == len(trained_twice)
    assert first.iterations - first.redone_iterations == resumed_from and second.iterations == 20 - resumed_from


def test_a_load_line_that_reaches_the_log_after_the_first_iteration_line_still_sets_the_resume_point(
        crashed_and_resumed):
    """On several nodes rank 0's ``successfully loaded`` line and the last rank's first iteration line reach
    main_log.txt in either order (seen in the 3-node crash test): task 2 trained 9-20 (12), either way."""
    log = crashed_and_resumed.main_log
    lines = log.read_text().splitlines()
    loaded = next(i for i, line in enumerate(lines) if "successfully loaded" in line)
    first_iteration = next(i for i, line in enumerate(lines) if i > loaded and " iteration        9/" in line)
    lines.insert(first_iteration, lines.pop(loaded))  # now just after iteration 9's line
    log.write_text("\n".join(lines) + "\n")
    second = account(crashed_and_resumed).tasks[1]
    assert second.iterations == 12
    assert second.seconds["training"] == approx(12 * 2.0 + 4.0 + 3 * 3.0 - 3 * 3.0 - 4.0)


def test_a_hang_is_the_silence_after_the_last_line_until_the_cancel(tmp_path):
    run = RunPaths(tmp_path / "run")
    log = MainLog(run).opskit("submitted job 7 (2 tasks)").wait(10).opskit("start", "7_1")
    log.start_training(20).iterate(1, 30, 1.0, saves={20: 2.0}).wait(45 * 60)
    log.opskit("SIGTERM: the job ends (CANCELLED)", "7_1").write()
    ledger(run, ("7_1", "CANCELLED", log.now))
    result = account(run, now=log.now + timedelta(minutes=5))
    [task] = result.tasks
    assert task.seconds["hang"] == approx(45 * 60) and task.redone_iterations == 10
    assert task.seconds["redone"] == approx(10.0)
    assert result.queue_after_s == 300  # not finished: waiting for the next task until now
    shorter = account(run, WatchdogSpec(hang_min_minutes=60), now=log.now)
    assert shorter.tasks[0].seconds["hang"] == 0 and shorter.tasks[0].seconds["idle"] == approx(45 * 60)


def test_a_running_task_counts_to_now_and_a_run_without_saves_loses_from_its_start(tmp_path):
    run = RunPaths(tmp_path / "run")
    log = MainLog(run).opskit("start", "7_1")
    log.start_training(5).iterate(1, 4, 1.0).wait(100)
    log.opskit("SIGTERM: the job ends (TIMEOUT)", "7_1").write()
    result = account(run, now=log.now)
    [task] = result.tasks
    assert (task.state, task.redone_iterations) == ("TIMEOUT", 4)  # no save: all of it is done again
    assert any("no 'submitted' line" in note for note in result.notes)
    running = RunPaths(tmp_path / "running")
    log = MainLog(running).opskit("submitted job 8 (1 tasks)").opskit("start", "8_1")
    log.start_training(5).iterate(1, 3, 1.0)
    log.write()
    [task] = account(running, now=log.now + timedelta(seconds=2)).tasks
    assert task.state is None and task.seconds["training"] == approx(3.0)
    assert task.seconds["idle"] == approx(2.0)


def test_an_in_job_restart_splits_the_task_into_steps_and_its_hang_and_redone_work_count(tmp_path):
    """One task, two training steps (opskit.allocation.in_job): step 0 trains 1-12 (save after 10), hangs 20 s until the
    in-job watchdog stops it; step 1 starts at once on the spare, loads step 10 and trains 11-30. Step 0's 11-12 are
    redone, its silence a hang, and the ledger's COMPLETED row is the task's last step's."""
    run = RunPaths(tmp_path / "run")
    log = MainLog(run).opskit("submitted job 7 (2 tasks)").opskit("start", "7_1")
    log.opskit("training step 0 on nodes n1,n2", "7_1")
    log.start_training(10).iterate(1, 12, 1.0, saves={10: 2.0}).wait(20)
    log.opskit("in-job watchdog: 2 of 2 ranks silent for up to 20 s (limit 15 s; last iteration 11); hung: n2 local "
               "rank 0 (from the stacks); stopping the step", "7_1")
    log.wait(2).opskit("blamed n2: hung (silent 20 s)", "7_1")
    log.opskit("in-job restart 1 of 2: training resumes from the last checkpoint", "7_1")
    log.opskit("training step 1 on nodes n1,n3", "7_1")
    log.start_training(10, load_from=10, load_s=3.0).iterate(11, 30, 1.0).wait(1)
    log.opskit("end, exit code 0", "7_1").write()
    ledger(run, ("7_1", "COMPLETED", log.now))
    result = account(run)
    first, second = result.tasks
    assert [(t.label, t.state, t.iterations, t.redone_iterations) for t in result.tasks] == [
        ("7_1", "RESTARTED", 12, 2), ("7_1 step 1", "COMPLETED", 20, 0)]
    # the hang lasts until the step is stopped (the watchdog's 20 s, then 2 s stopping it and blaming the node)
    assert first.seconds["hang"] == approx(22.0) and first.seconds["redone"] == approx(2.0)
    assert first.seconds["training"] == approx(10.0) and first.seconds["idle"] == approx(0.0)
    assert second.seconds["queue"] == 0 and second.seconds["loading"] == approx(3.0)
    assert second.seconds["startup"] == approx(10.0) and second.seconds["training"] == approx(20.0)
    assert sum(result.totals.values()) == pytest.approx(result.wall_seconds, rel=0.01)
    assert [t["step"] for t in result.as_json()["tasks"]] == [0, 1]


def test_iterations_an_exit_trained_after_the_last_line_count_from_its_save_line(tmp_path):
    """``--log-interval`` > 1: SIGUSR1 at iteration 14 after the line of 10; the exit's save names 14. Iterations
    11-14 count at the logged time per iteration; in a failed task they are redone when no save completed them."""
    run = RunPaths(tmp_path / "run")
    log = MainLog(run).opskit("submitted job 7 (2 tasks)").opskit("start", "7_1")
    log.start_training(5).iterate(1, 10, 2.0).wait(8.0)  # 11-14, unlogged
    log.opskit("SIGUSR1: asking the trainer to save and exit", "7_1")
    log.trainer(f"saving checkpoint at iteration      14 to {run.checkpoints}").wait(3.0)
    log.trainer(f"  successfully saved checkpoint at iteration      14 to {run.checkpoints}")
    log.trainer("time (ms) | save-checkpoint: 3000.00").wait(1.0).opskit("end, exit code 0", "7_1")
    log.write()
    ledger(run, ("7_1", "COMPLETED", log.now))
    [task] = account(run, now=log.now).tasks
    assert task.iterations == 14 and task.seconds["training"] == approx(28.0)
    assert task.seconds["saving"] == approx(3.0) and task.seconds["idle"] == approx(1.0)
    failed = RunPaths(tmp_path / "failed")
    log = MainLog(failed).opskit("start", "8_1")
    log.start_training(5).iterate(1, 10, 2.0, saves={10: 1.0}).wait(8.0)
    log.trainer(f"saving checkpoint at iteration      14 to {failed.checkpoints}").wait(30.0)  # killed in the save
    log.opskit("SIGTERM: the job ends (TIMEOUT)", "8_1").write()
    [task] = account(failed, now=log.now).tasks
    assert (task.iterations, task.redone_iterations) == (14, 4) and task.seconds["redone"] == approx(8.0)


def test_bad_logs_and_ledgers(tmp_path):
    run = RunPaths(tmp_path / "run")
    with pytest.raises(GoodputError, match="no such file: no task of this run has started"):
        account(run)
    run.logs.mkdir(parents=True)
    run.main_log.write_bytes(b"\x00\xff binary\n[opskit] 2026-13-45 99:99:99 job 7 (array task 7_1) nodes n: start\n")
    with pytest.raises(GoodputError, match=r"main_log.txt: no '\[opskit\] ... start' line"):
        account(run)
    log = MainLog(run).opskit("start", "7_1")
    log.start_training(5).iterate(1, 3, 1.0)
    log.write()
    cut = iteration_line(iteration=4, train_iters=100, consumed_samples=32, consumed_tokens=1024,
                         seconds_per_iteration=1.0, learning_rate=1e-3, global_batch_size=GBS, lm_loss=5.0,
                         loss_scale=None, grad_norm=0.5, skipped_iterations=0, nan_iterations=0, tflops=1.0)[:60]
    with run.main_log.open("ab") as f:  # a crash mid-write: the last line cut, then bytes that are no text
        f.write(f"0: [default0]:{cut}\n".encode() + b"\xff\xfe\x00\n")
    [task] = account(run, now=log.now).tasks
    assert task.iterations == 3
    run.ledger.write_text('{"time":"2026-11-27 10:00:00","job_id":"7","ta')
    with pytest.raises(chain.ChainError, match=r"ledger.jsonl:1: not a ledger record"):
        account(run)


@pytest.fixture
def spec_of(kjv_data, tmp_path):
    def make(run: RunPaths) -> str:
        return str(write_spec(tmp_path / "spec.yaml", kjv_data, run.root))
    return make


def test_cli_json_table_and_plot(crashed_and_resumed, spec_of, tmp_path):
    spec = spec_of(crashed_and_resumed)
    runner = CliRunner()
    done = runner.invoke(app, ["goodput", spec, "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert set(report["categories"]) == set(CATEGORIES)
    assert sum(c["percent"] for c in report["categories"].values()) == pytest.approx(100, abs=1)
    assert [t["redone_iterations"] for t in report["tasks"]] == [2, 0]
    png = tmp_path / "goodput.png"
    done = runner.invoke(app, ["goodput", spec, "--out", str(png)])
    assert done.exit_code == 0, done.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in done.stdout and "7_1" in done.stdout and "FAILED" in done.stdout


def test_cli_one_line_for_a_run_never_started_and_a_cut_ledger(tmp_path, spec_of):
    run = RunPaths(tmp_path / "never")
    spec = spec_of(run)
    runner = CliRunner()
    done = runner.invoke(app, ["goodput", spec])
    assert done.exit_code == 1 and done.stderr.count("\n") == 1 and "no task of this run has started" in done.stderr
    MainLog(run).opskit("start", "7_1").write()
    run.ledger.write_text('{"time":"2026-11-27')
    done = runner.invoke(app, ["goodput", spec])
    assert done.exit_code == 1 and done.stderr.startswith("error: ") and "ledger.jsonl:1" in done.stderr
    assert "Traceback" not in done.output


def test_every_category_has_a_colour_and_the_totals_cover_every_category(crashed_and_resumed):
    result = account(crashed_and_resumed)
    assert list(result.totals) == list(CATEGORIES)
    assert all(set(t.seconds) == set(CATEGORIES) for t in result.tasks)
