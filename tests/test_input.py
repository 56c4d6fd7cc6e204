"""Bad input gets one line naming the file or field, never a traceback nor a silent wrong answer: specs (binary,
non-UTF-8, duplicate keys, wrong types), log files (folders, binary, empty), plot fields, `opskit status` from
another directory, the trainer's flags and its missing extra."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from opskit.spec import SpecError, list_specs, load_spec

PRESET = REPO / "opskit" / "presets" / "tiny.yaml"
FIXTURES = REPO / "tests" / "fixtures" / "logs"
OPSKIT = str(Path(sys.executable).with_name("opskit"))
BINARY = bytes(range(256)) * 8 + b"\xff\xfe\x00 iteration \x00|"


def opskit_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120):
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def one_error_line(done, code: int) -> str:
    """The single `error: ...` line of a refused command (no traceback), with its exit code checked."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def tiny() -> dict:
    return yaml.safe_load(PRESET.read_text())


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- spec files


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x01binary", "model: caf\xe9\n".encode("latin-1"),
                                     gzip.compress(PRESET.read_bytes())], ids=["binary", "latin-1", "gzip"])
def test_a_spec_that_is_not_utf8_is_one_line(in_tmp, content):
    path = in_tmp / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and "UTF-8" in message, message


def test_a_folder_named_like_a_spec_file_is_one_line(in_tmp):
    (in_tmp / "dir.yaml").mkdir()
    with pytest.raises(SpecError, match=r"^dir\.yaml: "):
        load_spec("dir.yaml")


def test_one_bad_file_in_trainings_does_not_hide_the_others(in_tmp):
    (in_tmp / "trainings").mkdir()
    (in_tmp / "trainings" / "good.yaml").write_text(PRESET.read_text())
    (in_tmp / "trainings" / "broken.yaml").write_bytes(b"\xff\xfe\x00 not text")
    entries = {e.name: e for e in list_specs()}
    assert entries["good"].description.startswith("tiny BLOOM") and entries["good"].error is None
    assert entries["broken"].error.startswith("trainings/broken.yaml: not UTF-8 text")
    assert load_spec("good").name == "good"  # lookup by name and prefix still works past the bad file
    assert load_spec("go").name == "good"

    done = opskit_cli("specs", "list", cwd=in_tmp)
    assert "good" in done.stdout and "tiny" in done.stdout and "broken" not in done.stdout
    assert one_error_line(done, 1).startswith("error: trainings/broken.yaml: not UTF-8 text")


