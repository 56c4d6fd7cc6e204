"""Fuzzing the readers of user input: random YAML documents and damaged presets into spec loading and `opskit plan`
(only SpecError escapes, always one line), random bytes into every log reader (nothing escapes). Bounded: a few
hundred examples per test, the whole file in well under a minute on 2 cores."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from opskit.history import sources
from opskit.logs import eta, follow, parse, spikes
from opskit.logs.bulk import scan_blocks
from opskit.logs.grammar import scan_bytes
from opskit.monitor.checks import log_findings, progress_findings
from opskit.monitor.snapshot import progress_of, read_log
from opskit.monitor.watch_state import WatchdogState
from opskit.run.paths import RunPaths
from opskit.spec.files import SpecError
from opskit.spec.load import load_spec, validate_spec
from opskit.spec.plan import make_plan

PRESETS = sorted((REPO / "opskit" / "spec" / "presets").glob("*.yaml"))
FIXTURES = REPO / "tests" / "fixtures" / "logs"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def one_line_spec_error(path: Path, name: str | None = None):
    """Load and plan the spec at ``path``: a spec, or SpecError in one line naming the file; nothing else."""
    try:
        spec = load_spec(name or str(path))
    except SpecError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(str(path)), message
        return None
    make_plan(spec)  # a spec that validates must plan: no ZeroDivisionError, no overflow
    return spec


# --------------------------------------------------------------------------- random YAML documents

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12), st.sampled_from(["20:00:00", "1-00:00", "kjv", "alibi", "bf16", "~", ""]))
_KEYS = st.one_of(st.sampled_from(["model", "batch", "parallel", "optimizer", "data", "checkpoint", "slurm", "paths",
                                   "variants", "name", "num_layers", "watchdog", "megatron_args", "<<"]),
                  st.text(max_size=8), st.integers(), st.booleans())
_TREES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(_KEYS, inner, max_size=5)), max_leaves=25)


@FUZZ
@given(document=_TREES)
def test_random_yaml_documents_are_a_spec_or_one_spec_error(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("yaml") / "random.yaml"
    try:
        path.write_text(yaml.safe_dump(document))
    except yaml.YAMLError:
        assume(False)
    one_line_spec_error(path)


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list(":-[]{}&*!|>'\"%@`#,? \n\tab0\x00\x85\ufeff\u2028")), max_size=80))
def test_random_yaml_text_is_one_spec_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("text") / "random.yaml"
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    one_line_spec_error(path)


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_as_a_spec_are_one_spec_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "random.yaml"
    path.write_bytes(data)
    one_line_spec_error(path)


# --------------------------------------------------------------------------- damaged presets

_PRESET_RAW = {p.stem: yaml.safe_load(p.read_text()) for p in PRESETS}
_WRONG = st.one_of(st.booleans(), st.integers(-3, 3), st.integers(2**31, 2**64), st.floats(-1e3, 1e3),
                   st.sampled_from([float("nan"), float("inf"), 2.0, 0.5, "", "4", "abc", "2.0", [], [1, 2], {},
                                    {"x": 1}, None, "$UNSET_VAR/x", "a\nb", [[]],
                                    {"nested": {"junk": [1, {"a": None}]}}]))


def _paths(tree, prefix=()):
    """Every key path in a nested mapping (lists are leaves)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))


def _mutate(raw: dict, path: tuple, kind: str, value) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    for key in path[:-1]:
        node = node[key]
    if kind == "set":
        node[path[-1]] = value
    elif kind == "delete":
        del node[path[-1]]
    elif kind == "extra":
        node[f"{path[-1]}_extra"] = value
    else:  # junk: the value wrapped in a mapping or a list
        node[path[-1]] = {"junk": node[path[-1]]} if isinstance(value, dict) else [node[path[-1]], value]
    return raw


@st.composite
def damaged_presets(draw):
    name = draw(st.sampled_from(sorted(_PRESET_RAW)))
    raw = _PRESET_RAW[name]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(raw))))
        raw = _mutate(raw, path, draw(st.sampled_from(["set", "set", "delete", "extra", "junk"])), draw(_WRONG))
    return name, raw


COUNTS = {"loaded": 0, "refused": 0}


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=damaged_presets())
def test_damaged_presets_and_variants_are_a_spec_or_one_spec_error(tmp_path_factory, case):
    name, raw = case
    folder = tmp_path_factory.mktemp("preset")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    variants = raw.get("variants") if isinstance(raw.get("variants"), dict) else {}
    for variant in [None, *[v for v in variants if isinstance(v, str)]]:
        spec = one_line_spec_error(path, f"{path}:{variant}" if variant else None)
        COUNTS["loaded" if spec else "refused"] += 1


def test_presets_pass_the_same_checks():
    for path in PRESETS:
        assert one_line_spec_error(path) is not None
        raw = yaml.safe_load(path.read_text())
        for variant in raw.get("variants", {}):
            assert one_line_spec_error(path, f"{path}:{variant}") is not None


@FUZZ
@given(section=st.sampled_from(["model", "batch", "parallel", "optimizer", "checkpoint", "slurm", "watchdog"]),
       value=_WRONG)
