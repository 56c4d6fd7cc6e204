"""The bulk (polars) path of read_from gives exactly the per-line parser's records: same values, same key order,
same skipped count, on the chronicles' fixtures, on every kind of odd line, and on random damage to real lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opskit.logs import bulk, parse
from opskit.logs.bulk import scan_blocks

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LINE_2022 = ("[default7]: iteration    31217/  115311 | consumed samples:     47774640 | "
             "consumed tokens:  97842462720 | elapsed time per iteration (s): 106.33 | learning rate: 5.279E-05 | "
             "global batch size:  2048 | lm loss: 2.241558E+00 | grad norm: 15.886 | num zeros: 0.0 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 19.260 | "
             "TFLOPs: 147.46 |")
LINE_2021 = (" iteration   168000/  311541 | consumed samples:    153013584 | "
             "elapsed time per iteration (ms): 13248.2 | learning rate: 1.000E-05 | global batch size:  1024 | "
             "lm loss: 2.376641E+00 | loss scale: 131072.0 | grad norm: 19767.052 | num zeros: 0.0 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 |")
ODD = [
    "",
    "\r",
    LINE_2022 + "\r",  # CRLF
    LINE_2022 + "   ", LINE_2022 + "x",
    LINE_2022[:-40],  # cut inside a field
    LINE_2022[:-1],  # cut just before the last "|"
    LINE_2022.replace("lm loss: 2.241558E+00", "lm loss: NAN"),
    LINE_2022.replace("lm loss: 2.241558E+00", "lm loss: nan"),
    LINE_2022.replace("lm loss: 2.241558E+00", "lm loss: -inf"),
    LINE_2022.replace("global batch size:  2048", "global batch size:  2048.0"),  # an int printed as a float
    LINE_2022.replace("global batch size:  2048", "global batch size:  2_048"),
    LINE_2022.replace("global batch size:  2048", "global batch size:  inf"),
    LINE_2022.replace("global batch size:  2048", "global batch size:  \u0662\u0660"),  # Arabic-Indic digits
    LINE_2022.replace(" TFLOPs: 147.46 |", " TFLOPs: 147.46 | moe loss: 0.0125 | router: top2 |"),  # unknown fields
    LINE_2022.replace("lm loss:", "lm  loss:"),  # odd spacing
    LINE_2022.replace("lm loss: ", "lm loss:"),
    LINE_2022.replace(" | grad norm", " |\tgrad norm"),
    LINE_2022.replace("grad norm: 15.886", "grad norm: 15.886 | grad norm: 16.0"),  # a repeated field
    LINE_2022.replace("31217/", "31217 /"),
    LINE_2022.replace("31217/", "+31217/"),
    LINE_2022.replace("115311 |", "115311/3 |"),
    LINE_2022.replace(" TFLOPs: 147.46 |", " TFLOPs: 147.46 | params norm: 1234.5 | curriculum seqlen: 2048 |"),
    LINE_2022.replace("iteration    31217", "iteration 31217 iteration 5"),
    LINE_2022.replace("[default7]:", "[default7]: saving checkpoint at"),
    LINE_2022.replace("[default7]:", "validation loss at"),
    LINE_2022.replace("[default7]:", '[default7]:"quoted" #'),
    LINE_2022.replace("[default7]:", "[default7]:\x00\x01"),
    LINE_2022 + " | ".join(["x: 1"] * 30) + " |",  # more fields than the columns read
    LINE_2022.replace("lm loss: 2.241558E+00", "lm loss: 2.2415\ufffd58E+00"),
    "[default0]:saving checkpoint at iteration   12700 to /ckpt",
    "[default0]:  successfully loaded checkpoint from /ckpt at iteration 346",
    "[default7]: validation loss at iteration 31000 | lm loss value: 2.342049E+00 | lm loss PPL: 1.040253E+01 | ",
    " validation loss at the end of training for val data | lm loss value: 2.400000E+00 | lm loss PPL: 11.02 | ",
    "[default7]: iteration    127",
    "12: " + LINE_2022,  # srun --label's node prefix before torchrun's (a multi-node job's main_log.txt)
    "1: [default7]: validation loss at iteration 31000 | lm loss value: 2.342049E+00 | lm loss PPL: 1.040253E+01 | ",
    "[default3]:NCCL WARN Call to ibv_reg_mr failed | iteration 5/10 |",
    LINE_2021,
    LINE_2021.replace("13248.2", "31074.1"),
]


def both(data: bytes, fields=None) -> tuple[str, str]:
    """(per-line parser's records and skipped count, bulk path's), as JSON so that key order and NaN count."""
    line_by_line = parse.parse_text(data.decode("utf-8", errors="replace"), fields=fields)
    records: list[dict] = []
    skipped = scan_blocks([data], records, parse._keep(fields))
    return (json.dumps([line_by_line.records, line_by_line.skipped]), json.dumps([records, skipped]))


@pytest.mark.parametrize("fields", [None, ("lm_loss", "grad_norm", "elapsed_time_per_iteration_s")])
@pytest.mark.parametrize("name", ["tr1-13B", "tr8b-104B", "tr11-176B-spike", "malformed", "restart", "nan", "crash",
                                  "hang"])
def test_bulk_path_reads_every_fixture_as_the_per_line_parser_does(name, fields):
    expected, got = both((FIXTURES / f"{name}.txt").read_bytes(), fields)
    assert got == expected


def test_bulk_path_agrees_on_odd_lines_among_common_ones():
    lines = []
    for i, odd in enumerate(ODD):  # each odd line between whole ones of both formats, so that layouts form
        lines += [LINE_2022.replace("31217/", f"{31217 + i}/"), odd, LINE_2021]
    data = "\n".join(lines).encode() + b"\n" + b"[default7]: iteration 5/ 9 | lm loss: \xff\xfe1.0 |\n"
    expected, got = both(data)
    assert got == expected
    _, block = bulk._columns(data)
    assert sum(table.height for _, table in block.layouts) >= 2 * len(ODD)  # the common lines were built by polars
    records = json.loads(got)[0]
    assert {r.get("elapsed_time_per_iteration_s") for r in records} >= {106.33, 13.2482, 31.0741}


def test_bulk_path_agrees_when_the_first_line_is_longer_than_the_columns_read():
    wide = "| ".join(["x: 1 "] * 40) + "| iteration 7/ 9 |"  # polars sizes its columns from the first line
    expected, got = both(("\n".join([wide, LINE_2022, ODD[5], LINE_2021, wide]) + "\n").encode())
    assert got == expected and len(json.loads(got)[0]) == 2


def test_bulk_path_keeps_file_order_across_layouts_and_restarts():
    lines = [LINE_2022.replace("31217/", f"{i}/") if i % 3 else LINE_2021.replace("168000/", f"{i}/")
             for i in [*range(1, 40), *range(20, 60)]]
    expected, got = both(("\n".join(lines) + "\n").encode())
    assert got == expected
    assert [r["iteration"] for r in json.loads(got)[0]] == [*range(1, 40), *range(20, 60)]


# srun --label's task ids as they prefix lines (padded to the widest id), and prefixes that are no label
LABELS = ["", "0: ", "12: ", " 3: ", "  10: ", "123456789: ", "1234567890: ", "12:", "1 2: ", " : ", "\u0663: ", "-1: ",
          "\t1: ", "1: 2: ", "007: "]


@pytest.mark.parametrize("label", LABELS)
def test_bulk_path_reads_srun_labels_as_the_per_line_parser_does(label):
    # Each odd line labelled, between common lines of two labelled ranks and unlabelled ones of the same layouts.
    lines = []
    for i, odd in enumerate(ODD):
        common = LINE_2022.replace("31217/", f"{31217 + i}/")
        lines += [f"0: {common}", label + odd, f"1: {common}", common, f"1: {LINE_2021}", LINE_2021]
    data = ("\n".join(lines) + "\n").encode()
    for fields in (None, ("lm_loss",)):
        expected, got = both(data, fields)
        assert got == expected
    records = json.loads(got)[0]  # ODD[0] is an empty line: no record
    assert [r.get("rank") for r in records[:3]] == [0, 1, None]
    assert list(records[0])[:3] == ["kind", "rank", "iteration"]
    _, block = bulk._columns(data)
    ranked = [table for _, table in block.layouts if "rank" in table.columns]
    assert sum(table.height for table in ranked) >= 3 * len(ODD)  # the labelled common lines were built by polars
    assert all(table["rank"].is_not_null().all() for table in ranked)


_EDITS = st.lists(st.tuples(st.integers(0, len(LINE_2022)), st.integers(0, 3),
                            st.text(alphabet="0123456789 .:|/eE+-naNiItr\r\t\x00\u00e9[]", max_size=3)), max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_EDITS, min_size=1, max_size=6))
def test_bulk_path_agrees_on_randomly_damaged_lines(damage):
    lines = []
    for edits in damage:
        line = LINE_2022
        for at, cut, insert in edits:
            line = line[:at] + insert + line[at + cut:]
        lines += [LINE_2022, line]
    data = ("\n".join(lines) + "\n").encode()
    for fields in (None, ("lm_loss", "consumed_samples")):
        expected, got = both(data, fields)
        assert got == expected


_FIXTURE_BYTES = [f.read_bytes() for f in sorted(FIXTURES.glob("*.txt"))]
_BYTE_EDITS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 3),
                                 st.binary(max_size=4).map(lambda b: bytes(_ALPHABET[x % len(_ALPHABET)] for x in b))),
                       min_size=1, max_size=40)
_ALPHABET = b'|:~"\r\n\x00\t iteration/loss at 0123456789.eE+-nainf\xff\xfe\xc3\xa9'


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_FIXTURE_BYTES), st.integers(1, 3), _BYTE_EDITS)
def test_bulk_path_agrees_on_randomly_damaged_fixtures(base, copies, edits):
    # Byte-level damage anywhere: new lines, bad UTF-8, separators, markers (the explicit cases above came from a
    # longer run of this kind of fuzzing).
    data = bytearray(base * copies)
    for where, cut, insert in edits:
        at = int(where * len(data))
        data[at:at + cut] = insert
    data = bytes(data[:data.rfind(b"\n") + 1])
    for fields in (None, ("lm_loss",)):
        expected, got = both(data, fields)
        assert got == expected


def test_read_from_takes_the_bulk_path_for_large_reads_and_resumes_at_its_offset(tmp_path, monkeypatch):
    log = tmp_path / "main_log.txt"
    lines = [LINE_2022.replace("31217/", f"{i}/") for i in range(1, 3001)]
    log.write_text("\n".join(lines[:2000]) + "\n" + lines[2000][:50])  # a partial last line
    monkeypatch.setattr(parse, "_BULK_MIN", 1)
    monkeypatch.setattr(parse, "_BULK_BLOCK", 64 << 10)  # several blocks, so the read-ahead threads run
    calls, finish = [], bulk._finish
    monkeypatch.setattr(bulk, "_finish", lambda *args: calls.append(1) or finish(*args))
    first = parse.read_from(log)
    assert len(calls) > 2 and [r["iteration"] for r in first.records] == list(range(1, 2001))
    assert first.offset == len("\n".join(lines[:2000])) + 1
    with log.open("a") as f:
        f.write(lines[2000][50:] + "\n" + "\n".join(lines[2001:]) + "\n")
    rest = parse.read_from(log, first.offset)
    assert [r["iteration"] for r in rest.records] == list(range(2001, 3001)) and rest.skipped == 0

