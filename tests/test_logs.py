"""opskit.logs and `opskit logs`: the real log lines of the BigScience chronicles (tests/fixtures/logs/, see
generate.py there), our trainer's lines, real TensorBoard event files, real PNGs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opskit.cli.app import app
from opskit.logs.eta import progress
from opskit.logs.follow import follow, published_key
from opskit.logs.grammar import parse_iteration_line, parse_line
from opskit.logs.parse import LogFormatError, read_from, read_tail, split_segments, timeline
from opskit.logs.spikes import find_spikes, remedies
from opskit.rules.spike_rule import SpikeConfig, SpikeWatch
from opskit.train.log import iteration_line, validation_lines

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def fixture_line(name: str, iteration: int) -> str:
    """The line of ``iteration`` in a fixture, as the chronicle quotes it."""
    (line,) = [x for x in (FIXTURES / name).read_text().splitlines() if f" iteration {iteration:8d}/" in x]
    return line


runner = CliRunner()


def read_from_text(text: str, fields=None):
    from opskit.logs.parse import parse_text

    return parse_text(text + "\n", fields=fields)


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_2021_ms_format_and_validation_line_tr1_13b():
    chunk = read_from(FIXTURES / "tr1-13B.txt")
    assert chunk.skipped == 0
    assert chunk.records == [
        {"kind": "iteration", "iteration": 168000, "train_iters": 311541, "consumed_samples": 153013584,
         "elapsed_time_per_iteration_s": 13.2482, "learning_rate": 1.0e-05, "global_batch_size": 1024,
         "lm_loss": 2.376641, "loss_scale": 131072.0, "grad_norm": 19767.052, "num_zeros": 0.0,
         "skipped_iterations": 0, "nan_iterations": 0},
        {"kind": "validation", "iteration": 168000, "dataset": "validation", "where": "iteration 168000",
         "validation_lm_loss": 2.342049, "validation_ppl": 10.40253},
    ]


def test_104b_loss_scale_ms_with_tokens_and_a_wrapped_line_is_skipped():
    chunk = read_from(FIXTURES / "tr8b-104B.txt")
    assert [r["iteration"] for r in chunk.records] == [6502, 6503, 6504, 8600, 12000, 12001, 14000]
    assert chunk.skipped == 1  # 13251, wrapped over three lines in the chronicle
    first = chunk.records[0]
    assert (first["consumed_tokens"], first["elapsed_time_per_iteration_s"], first["loss_scale"],
            first["grad_norm"]) == (444334080, 31.0741, 4096.0, 3246.595)
    assert [r["loss_scale"] for r in chunk.records[3:]] == [8192.0, 262144.0, 262144.0, 4096.0]
    assert chunk.records[5]["learning_rate"] == 5.842e-05  # the --override-lr-scheduler drop


def test_176b_default7_prefix_line_as_in_the_reference():
    line = fixture_line("tr11-176B-spike.txt", 31217)
    assert line.startswith("[default7]: iteration    31217/  115311 | consumed samples:     47774640 |")
    assert parse_iteration_line(line) == {
        "kind": "iteration", "iteration": 31217, "train_iters": 115311, "consumed_samples": 47774640,
        "consumed_tokens": 97842462720, "elapsed_time_per_iteration_s": 106.33, "learning_rate": 5.279e-05,
        "global_batch_size": 2048, "lm_loss": 2.241558, "grad_norm": 15.886, "num_zeros": 0.0,
        "skipped_iterations": 0, "nan_iterations": 0, "samples_per_second": 19.26, "tflops": 147.46}


def test_prefixes_extra_fields_cut_interleaved_and_named_validation_sets():
    chunk = read_from(FIXTURES / "malformed.txt")
    # 12697 cut, 12698 and 12699 garbled by other ranks, "iteration    127" cut in its header, a cut validation line
    assert chunk.skipped == 5
    assert [(r["kind"], r["iteration"]) for r in chunk.records] == [
        ("iteration", 12695), ("iteration", 12696), ("validation", 12700), ("validation", None),
        ("iteration", 12701)]
    logged = chunk.records[1]  # behind "2022-03-18 10:42:01 INFO train.py:812 - "
    assert (logged["params_norm"], logged["curriculum_seqlen"], logged["extra"]) == (
        1234.567, 2048, {"moe_loss": 0.0125, "router": "top2"})
    assert logged["consumed_tokens"] == 20159758336
    named, end = chunk.records[2], chunk.records[3]
    assert (named["dataset"], named["validation_lm_loss"], named["validation_ppl"]) == ("valid_en_wiki", 2.512345,
                                                                                        12.33456)
    assert (end["where"], end["validation_lm_loss"]) == ("the end of training for val data", 2.4)
    assert parse_line("[default0]:saving checkpoint at iteration   12700 to /ckpt") is None
    loaded = "[default0]:  successfully loaded checkpoint from /tmp/fresh/runs/tiny/checkpoints at iteration 346"
    assert parse_line(loaded) is None  # our trainer's resume line, not a cut header
    assert read_from_text(loaded).skipped == read_from_text(loaded, ("lm_loss",)).skipped == 0
    odd = " iteration 3/ 9 |  global batch size:  16.0 | lm loss:1.5 | number of nan iterations: x |"
    assert parse_line(odd) is None  # "x" is no count
    assert parse_line(odd.replace(": x |", ": inf |")) is None  # nor is inf (it used to raise OverflowError)
    for fields in (None, ("global_batch_size", "lm_loss")):
        (record,) = read_from_text(odd.replace(": x |", ": 0 |"), fields).records
        assert (record["global_batch_size"], record["lm_loss"]) == (16, 1.5)


@pytest.mark.parametrize("name", ["tr1-13B", "tr8b-104B", "tr11-176B-spike", "malformed", "restart"])
def test_reading_some_fields_gives_the_same_values_as_reading_all(name):
    fields = ("lm_loss", "grad_norm", "consumed_tokens", "elapsed_time_per_iteration_s")
    full, some = read_from(FIXTURES / f"{name}.txt"), read_from(FIXTURES / f"{name}.txt", fields=fields)
    keep = {"kind", "iteration", "train_iters", *fields}
    assert some.records == [{k: v for k, v in r.items() if k in keep} if r["kind"] == "iteration" else r
                            for r in full.records]
    assert some.skipped == full.skipped
    with pytest.raises(LogFormatError, match="unknown iteration field"):
        read_from(FIXTURES / f"{name}.txt", fields=("lm_los",))


def test_our_trainers_lines_parse_back_to_what_it_printed():
    line = iteration_line(iteration=7, train_iters=40, consumed_samples=56, consumed_tokens=56 * 32,
                          seconds_per_iteration=0.123, learning_rate=2.5e-4, global_batch_size=8, lm_loss=6.54321,
                          loss_scale=65536.0, grad_norm=1.25, skipped_iterations=1, nan_iterations=2, tflops=0.01)
    record = parse_iteration_line("[default0]:" + line)
    # A multi-node job's main_log.txt: srun --label's task id before torchrun's prefix, the same record with its rank
    # right after its kind (ids padded to the widest one's width too).
    assert parse_iteration_line("1: [default0]:" + line) == {"kind": "iteration", "rank": 1, **record}
    assert parse_iteration_line(" 1: [default0]:" + line) == parse_iteration_line("1: [default0]:" + line)
    assert record == {"kind": "iteration", "iteration": 7, "train_iters": 40, "consumed_samples": 56,
                      "consumed_tokens": 1792, "elapsed_time_per_iteration_s": 0.12, "learning_rate": 2.5e-4,
                      "global_batch_size": 8, "lm_loss": 6.54321, "loss_scale": 65536.0, "grad_norm": 1.25,
                      "num_zeros": 0.0, "skipped_iterations": 1, "nan_iterations": 2,
                      "samples_per_second": 65.041, "tflops": 0.01}  # 8 / 0.123
    dashes, text, _ = validation_lines("iteration 7", 3.0)
    assert parse_line(dashes) is None
    assert parse_line(text) == {k: v for k, v in parse_line("1: [default0]:" + text).items() if k != "rank"} == {
        "kind": "validation", "iteration": 7, "dataset": "validation", "where": "iteration 7",
        "validation_lm_loss": 3.0, "validation_ppl": float(f"{math.exp(3.0):.6E}")}


def test_restart_segments_and_the_timeline_keeps_the_rerun():
    records = read_from(FIXTURES / "restart.txt").records
    segments = split_segments(records)
    assert [[r["iteration"] for r in s if r["kind"] == "iteration"][::10] for s in segments] == [
        [10, 110, 210], [210, 310]]
    assert [r["iteration"] for r in segments[0] if r["kind"] == "validation"] == [100, 200, 300]
    line = timeline(records)
    assert [r["iteration"] for r in line] == list(range(10, 401, 10))
    by_iteration = {r["iteration"]: r for r in line}
    # the first job's 210-300 were re-run after the resume from global_step200: the re-run's values win
    assert by_iteration[250]["lm_loss"] == pytest.approx(8 * math.exp(-250 / 150) + 3.01, abs=1e-6)
    assert by_iteration[200]["lm_loss"] == pytest.approx(8 * math.exp(-200 / 150) + 3.0, abs=1e-6)


def two_ranks_log(blocks: int = 1) -> str:
    """A multi-node job's main_log.txt where both srun tasks print iteration lines (a trainer that logs on every
    node): iterations 1-10, then the chain's next job resumes from the checkpoint at 5 and runs 6-12. Each job's lines
    of both ranks interleave ``blocks`` lines at a time (srun forwards each node's output as it comes); lm loss tells
    the rank (+0.001 on rank 1) and the job (+0.5 on the second)."""
    lines = []
    for job, iterations in enumerate((range(1, 11), range(6, 13))):
        lines.append(f"[opskit] 2024-01-01 00:00:0{job} job {7 + job} (array task 7_{job}) nodes n[1-2]: start")
        by_rank = [[f"{rank}: [default0]:" + iteration_line(
            iteration=i, train_iters=12, consumed_samples=8 * i, consumed_tokens=256 * i, seconds_per_iteration=0.5,
            learning_rate=1e-4, global_batch_size=8, lm_loss=5 - 0.1 * i + 0.5 * job + 0.001 * rank,
            loss_scale=None, grad_norm=1.0, skipped_iterations=0, nan_iterations=0, tflops=1.0)
            for i in iterations] for rank in (0, 1)]
        for start in range(0, len(iterations), blocks):
            lines += by_rank[0][start:start + blocks] + by_rank[1][start:start + blocks]
        lines.append(f"1: [default0]:{validation_lines('iteration 10', 4.0)[1]}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("blocks", [1, 3])
def test_ranks_that_all_print_iteration_lines_restart_once_where_they_all_go_back(blocks):
    records = read_from_text(two_ranks_log(blocks)).records
    assert {r["rank"] for r in records} == {0, 1}
    segments = split_segments(records)
    assert [sorted({r["iteration"] for r in s}) for s in segments] == [list(range(1, 11)), list(range(6, 13))]
    line = timeline(records)
    assert [r["iteration"] for r in line] == list(range(1, 13))  # one record per iteration
    assert {r["rank"] for r in line} == {0}  # one rank's: the one whose line came first
    assert [r["lm_loss"] for r in line] == pytest.approx([5 - 0.1 * i + 0.5 * (i > 5) for i in range(1, 13)])


def test_restart_rule_with_ranks_matches_its_definition_at_once_and_one_record_at_a_time():
    import numpy as np

    from opskit.logs.parse import UNLABELLED, restart_indices

    def defined(iterations, ranks):
        """A restart: the iteration <= that of the last record of its rank since the last restart, an unlabelled
        record counting as every rank's."""
        restarts, before_any, previous = [], None, {}  # previous: rank -> iteration; None: the last unlabelled one
        for i, (iteration, rank) in enumerate(zip(iterations, ranks, strict=True)):
            before = before_any if rank is None else previous.get(rank, previous.get(None))
            if before is not None and iteration <= before:
                restarts.append(i)
                previous = {}
            previous = {None: iteration} if rank is None else {**previous, rank: iteration}
            before_any = iteration
        return restarts

    rng = np.random.default_rng(15)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        iterations = rng.integers(0, 12, n).tolist()
        ranks = rng.choice([None, 0, 1, 2], n).tolist() if rng.random() < 0.7 else [rng.choice([None, 3])] * n
        codes = np.array([UNLABELLED if r is None else r for r in ranks], dtype=np.int64)
        expected = defined(iterations, ranks)
        assert restart_indices(iterations, ranks) == restart_indices(np.array(iterations, dtype=np.int64),
                                                                     codes) == expected
    # one printer, labelled or not: where the iteration goes back, as without ranks
    assert restart_indices([1, 2, 2, 1, 5], [4] * 5) == restart_indices([1, 2, 2, 1, 5]) == [2, 3]
    # an unlabelled job's lines, then a labelled job that resumed before their end: a restart
    assert restart_indices([1, 2, 3, 2, 2, 3], [None, None, None, 0, 1, 0]) == [3]


@pytest.mark.parametrize("bulk", [False, True])
def test_cli_parse_gives_two_ranks_lines_their_rank_and_one_restart(tmp_path, monkeypatch, bulk):
    from opskit.logs import parse

    log = tmp_path / "main_log.txt"
    log.write_text(two_ranks_log(blocks=2))
    if bulk:
        monkeypatch.setattr(parse, "_BULK_MIN", 1)  # polars builds the common lines column-wise
    rows = [json.loads(line) for line in invoke("logs", "parse", str(log)).stdout.splitlines()]
    # segment = the job: its lines as written, both ranks' (two at a time), one restart where both went back
    assert [(r["segment"], r["rank"], r["iteration"]) for r in rows if r["kind"] == "iteration"] == [
        (job, rank, i) for job, iterations in enumerate((range(1, 11), range(6, 13)))
        for start in range(0, len(iterations), 2) for rank in (0, 1) for i in iterations[start:start + 2]]
    assert list(rows[0])[:5] == ["file", "segment", "kind", "rank", "iteration"]
    header = invoke("logs", "parse", str(log), "--format", "csv").stdout.splitlines()[0]
    assert header.startswith("file,segment,kind,rank,iteration,")


def test_incremental_reads_return_only_new_complete_lines(tmp_path):
    lines = (FIXTURES / "tr11-176B-spike.txt").read_text().splitlines(keepends=True)
    log = tmp_path / "main_log.txt"
    log.write_text("".join(lines[:50]))
    first = read_from(log)
    assert first.offset == log.stat().st_size
    assert [r["iteration"] for r in first.records] == list(range(31100, 31149))  # line 0 is a comment

    partial = lines[51][:120]
    with open(log, "a") as f:
        f.write(lines[50] + partial)
    second = read_from(log, first.offset)
    assert [r["iteration"] for r in second.records] == [31149]  # the partial 31150 waits for its newline
    assert second.offset == log.stat().st_size - len(partial.encode())
    assert second.skipped == 0

    with open(log, "a") as f:
        f.write(lines[51][120:])
    third = read_from(log, second.offset)
    assert [r["iteration"] for r in third.records] == [31150]
    assert third.records == read_from(FIXTURES / "tr11-176B-spike.txt").records[50:51]
    assert read_from(log, third.offset).records == []

    log.write_text("".join(lines[:3]))  # replaced by a shorter file: read from the start again
    again = read_from(log, third.offset)
    assert again.rewound and [r["iteration"] for r in again.records] == [31100, 31101]


def test_tail_reads_only_the_end_of_a_large_log(tmp_path):
    body = (FIXTURES / "restart.txt").read_text()
    log = tmp_path / "big.log"
    log.write_text(body * 200 + "partial line without newline")
    tail = read_tail(log, 5)
    everything = read_from(log)
    assert tail.iterations[-5:] == everything.iterations[-5:]
    assert len(tail.records) < len(everything.records) / 20  # it did not read the whole file
    assert tail.offset == everything.offset


def test_tail_counts_iteration_records_not_lines_with_the_word(tmp_path):
    # Lines that name an iteration without being iteration lines (saves, loads) outnumber the iteration lines near
    # the end: reading only as far as the word's count reaches would give too few records.
    def line(i: int) -> str:
        return iteration_line(iteration=i, train_iters=1000, consumed_samples=64 * i, consumed_tokens=65536 * i,
                              seconds_per_iteration=1.0, learning_rate=1e-4, global_batch_size=64, lm_loss=2.0,
                              loss_scale=None, grad_norm=1.0, skipped_iterations=0, nan_iterations=0, tflops=100.0)

    lines = [line(i) for i in range(1, 401)]
    lines += [f"[default0]:saving checkpoint at iteration {i:7d} to /ckpt" for i in range(20000)]
    lines += [line(i) for i in range(401, 411)]
    log = tmp_path / "main_log.txt"
    log.write_text("\n".join(lines) + "\n")
    tail = read_tail(log, 100)
    assert [r["iteration"] for r in tail.iterations[-100:]] == list(range(311, 411))
    # where the last lines are iteration lines, only the lines from the n-th last one on are read
    assert [r["iteration"] for r in read_tail(log, 7).records] == list(range(404, 411))


def test_spike_found_at_the_tr11_chronicles_range():
    spikes = find_spikes(timeline(read_from(FIXTURES / "tr11-176B-spike.txt").records))
    assert [(s.metric, s.first, s.last, s.peak_iteration, s.recovered_at) for s in spikes] == [
        ("grad_norm", 31215, 31222, 31219, 31250), ("lm_loss", 31216, 31222, 31219, 31250)]
    assert spikes[1].peak == 5.098124 and spikes[1].baseline == pytest.approx(2.21, abs=0.01)
    # "the iteration 31215-31250 spike", SAVE_INTERVAL=100 at the time
    (fix,) = remedies(spikes, save_interval=100)
    assert (fix.first, fix.end, fix.checkpoint, fix.skip_range) == (31215, 31249, "global_step31200", "31201-31249")
    (fix,) = remedies(spikes, checkpoints=[30900, 31000, 31300])  # what is on disk comes first
    assert (fix.checkpoint, fix.skip_range) == ("global_step31000", "31001-31249")
    assert remedies(spikes)[0].checkpoint is None


def test_no_spike_in_a_smooth_run_and_nan_is_always_one():
    records = timeline(read_from(FIXTURES / "restart.txt").records)
    assert find_spikes(records, SpikeConfig(min_history=5)) == []
    records[30] = {**records[30], "lm_loss": float("nan")}
    (spike,) = find_spikes(records, SpikeConfig(min_history=5))
    assert (spike.metric, spike.first, spike.recovered_at) == ("lm_loss", records[30]["iteration"],
                                                               records[31]["iteration"])


def test_the_rule_value_by_value_acts_on_a_spike_that_stays_not_on_tr11s_that_recovered():
    """SpikeWatch (the trainer's divergence check, issue 48) on tr11's log around 31216: the spike came back within
    the band by 31250 (35 iterations), so with a patience of 50 there is never anything to act on; with a patience of 5
    it would have been acted on at 31220. A NaN is acted on at once."""
    records = [r for r in timeline(read_from(FIXTURES / "tr11-176B-spike.txt").records) if r["kind"] == "iteration"]

    def first_action(patience: int, rows: list[dict]) -> tuple[int, str, int] | None:
        watch = SpikeWatch()
        for record in rows:
            watch.add(record["iteration"], record)
            spike = watch.unrecovered(record["iteration"], patience)
            if spike is not None:
                return record["iteration"], spike.metric, spike.first
        return None

    assert first_action(50, records) is None
    assert first_action(5, records) == (31220, "grad_norm", 31215)
    at = len(records) // 2
    nan = [*records[:at], {**records[at], "lm_loss": float("nan")}, *records[at + 1:]]
    assert first_action(10**6, nan) == (records[at]["iteration"], "lm_loss", records[at]["iteration"])
    watch = SpikeWatch()
    for record in records:
        watch.add(record["iteration"], record)
    assert sorted(watch.closed + watch.open, key=lambda s: (s.first, s.metric)) == find_spikes(records)  # logs spikes


def test_eta_is_the_tr11_chronicles_arithmetic(monkeypatch, tmp_path):
    record = parse_iteration_line(fixture_line("malformed.txt", 12695))  # seed 004's line
    # "we need 125 days more `(115311-12695)*105/(3600*24)=124.7`"
    by_hand = progress([record], seconds_per_iteration=105)
    assert by_hand.days_left == (115311 - 12695) * 105 / (3600 * 24)
    assert round(by_hand.days_left, 1) == 124.7
    from_log = progress([record])
    assert from_log.seconds_per_iteration == 105.22 and round(from_log.days_left) == 125
    # "We consumed 20B/450B tokens": from the log alone, and from the spec (220M samples x 2048)
    assert from_log.consumed_tokens // 10**9 == 20 and from_log.planned_tokens // 10**9 == 450
    assert from_log.planned_tokens == 20155564032 + (115311 - 12695) * 2048 * 2048
    monkeypatch.setenv("six_ALL_CCFRSCRATCH", str(tmp_path))
    from opskit.history.sources import from_spec

    source = from_spec("tr11-176B-ml")
    assert (source.planned_tokens, source.save_interval) == (220_000_000 * 2048, 100)
    assert progress([record], planned_tokens=source.planned_tokens).planned_tokens_source == "spec"


def test_follow_prints_the_end_then_appended_lines_and_survives_replacement(tmp_path):
    log = tmp_path / "run" / "logs" / "main_log.txt"
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\nthree\n")
    appends = iter(["four\nfi", "ve\n", None])

    def sleep(_):
        text = next(appends)
        if text is None:  # opskit sync replaces the file by a longer copy
            staged = log.with_name(".staged")
            staged.write_text(log.read_text() + "six\n")
            staged.replace(log)
        else:
            with open(log, "a") as f:
                f.write(text)

    assert list(follow(log, 2, 0.0, sleep, polls=3)) == ["two", "three", "four", "five", "six"]
    assert published_key(log) == "logs/main_log.txt"


def test_cli_parse_jsonl_and_csv():
    done = invoke("logs", "parse", str(FIXTURES / "restart.txt"), str(FIXTURES / "malformed.txt"))
    assert done.exit_code == 0
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 55 + 5
    assert {r["segment"] for r in rows if r["file"].endswith("restart.txt")} == {0, 1}
    assert "malformed.txt: 5 iteration/validation line(s) skipped" in done.output
    done = invoke("logs", "parse", str(FIXTURES / "malformed.txt"), "--format", "csv")
    header, *lines = [line for line in done.stdout.splitlines() if "," in line]
    assert header.endswith(",extra.moe_loss,extra.router") and len(lines) == 5
    assert invoke("logs", "parse", str(FIXTURES / "malformed.txt"), "--format", "xml").exit_code == 1


def test_cli_show_progress_and_spikes_json():
    done = invoke("logs", "show", str(FIXTURES / "tr11-176B-spike.txt"), "--last", "3")
    assert done.exit_code == 0
    assert "progress: iteration 31,251 of 115,311 (27.1%), 84,060 left" in done.stdout
    assert "tokens: 98.0B consumed / 450.6B planned (estimated from the log), 21.7%" in done.stdout
    shown = json.loads(invoke("logs", "show", str(FIXTURES / "tr11-176B-spike.txt"), "--json").stdout)
    assert [r["iteration"] for r in shown["records"]][-3:] == [31222, 31250, 31251]
    assert shown["progress"]["iterations_left"] == 115311 - 31251
    result = json.loads(invoke("logs", "spikes", str(FIXTURES / "tr11-176B-spike.txt"), "--save-interval", "100",
                               "--json").stdout)
    assert [r["skip_range"] for r in result["remedies"]] == ["31201-31249"]
    done = invoke("logs", "spikes", str(FIXTURES / "tr11-176B-spike.txt"), "--save-interval", "100")
    assert "roll back to global_step31200 and restart with --skip-train-iteration-range 31201-31249" in done.stdout


@pytest.fixture(scope="module")
def event_dir(tmp_path_factory) -> Path:
    """Real event files, written by the trainer's own TensorBoard class (Megatron's tags)."""
    from opskit.train.log import TensorBoard

    folder = tmp_path_factory.mktemp("tb") / "tb-run"
    board = TensorBoard(str(folder), 10, True)
    for it in range(1, 121):
        board.iteration(it, it * 16, it * 16 * 512, 3e-4, 16, 6.0 - it / 100, 0.5, None)
    board.validation(100, 1600, 1600 * 512, 4.9, log_ppl=True)
    board.close()
    return folder


def test_tensorboard_event_folder_reads_back(event_dir):
    from opskit.logs.tensorboard import read_event_dir

    records = read_event_dir(event_dir)
    iterations = [r for r in records if r["kind"] == "iteration"]
    assert [r["iteration"] for r in iterations] == list(range(1, 121))
    assert iterations[9]["lm_loss"] == pytest.approx(5.9) and iterations[9]["consumed_tokens"] == 10 * 16 * 512
    assert [(r["iteration"], r["validation_lm_loss"]) for r in records if r["kind"] == "validation"] == [
        (100, pytest.approx(4.9))]


def test_show_and_tail_refuse_an_event_folder_in_one_line(event_dir):
    for command in ("show", "tail"):
        done = invoke("logs", command, str(event_dir))
        assert done.exit_code == 1
        assert done.output == (f"error: {event_dir}: a TensorBoard event folder; `opskit logs {command}` reads text "
                               "logs (plot and spikes read event folders)\n")
    done = invoke("logs", "spikes", str(event_dir), "--json")
    assert json.loads(done.stdout)["spikes"] == []  # a smooth, linear loss


def test_plot_png_draws_one_line_per_run_with_its_colour(event_dir, tmp_path):
    from PIL import Image

    from opskit.logs.plot import COLORS

    out = tmp_path / "plots" / "loss.png"
    done = invoke("logs", "plot", str(FIXTURES / "restart.txt"), str(FIXTURES / "tr8b-104B.txt"), str(event_dir),
                  "--smooth", "2", "--log-y", "--out", str(out))
    assert done.exit_code == 0, done.output
    image = Image.open(out).convert("RGB")
    assert image.size == (1200, 675)
    counts = {colour: n for n, colour in image.getcolors(maxcolors=1 << 24)}
    for colour in COLORS[:3]:  # restart, tr8b-104B, the event folder, in legend order
        assert counts.get(tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5)), 0) > 50, colour
    assert counts.get(tuple(int(COLORS[3][i:i + 2], 16) for i in (1, 3, 5)), 0) == 0  # no fourth line


