"""`opskit logs parse`'s columnar writer (records kept as polars columns to the output) writes, byte for byte, what
json.dumps / csv.writer write for the records built one dict at a time (issue 19)."""

from __future__ import annotations

import io
import math
import random

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
    """The spike detector before issue 19: every value walked against its window, one record at a time."""
    from opskit.logs.spikes import Spike, _is_spike, _Window

    found = []
    for metric in config.metrics:
        window, floor, current = _Window(config.window), config.relative_floor(metric), None
        for record in records:
            value = record.get(metric)
            if value is None:
                continue
            flagged, baseline = _is_spike(window, value, config, floor)
            if flagged:
                if current is None:
                    current = [record["iteration"], record["iteration"], record["iteration"], value, baseline, None, 0]
                else:
                    current[1], current[5], current[6] = record["iteration"], None, 0
                    if not value <= current[3]:
                        current[2], current[3] = record["iteration"], value
                continue
            window.add(value)
            if current is not None:
                current[5] = current[5] or record["iteration"]
                current[6] += 1
                if current[6] >= config.merge_gap:
                    found.append(Spike(metric, *current[:6]))
                    current = None
        if current is not None:
            found.append(Spike(metric, *current[:6]))
    return [s.as_dict() for s in sorted(found, key=lambda s: (s.first, s.metric))]


@pytest.mark.parametrize("window,threshold", [(100, 6.0), (10, 3.0), (21, 1.0), (5, 6.0)])
def test_spikes_of_a_long_series_are_those_a_walk_over_every_value_finds(window, threshold):
    from opskit.logs.spikes import _COLUMNAR_MIN, SpikeConfig, find_spikes

    rng, records = random.Random(window), []
    for i in range(_COLUMNAR_MIN + 5000):  # long enough for the column-wise windows
        loss = 2 + rng.gauss(0, 0.02) if rng.random() < 0.7 else round(2 + rng.gauss(0, 0.02), 2)  # ties too
        if rng.random() < 0.002:
            loss *= rng.choice((1.2, 3.0, 10.0))
        if rng.random() < 0.0005:
            loss = rng.choice((math.nan, math.inf, -math.inf))
        records.append({"kind": "iteration", "iteration": i, "lm_loss": loss, "grad_norm": abs(rng.gauss(0.2, 0.03))})
    config = SpikeConfig(window=window, threshold=threshold)
    found = [s.as_dict() for s in find_spikes(records, config)]
    assert len(found) > 10 and repr(found) == repr(_walked_spikes(records, config))  # repr: NaN peaks compare
