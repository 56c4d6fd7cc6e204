"""`opskit logs parse`'s columnar writer (records kept as polars columns to the output) writes, byte for byte, what
json.dumps / csv.writer write for the records built one dict at a time (issue 19)."""

from __future__ import annotations

import io
import math
import random
import re

import pytest
from test_logs_bulk import LINE_2021, LINE_2022, ODD

from opskit.logs import parse
from opskit.logs.export import write_csv, write_files, write_jsonl
from opskit.logs.parse import read_from, split_segments


def _varied_lines() -> list[str]:
    """Common lines of both formats (values over every magnitude repr and polars might spell differently, NaN and
    infinities), a restart, validation lines, and every odd line of the bulk path's tests between them."""
    rng, lines = random.Random(19), []
    for i in range(3000):
        magnitude = 10 ** rng.uniform(-12, 20) * rng.choice((1, -1))
        loss = rng.choice([f"{magnitude:.6E}", repr(magnitude), "nan", "inf", "-inf", "0.0", "-0.0", "1e-05",
                           "2e-07", "5.969E-05"]) if i % 7 == 0 else f"{2 + rng.random():.6E}"
        line = LINE_2022 if i % 11 else LINE_2021
        line = line.replace("31217/", f"{i if i < 2000 else i - 500}/").replace("168000/", f"{i}/")
        line = line.replace("lm loss: 2.241558E+00", f"lm loss: {loss}").replace("lm loss: 2.376641E+00",
                                                                                 f"lm loss: {loss}")
        lines.append(line.replace("learning rate: 5.279E-05", f"learning rate: {rng.uniform(0, 1e-3):.3E}"))
        if i % 97 == 0:
            lines.append(ODD[i // 97 % len(ODD)])
        if i % 500 == 0:
            lines.append(f"[default7]: validation loss at iteration {i} | lm loss value: 2.342049E+00 | "
                         "lm loss PPL: 1.040253E+01 | ")
    return lines


def _old_way(files: list, output_format: str) -> str:
    """What `opskit logs parse` wrote before: one dict per record, from the per-line parser."""
    rows = [{"file": str(path), "segment": segment, **r} for path in files
            for segment, records in enumerate(split_segments(parse.parse_text(
                path.read_bytes().decode("utf-8", errors="replace")).records)) for r in records]
    out = io.StringIO()
    (write_jsonl if output_format == "jsonl" else write_csv)(rows, out)
    return out.getvalue()


@pytest.mark.parametrize("output_format", ["jsonl", "csv"])
def test_columnar_output_is_byte_identical_to_the_records_written_one_by_one(tmp_path, monkeypatch, output_format):
    varied = tmp_path / "main_log.txt"
    data = ("\n".join(_varied_lines()) + "\n").encode()
    varied.write_bytes(data.replace(b"iteration 5/ 9", b"iteration 5/ 9 \xff\xfe") + b"[default7]: iteration "
                       b"3001/ 9 | lm loss: \xe91.0 |\n" + LINE_2022.replace("31217/", "3002/").encode() + b"\n")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    no_iterations = tmp_path / "startup.txt"
    no_iterations.write_bytes(b"using world size: 384\n[default0]:saving checkpoint at iteration 100 to /ckpt\n"
                              b"caf\xe9\n")
    monkeypatch.setattr(parse, "_BULK_MIN", 1)  # every read takes the bulk path, in several blocks
    monkeypatch.setattr(parse, "_BULK_BLOCK", 256 << 10)
    files = [varied, empty, no_iterations, varied]
    chunks = [(str(path), read_from(path, columnar=True)) for path in files]
    assert sum(table.height for table in chunks[0][1].tables) > 2500  # the common lines stayed columns
    out = io.StringIO()
    write_files(chunks, output_format, out)
    expected = _old_way(files, output_format)
    assert out.getvalue() == expected
    restart = '"segment": 1, "kind": "iteration"' if output_format == "jsonl" else ",1,iteration,"
    special = ("NaN", "-Infinity") if output_format == "jsonl" else ("nan", "-inf")
    assert "e-05" in expected and "e-07" in expected and all(text in expected for text in special)
    assert restart in expected


@pytest.mark.parametrize("output_format", ["jsonl", "csv"])
def test_columnar_output_to_a_byte_stream_splits_one_table_at_each_restart(tmp_path, monkeypatch, output_format):
    # Three restarts inside one block (one table): each part of the table gets its own segment; the lines go as
    # bytes straight to a UTF-8 stream's buffer, after the text the stream already holds (csv's header).
    iterations = [*range(100, 400), *range(150, 300), *range(290, 500), *range(10, 200)]
    lines = [LINE_2022.replace("31217/", f"{i}/").replace("learning rate: 5.279E-05",
                                                          f"learning rate: {i * 1e-8:.3E}") for i in iterations]
    lines[500:500] = ["[default7]: validation loss at iteration 200 | lm loss value: 2.3E+00 | lm loss PPL: 9.9 | ",
                      "[default7]: iteration 7/ 9 | lm loss: caf\u00e9 |", ODD[0]]
    log = tmp_path / "main_log.txt"
    log.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(parse, "_BULK_MIN", 1)
    chunk = read_from(log, columnar=True)
    assert max(table.height for table in chunk.tables) > 800  # restarts inside one table
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="")
    write_files([(str(log), chunk)], output_format, stream)
    stream.flush()
    expected = _old_way([log], output_format)
    assert stream.buffer.getvalue().decode() == expected
    assert ('"segment": 3, "kind"' if output_format == "jsonl" else ",3,iteration,") in expected


def _two_ranks_lines() -> list[str]:
    """A job's unlabelled lines (1-400), then a multi-node chain whose two srun tasks both print iteration lines,
    their output interleaved in blocks of 1-40 lines: iterations 401-1500, and a resume that re-runs 1001-2000. The
    loss tells the rank; every 97th line an odd one, labelled; validation lines of both ranks."""
    rng, lines = random.Random(31), [LINE_2022.replace("31217/", f"{i}/") for i in range(1, 401)]
    for iterations in (range(401, 1501), range(1001, 2001)):
        by_rank = [[f"{rank}: " + LINE_2022.replace("31217/", f"{i}/").replace(
            "lm loss: 2.241558E+00", f"lm loss: {2 + rank / 10 + rng.random() / 100:.6E}") for i in iterations]
            for rank in (0, 1)]
        while by_rank[0] or by_rank[1]:
            rank = rng.randrange(2)
            take = rng.randint(1, 40)
            lines += by_rank[rank][:take]
            del by_rank[rank][:take]
            if rng.random() < 0.05:
                lines.append(f"{rank}: [default7]: validation loss at iteration {iterations[0]} | lm loss value: "
                             "2.342049E+00 | lm loss PPL: 1.040253E+01 | ")
    lines[::97] = [f"1: {ODD[i % len(ODD)]}" for i in range(len(lines[::97]))]
    return lines


@pytest.mark.parametrize("output_format", ["jsonl", "csv"])
def test_columnar_output_of_two_printing_ranks_is_the_records_written_one_by_one(tmp_path, monkeypatch,
                                                                                 output_format):
    from opskit.history.sources import resolve
    from opskit.logs.parse import record_columns, timeline

    log = tmp_path / "main_log.txt"
    log.write_text("\n".join(_two_ranks_lines()) + "\n")
    monkeypatch.setattr(parse, "_BULK_MIN", 1)  # the bulk path, in several blocks
    monkeypatch.setattr(parse, "_BULK_BLOCK", 64 << 10)
    chunk = read_from(log, columnar=True)
    assert sum(table.height for table in chunk.tables if "rank" in table.columns) > 3000
    assert sum(table.height for table in chunk.tables if "rank" not in table.columns) > 300
    out = io.StringIO()
    write_files([(str(log), chunk)], output_format, out)
    assert out.getvalue() == _old_way([log], output_format)
    assert ('"kind": "iteration", "rank": 1, "iteration"' if output_format == "jsonl" else
            "file,segment,kind,rank,iteration,") in out.getvalue()
    # the columnar timeline (plot, spikes) keeps what timeline() keeps: one record per iteration, one rank's
    old = parse.parse_text(log.read_text()).records
    keys = ("lm_loss", "grad_norm")
    line = {key: list(column) for key, column in resolve(str(log)).timeline(keys, chunk).items()}
    assert line == record_columns(timeline(old), keys)
    assert len(line["iteration"]) == len(set(line["iteration"])) > 1500


@pytest.mark.parametrize("output_format", ["jsonl", "csv"])
def test_files_without_column_wise_records_are_written_as_before(tmp_path, output_format):
    log = tmp_path / "small.txt"
    log.write_text("\n".join([LINE_2022, *ODD, LINE_2021]) + "\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    chunks = [(str(path), read_from(path, columnar=True)) for path in (log, empty)]
    assert not any(chunk.tables for _, chunk in chunks)  # small reads: the per-line parser, no polars
    out = io.StringIO()
    write_files(chunks, output_format, out)
    assert out.getvalue() == _old_way([log, empty], output_format)


def _walked_spikes(records: list[dict], config) -> list[dict]:
    """The spikes a walk over every value finds: the rule book's :class:`opskit.rules.spike_rule.SpikeWatch`, which the
    trainer's divergence check runs as the iterations come."""
    from opskit.rules.spike_rule import SpikeWatch

    watch = SpikeWatch(config)
    for record in records:
        watch.add(record["iteration"], record)
    return [s.as_json() for s in sorted(watch.closed + watch.open, key=lambda s: (s.first, s.metric))]


@pytest.mark.parametrize("rough_share", [1, 10**9])  # candidates: always the median's bound alone / never
@pytest.mark.parametrize("window,threshold", [(100, 6.0), (10, 3.0), (21, 1.0), (5, 6.0)])
def test_spikes_of_a_long_series_are_those_a_walk_over_every_value_finds(monkeypatch, window, threshold,
                                                                          rough_share):
    from opskit.logs import spikes
    from opskit.logs.spikes import _COLUMNAR_MIN, SpikeConfig, find_spikes

    monkeypatch.setattr(spikes, "_ROUGH_SHARE", rough_share)

    rng, records = random.Random(window), []
    for i in range(_COLUMNAR_MIN + 5000):  # long enough for the column-wise windows
        loss = 2 + rng.gauss(0, 0.02) if rng.random() < 0.7 else round(2 + rng.gauss(0, 0.02), 2)  # ties too
        if rng.random() < 0.002:
            loss *= rng.choice((1.2, 3.0, 10.0))
        if rng.random() < 0.0005:
            loss = rng.choice((math.nan, math.inf, -math.inf))
        records.append({"kind": "iteration", "iteration": i, "lm_loss": loss, "grad_norm": abs(rng.gauss(0.2, 0.03))})
    config = SpikeConfig(window=window, threshold=threshold)
    found = [s.as_json() for s in find_spikes(records, config)]
    assert len(found) > 10 and repr(found) == repr(_walked_spikes(records, config))  # repr: NaN peaks compare


def _varied_log(tmp_path):
    """The varied log of the columnar writer's test, with a moe-loss line (an ``extra`` field) and an iteration
    skipped by an fp16 overflow (no ``lm loss`` field) now and then."""
    lines = _varied_lines()
    lines[1::400] = [line.replace("| grad norm:", "| moe loss: 1.250000E-02 | grad norm:") for line in lines[1::400]]
    lines[3::300] = [re.sub(r"lm loss: [^|]*\| ", "", line) for line in lines[3::300]]
    log = tmp_path / "main_log.txt"
    log.write_bytes(("\n".join(lines) + "\n").encode().replace(b"iteration 5/ 9", b"iteration 5/ 9 \xff\xfe"))
    return log


@pytest.mark.parametrize("fields", [None, ("lm_loss", "grad_norm", "consumed_tokens")])
def test_plot_and_spikes_read_from_columns_what_the_records_give(tmp_path, monkeypatch, fields):
    """`opskit logs plot` / `spikes` read a large log's timeline column-wise: the same values, spikes and plotted
    series as the timeline of records built one dict at a time (the path before issue 19)."""
    import polars as pl

    from opskit.history.sources import resolve, resolved
    from opskit.logs import spikes
    from opskit.logs.parse import as_list, record_columns, timeline
    from opskit.logs.plot import X_AXES, metric_value, run_series

    log = _varied_log(tmp_path)
    monkeypatch.setattr(parse, "_BULK_MIN", 1)  # the bulk path, in several blocks
    monkeypatch.setattr(parse, "_BULK_BLOCK", 256 << 10)
    monkeypatch.setattr(spikes, "_COLUMNAR_MIN", 500)  # polars' windows too
    old = parse.parse_text(log.read_bytes().decode("utf-8", errors="replace"), fields=fields).records
    old_line = timeline(old)
    assert len(split_segments(old)) > 5 and 1000 < len(old_line) < 3000  # restarts replaced iterations
    source = resolve(str(log))
    chunk = source.read(fields)
    assert sum(table.height for table in chunk.tables) > 2500  # the common lines stayed columns
    keys = fields or ("lm_loss", "grad_norm", "consumed_tokens", "learning_rate", "loss_scale", "extra.moe_loss")
    line = source.timeline(keys, chunk, metric_value)
    assert all(isinstance(column, pl.Series) for column in line.values())  # no Python object per value
    listed = {key: as_list(column) for key, column in line.items()}
    assert repr(listed) == repr(record_columns(old_line, keys, metric_value))  # repr: NaN compares
    assert any(v is None for v in listed["lm_loss"]) and any(v is not None for v in listed.get("extra.moe_loss", [0]))
    for config in (spikes.SpikeConfig(), spikes.SpikeConfig(window=20, threshold=2.0)):
        found = spikes.spikes_of(source.timeline(config.metrics, chunk), config)
        assert repr(found) == repr(spikes.find_spikes(old_line, config)) and found
    for x, y in (("iteration", "loss"), ("tokens", "grad_norm"), ("tokens", "val_loss"), ("iteration", "moe_loss")):
        if fields and y == "moe_loss":
            continue
        [series] = run_series(resolved([str(log)]), x, y)
        key, x_key = {"loss": "lm_loss", "val_loss": "validation_lm_loss"}.get(y, y), X_AXES[x]
        if key.startswith("validation"):  # at the x of their iteration in the timeline
            x_at = {r["iteration"]: r.get(x_key) for r in old_line}
            points = [(x_at.get(r["iteration"]), r[key]) for r in old if r["kind"] == "validation"]
        else:
            points = [(r.get(x_key), metric_value(r, key)) for r in old_line]
        points = [(at, value) for at, value in points if at is not None and value is not None]
        assert repr((as_list(series.x), as_list(series.y))) == repr(([at for at, _ in points],
                                                                     [value for _, value in points]))
        assert len(points) > (2 if key.startswith(("validation", "moe")) else 1000)


def test_plot_thins_each_line_to_its_pixel_columns_keeping_their_extremes():
    from opskit.logs.plot import thin

    rng = random.Random(5)
    x = list(range(100_000))
    y = [rng.gauss(2, 0.01) * (10 if rng.random() < 1e-4 else 1) for _ in x]  # spikes one point wide
    y[777] = math.nan
    low, high, columns = -5000.0, 105_000.0, 900
    tx, ty = thin(x, y, low, high, columns)
    assert len(tx) <= 4 * columns + 1 and len(tx) > columns / 2
    at = {value: i for i, value in enumerate(x)}
    kept = [at[value] for value in tx]
    assert kept == sorted(set(kept)) and repr([y[i] for i in kept]) == repr(ty)  # points of the line, in order
    column_of = [min(columns - 1, int((value - low) / (high - low) * columns)) for value in x]
    for column in set(column_of):
        inside = [i for i in range(len(x)) if column_of[i] == column and not math.isnan(y[i])]
        shown = [i for i in kept if column_of[i] == column]
        assert min(y[i] for i in inside) == min(y[i] for i in shown if not math.isnan(y[i]))
        assert max(y[i] for i in inside) == max(y[i] for i in shown if not math.isnan(y[i]))
        assert inside[0] in shown and inside[-1] in shown
    assert 777 in kept and max(ty) == max(y) > 15  # the gap and the highest spike stay
    assert thin(x[:3000], y[:3000], low, high, columns) == (x[:3000], y[:3000])  # few points: as they are