def test_plot_refuses_a_run_with_nothing_in_range_and_pipes_without_out(tmp_path):
    done = invoke("logs", "plot", str(FIXTURES / "tr8b-104B.txt"), "--range", "0:400", "--out",
                  str(tmp_path / "x.png"))
    assert done.exit_code == 1 and "no 'lm_loss' values with an x (iteration) in range" in done.output
    done = invoke("logs", "plot", str(FIXTURES / "restart.txt"))
    assert done.exit_code == 1 and "give --out plot.png" in done.output


def test_plot_series_smooths_ranges_and_reads_extra_fields():
    from opskit.logs.parse import record_columns
    from opskit.logs.plot import make_series, metric_value, parse_range

    records = read_from(FIXTURES / "malformed.txt").iterations
    moe = record_columns(records, ("extra.moe_loss",), metric_value)
    assert make_series("m", moe, "iteration", "extra.moe_loss").y == [0.0125]
    line = timeline(read_from(FIXTURES / "restart.txt").records)
    series = make_series("r", record_columns(line, ("consumed_tokens", "lm_loss")), "tokens", "lm_loss",
                         parse_range("81920:245760"), smooth=2)
    assert series.x == [81920, 163840, 245760]  # iterations 10, 20, 30: 16 samples x 512 tokens each
    losses = [r["lm_loss"] for r in line if 81920 <= r["consumed_tokens"] <= 245760]
    assert series.y == [losses[0], (losses[0] + losses[1]) / 2, (losses[1] + losses[2]) / 2]
    with pytest.raises(LogFormatError, match="--range 5-9: expected A:B"):
        parse_range("5-9")