def test_validate_spec_refuses_a_section_of_the_wrong_type(section, value):
    assume(not isinstance(value, dict) or value)  # {} is a section of defaults
    raw = copy.deepcopy(_PRESET_RAW["tiny"])
    raw["name"] = "tiny"
    raw[section] = value
    with pytest.raises(SpecError) as info:
        validate_spec(raw, Path("tiny.yaml"))
    assert "\n" not in str(info.value) and str(info.value).startswith("tiny.yaml: ")


# --------------------------------------------------------------------------- random bytes into the log readers

_LINES = [line for f in sorted(FIXTURES.glob("*.txt")) for line in f.read_bytes().splitlines(keepends=True)]
_JUNK = st.binary(max_size=60).map(lambda b: bytes(_ALPHABET[x % len(_ALPHABET)] for x in b))
_ALPHABET = b'|:"\r\n\x00\t iteration/loss at 0123456789.eE+-nainf\xff\xfe\xc3\xa9[default0]:'
_NUMBER = st.one_of(st.integers(-5, 10**25).map(str), st.sampled_from(["0", "-0", "nan", "inf", "-inf", "1e400", "0.0",
                                                                       "2048.0", "1_0", "", " "]))
_FIELD = st.sampled_from(["lm loss", "grad norm", "consumed samples", "consumed tokens", "global batch size",
                          "elapsed time per iteration (s)", "elapsed time per iteration (ms)", "samples per second",
                          "number of nan iterations", "number of skipped iterations", "TFLOPs", "learning rate",
                          "loss scale", "moe loss", "lm loss value", "lm loss PPL"])
_MADE = st.builds(lambda it, total, fields, end: (f" iteration {it}/ {total} |" + "".join(
    f" {name}: {value} |" for name, value in fields) + end).encode(), _NUMBER, _NUMBER,
    st.lists(st.tuples(_FIELD, _NUMBER), max_size=6), st.sampled_from(["\n", "", "x\n", "\r\n"]))
_PIECES = st.one_of(st.sampled_from(_LINES), _JUNK, st.binary(max_size=40), _MADE,
                    st.tuples(st.sampled_from(_LINES), st.integers(0, 300), _JUNK).map(
                        lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:]))
LOG_BYTES = st.lists(_PIECES, max_size=30).map(b"".join)


def _check_records(records: list[dict]) -> None:
    """What later stages need of a record: its kind, and an int iteration where it is an iteration record."""
    for r in records:
        assert r["kind"] in ("iteration", "validation")
        if r["kind"] == "iteration":
            assert isinstance(r["iteration"], int) and isinstance(r["train_iters"], int)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=LOG_BYTES, offset=st.integers(0, 400))
def test_random_bytes_into_every_log_reader(tmp_path_factory, data, offset):
    log = tmp_path_factory.mktemp("log") / "main_log.txt"
    log.write_bytes(data)
    whole = parse.read_from(log)
    _check_records(whole.records)
    assert whole.lines == data.count(b"\n") and whole.offset + whole.unread == len(data)
    assert whole.summary("x") is None or "\n" not in whole.summary("x")
    later = parse.read_from(log, offset, fields=("lm_loss", "grad_norm"))
    assert later.offset <= len(data)
    _check_records(parse.read_tail(log, 5).records)
    parse.first_iteration(log)
    follow.last_lines(log, 3)
    follow.new_lines(log, offset)
    timeline = parse.timeline(whole.records)
    if timeline:
        state = eta.progress(timeline)
        assert all("\n" not in line for line in eta.progress_lines(state, 20))
    found = spikes.find_spikes(timeline)
    spikes.remedies(found, 100, None)
    source = sources.resolve(str(log))
    try:
        source.timeline(("lm_loss",))
    except parse.LogFormatError:
        assert not timeline


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(blocks=st.lists(LOG_BYTES, min_size=1, max_size=3))
def test_random_bytes_into_the_bulk_path(blocks):
    blocks = [b[:b.rfind(b"\n") + 1] for b in blocks]  # the bulk path gets complete lines
    records, expected = [], []
    skipped = scan_blocks([b for b in blocks if b], records, None)
    assert skipped == sum(scan_bytes(block, expected, None) for block in blocks)
    assert json.dumps(records) == json.dumps(expected)  # NaN == NaN, key order included
    _check_records(records)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=LOG_BYTES, second=LOG_BYTES)
def test_random_bytes_into_the_watchdogs_log_scan(tmp_path_factory, first, second):
    from datetime import datetime

    from opskit.spec.schema import WatchdogSpec

    run = RunPaths(tmp_path_factory.mktemp("run"))
    run.logs.mkdir()
    run.main_log.write_bytes(first)
    state = WatchdogState()
    for data in (first, second):  # a first run, then one on appended bytes
        if data is second:
            with open(run.main_log, "ab") as f:
                f.write(second)
        log = read_log(run, state)
        state = log.state
        log_findings(log, WatchdogSpec(), datetime.now(), datetime.now(), 100)
        spec = load_spec("tiny")
        progress_findings(progress_of(spec, log.records))