@pytest.mark.parametrize("section, key, value, expected", [
    ("model", "num_layers", True, "Input should be a valid integer"),
    ("model", "num_layers", 2.0, "Input should be a valid integer"),
    ("model", "num_layers", "4", "Input should be a valid integer"),
    ("batch", "micro_batch_size", 8.5, "Input should be a valid integer"),
    ("checkpoint", "save_interval", False, "Input should be a valid integer"),
    ("optimizer", "lr", True, "Input should be a valid number"),
    ("optimizer", "lr", "3e-3", "Input should be a valid number"),
    ("model", "embed_layernorm", 1, "Input should be a valid boolean"),
    ("model", "embed_layernorm", "yes", "Input should be a valid boolean"),
    ("slurm", "array", "2", "Input should be a valid integer"),
    ("parallel", "zero_stage", True, "Input should be a valid integer"),
    ("parallel", "zero_stage", 2, "Input should be less than or equal to 1"),
    ("slurm", "env", {"OMP_NUM_THREADS": 2}, "Input should be a valid string"),
])
def test_spec_types_are_strict(in_tmp, section, key, value, expected):
    raw = tiny()
    raw[section][key] = value
    (in_tmp / "t.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError) as info:
        load_spec("t.yaml")
    assert f"{section}.{key}" in str(info.value) and expected in str(info.value), str(info.value)


def test_an_int_is_a_fine_float_and_a_list_a_fine_tuple(in_tmp):
    raw = tiny()
    raw["optimizer"]["lr"] = 1  # YAML reads `lr: 1` as an int
    raw["slurm"]["exit_margin_mins"] = 1
    raw["batch"].update(rampup_batch_size=[8, 8, 320], train_samples=8000)
    (in_tmp / "t.yaml").write_text(yaml.safe_dump(raw))
    spec = load_spec("t.yaml")
    assert spec.optimizer.lr == 1.0 and isinstance(spec.optimizer.lr, float)
    assert spec.batch.rampup_batch_size == (8, 8, 320)


def test_a_key_given_twice_is_refused_with_file_key_and_line(in_tmp):
    text = PRESET.read_text().replace("  hidden_size: 128\n", "  hidden_size: 128\n  hidden_size: 64\n")
    (in_tmp / "twice.yaml").write_text(text)
    line = text.splitlines().index("  hidden_size: 64") + 1
    with pytest.raises(SpecError) as info:
        load_spec("twice.yaml")
    assert str(info.value) == (f"twice.yaml: line {line}: key 'hidden_size' given twice (first at line {line - 1}): "
                               "keep one")

    (in_tmp / "top.yaml").write_text(PRESET.read_text() + "description: again\n")
    with pytest.raises(SpecError, match=r"^top\.yaml: line \d+: key 'description' given twice"):
        load_spec("top.yaml")


# --------------------------------------------------------------------------- log files


def test_logs_parse_goes_on_past_a_folder_and_says_what_each_file_gave(tmp_path):
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "binary.bin").write_bytes(BINARY)
    (tmp_path / "log.gz").write_bytes(gzip.compress((FIXTURES / "tr8b-104B.txt").read_bytes()))
    (tmp_path / "empty.txt").write_bytes(b"")
    good = FIXTURES / "hang.txt"
    done = opskit_cli("logs", "parse", str(good), "a-folder", "binary.bin", "log.gz", "empty.txt", "missing.txt",
                      cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records and {r["file"] for r in records} == {str(good)}  # the good file's records, before and after
    err = done.stderr.splitlines()
    assert err[0] == "error: a-folder: a folder, not a log file"
    assert err[1].startswith("binary.bin: 0 records, 8 lines skipped (not a training log?)"), err
    assert err[2].startswith("log.gz: 0 records,") and "(not a training log?)" in err[2], err
    assert err[3] == "empty.txt: empty, 0 records"
    assert err[4].startswith("error: missing.txt: no such file"), err
    assert len(err) == 5, err


def test_logs_parse_of_good_files_only_exits_0_with_nothing_on_stderr(tmp_path):
    done = opskit_cli("logs", "parse", str(FIXTURES / "hang.txt"), cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.parametrize("command", [["show"], ["tail", "-n", "1"], ["spikes"], ["plot", "--out", "p.png"]])
def test_logs_commands_on_a_folder_that_is_no_run_are_one_line(tmp_path, command):
    (tmp_path / "not-a-run").mkdir()
    done = opskit_cli("logs", command[0], "not-a-run", *command[1:], cwd=tmp_path, timeout=60)
    line = one_error_line(done, 1)
    assert line.startswith("error: not-a-run: a folder with neither logs/main_log.txt nor TensorBoard event files")

    done = opskit_cli("logs", command[0], "runs/nope/main_log.txt", *command[1:], cwd=tmp_path, timeout=60)
    assert one_error_line(done, 1).startswith("error: runs/nope/main_log.txt: no such file or folder")


@pytest.mark.parametrize("option, value", [("--y", "lmloss"), ("--y", "extra.nothing"), ("--x", "step")])
def test_plot_names_the_valid_fields(tmp_path, option, value):
    done = opskit_cli("logs", "plot", str(FIXTURES / "hang.txt"), option, value, "--out", "p.png", cwd=tmp_path)
    line = one_error_line(done, 1)
    assert f"{option} {value}: " in line and "expected one of" in line, line
    if option == "--y":
        assert "lm_loss" in line and "grad_norm" in line and "validation_lm_loss" in line and "lr" in line, line
    else:
        assert "iteration, samples, tokens" in line, line
    assert not (tmp_path / "p.png").exists()