def test_run_series_resolve_restarts_place_validation_and_mark_spikes():
    from opskit.history.sources import resolved
    from opskit.logs.plot import run_series

    skipped = []
    logs = [str(FIXTURES / name) for name in ("restart.txt", "tr11-176B-spike.txt", "tr8b-104B.txt")]
    restart, spike, wrapped = run_series(resolved(logs),
                                         "iteration", "loss", on_skipped=lambda item, n: skipped.append((item, n)))
    assert [restart.name, spike.name, wrapped.name] == ["restart", "tr11-176B-spike", "tr8b-104B"]
    assert restart.x == list(range(10, 401, 10)) and restart.y[29] == 4.092682  # the resumed 210-300 replace the old
    assert spike.markers == [(31219, 5.098124)]  # the chronicle's spike, at its peak
    assert skipped == [(str(FIXTURES / "tr8b-104B.txt"), 1)]  # its wrapped line
    [validation] = run_series(resolved([str(FIXTURES / "restart.txt")]), "tokens", "val_loss")
    assert validation.x[:2] == [819200, 1638400]  # validation lines carry no tokens: those of iterations 100, 200


@pytest.mark.timeout(60)  # a tail that never prints would otherwise hang the suite
def test_cli_tail_follows_the_published_copy(tmp_path):
    """`opskit logs tail RUN --remote file://...` as a user runs it: the last lines, then what sync adds."""
    import subprocess
    import sys

    run, published = tmp_path / "run", tmp_path / "pub"
    for folder in (run, published):
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "main_log.txt").write_text("old\nlast\n")
    proc = subprocess.Popen([sys.executable, "-m", "opskit.cli.app", "logs", "tail", str(run), "--remote",
                             f"file://{published}", "-n", "1", "--interval", "0.1"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "last\n"
        with open(published / "logs" / "main_log.txt", "a") as f:
            f.write("[default7]: iteration 1/ 2 | lm loss: 1.0 |\n")
        assert proc.stdout.readline() == "[default7]: iteration 1/ 2 | lm loss: 1.0 |\n"
    finally:
        proc.kill()
        proc.wait()


_BOUNDED_READS = r'''
import json, sys, time
from pathlib import Path
from typer.testing import CliRunner
from opskit.cli.app import app
from opskit.logs import follow, parse
from opskit.run.paths import RunPaths
from opskit.monitor.snapshot import read_log
from opskit.monitor.watch_state import WatchdogState

log = Path(sys.argv[1])
began = time.monotonic()
whole = parse.read_from(log)
columnar = parse.read_from(log, columnar=True)  # the bulk (polars) path: the file is over 16 MiB
tail = parse.read_tail(log, 200)
status = read_log(RunPaths(log.parent.parent), WatchdogState())  # what `opskit status` reads
shown = CliRunner().invoke(app, ["logs", "show", str(log), "--json"])
print(json.dumps({
    "iterations": len(whole.iterations), "long_lines": whole.long_lines, "lines": whole.lines,
    "offset": whole.offset, "summary": whole.summary("log"),
    "columnar": sum(t.height for t in columnar.tables) + len(columnar.iterations),
    "tail": len(tail.iterations), "tail_long": tail.long_lines,
    "first": parse.first_iteration(log)["iteration"],
    "last_lines": follow.last_lines(log, 3)[0], "new_lines": len(follow.new_lines(log, 0)[0]),
    "status": len(status.new), "show": [shown.exit_code, json.loads(shown.stdout)["records"][-1]["iteration"]],
    "seconds": time.monotonic() - began,
    # VmHWM: this process's own peak; ru_maxrss also keeps the forking parent's (pytest's) from before the exec
    "peak_mb": int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024}))
'''


def test_a_long_run_without_newline_is_skipped_in_bounded_memory_and_time(tmp_path):
    """Issue 31 item 13: a sparse hole (`truncate -s 2G f; cat good.log >> f`) before and between real lines: every
    reader skips it (counted), parses the lines after it, in linear time and bounded memory (peak RSS measured)."""
    good = (FIXTURES / "tr11-176B-spike.txt").read_bytes()
    hole = 64 << 20
    log = tmp_path / "run" / "logs" / "main_log.txt"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:  # hole, lines, hole, lines: sparse, so cheap on disk
        f.truncate(hole)
        f.seek(hole)
        f.write(good)
        f.truncate(2 * hole + len(good))
        f.seek(2 * hole + len(good))
        f.write(good)
    assert os.stat(log).st_size == 2 * (hole + len(good))  # each hole far over the 1 MiB cap (parse.MAX_LINE)
    done = subprocess.run([sys.executable, "-c", _BOUNDED_READS, str(log)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    its = len(read_from(FIXTURES / "tr11-176B-spike.txt").iterations)
    assert (got["iterations"], got["columnar"], got["long_lines"]) == (2 * its, 2 * its, 2), got
    # the hole has no newline: it ends with the first line of what was appended (a comment line of the fixture)
    assert got["lines"] == 2 * good.count(b"\n") and got["offset"] == os.stat(log).st_size
    assert got["summary"] == "log: 2 line(s) longer than 1 MiB skipped (no newline for that long: a sparse hole or " \
        "binary data?)"
    assert got["tail"] >= 200 and got["tail_long"] == 1  # read back over the second hole only
    last = good.decode().splitlines()
    assert got["last_lines"] == last[-3:] and got["new_lines"] == 2 * (len(last) - 1)  # less the holes' lines
    assert got["first"] == fixture_first_iteration() and got["status"] == 2 * its
    assert got["show"] == [0, read_from(FIXTURES / "tr11-176B-spike.txt").iterations[-1]["iteration"]]
    assert got["peak_mb"] < 300, got
    assert got["seconds"] < 30, got  # ~1-3 s measured on 2 shared cores; the quadratic read took minutes


def fixture_first_iteration() -> int:
    return read_from(FIXTURES / "tr11-176B-spike.txt").iterations[0]["iteration"]


def test_logs_show_reads_a_gzip_log(tmp_path):
    """Issue 31 item 15a: a .gz log is read as its text; a corrupt one is one line."""
    import gzip

    plain = FIXTURES / "tr11-176B-spike.txt"
    packed = tmp_path / "main_log.txt.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    done = invoke("logs", "show", str(packed), "--json")
    assert done.exit_code == 0, done.output
    expected = json.loads(invoke("logs", "show", str(plain), "--json").stdout)
    assert json.loads(done.stdout)["records"] == expected["records"] and expected["records"]
    assert read_from(packed).records == read_from(plain).records
    packed.write_bytes(gzip.compress(plain.read_bytes())[:200])  # cut short
    done = runner.invoke(app, ["logs", "show", str(packed)])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert f"{packed}: gzip: cannot decompress (truncated)" in done.output
