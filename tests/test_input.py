"""Bad input gets one line naming the file or field, never a traceback nor a silent wrong answer: specs (binary,
non-UTF-8, duplicate keys, wrong types), log files (folders, binary, empty), plot fields, `opskit status` from
another directory, the trainer's flags and its missing extra."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_trainer_cases

from opskit.spec.files import SpecError
from opskit.spec.load import load_spec
from opskit.spec.new import list_specs
from opskit.spec.plan import make_plan

PRESET = REPO / "opskit" / "spec" / "presets" / "tiny.yaml"
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
    with pytest.raises(SpecError, match=r"^dir\.yaml: a folder, not a spec file$"):
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
    # the good files' records, before and after; a gzip log is read as its text
    assert records and {r["file"] for r in records} == {str(good), "log.gz"}
    from opskit.logs.parse import read_from

    plain = read_from(FIXTURES / "tr8b-104B.txt")
    assert [{k: v for k, v in r.items() if k not in ("file", "segment")} for r in records
            if r["file"] == "log.gz"] == plain.records and len(plain.records) == 7
    err = done.stderr.splitlines()
    assert err[0] == "error: a-folder: a folder, not a log file"
    assert err[1].startswith("binary.bin: 0 records, 8 lines skipped (not a training log?)"), err
    assert err[2] == plain.summary("log.gz") == "log.gz: 1 iteration/validation line(s) skipped (cut, wrapped or " \
        "garbled)", err  # what the plain file gives: its one cut line
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


@pytest.mark.parametrize("threshold", ["0", "-1"])
def test_spikes_refuses_a_threshold_that_marks_everything(tmp_path, threshold):
    done = opskit_cli("logs", "spikes", str(FIXTURES / "hang.txt"), "--threshold", threshold, cwd=tmp_path)
    assert done.returncode == 2 and "Invalid value for '--threshold'" in done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stderr

# --------------------------------------------------------------------------- where a spec's relative paths start

def test_relative_paths_start_from_the_project_holding_trainings(tmp_path, monkeypatch):
    from opskit.run.paths import RunPaths, corpus_inputs, data_paths

    project = tmp_path / "project"
    raw = tiny()
    raw["data"]["corpus"] = ["corpus/a.jsonl"]
    (project / "trainings").mkdir(parents=True)
    (project / "trainings" / "mine.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "other.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)  # not the project
    spec = load_spec("project/trainings/mine.yaml")
    assert spec.base_dir == project.resolve()
    assert RunPaths.of(spec).root == project.resolve() / "runs" / "tiny"
    assert data_paths(spec)[0].parent == project.resolve() / "data" / "kjv"
    assert corpus_inputs(spec)[0] == [str(project.resolve() / "corpus" / "a.jsonl")]
    assert RunPaths.of(load_spec("elsewhere/other.yaml")).root == (tmp_path / "elsewhere" / "runs" / "tiny").resolve()
    assert RunPaths.of(load_spec("tiny")).root == tmp_path.resolve() / "runs" / "tiny"  # a preset: the current folder

    monkeypatch.chdir(project)  # by name from the project: the same run
    assert RunPaths.of(load_spec("mine")).root == project.resolve() / "runs" / "tiny"

@pytest.mark.slurm
def test_status_from_another_folder_sees_the_run_or_says_it_cannot(slurm, tmp_path):
    project = tmp_path / "project"
    raw = tiny()
    raw["slurm"]["job_name"] = f"opskit-h5-{os.getpid()}"
    raw["paths"]["output"] = "runs/mine"
    (project / "trainings").mkdir(parents=True)
    spec = project / "trainings" / "mine.yaml"
    spec.write_text(yaml.safe_dump(raw))
    (tmp_path / "elsewhere").mkdir()

    done = opskit_cli("status", str(spec), "--json", "--page", cwd=tmp_path / "elsewhere")
    assert done.returncode == 2, done.stdout + done.stderr  # never "no log ... ok" for a run it cannot see
    assert "the run's page was not refreshed" in done.stderr and "no run folder yet" in done.stderr
    assert not (project / "runs").exists()  # the page never makes the run folder the alert is about
    findings = {f["key"]: f for f in json.loads(done.stdout)["findings"]}
    assert findings["run.missing"]["severity"] == "alert"
    assert str(project.resolve() / "runs" / "mine") in findings["run.missing"]["message"]
    assert "log.none" not in findings and "checkpoint.none" not in findings

    logs = project / "runs" / "mine" / "logs"
    logs.mkdir(parents=True)
    (logs / "main_log.txt").write_bytes((FIXTURES / "hang.txt").read_bytes())
    done = opskit_cli("status", str(spec), "--json", cwd=tmp_path / "elsewhere")
    assert done.returncode == 1, done.stdout + done.stderr  # the absent job's alert, nothing else
    findings = {f["key"]: f for f in json.loads(done.stdout)["findings"]}
    assert "run.missing" not in findings and findings["progress"]["severity"] == "ok"
    assert not (tmp_path / "elsewhere" / "runs").exists()

def test_status_on_a_bad_spec_exits_2_in_one_line(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    assert one_error_line(opskit_cli("status", "bin.yaml", cwd=tmp_path), 2).startswith("error: bin.yaml: not UTF-8")
    raw = tiny()
    raw["model"]["num_layers"] = True
    (tmp_path / "bool.yaml").write_text(yaml.safe_dump(raw))
    assert "model.num_layers" in one_error_line(opskit_cli("status", "bool.yaml", cwd=tmp_path), 2)

# --------------------------------------------------------------------------- the trainer's command line

BAD_TRAINER_FLAGS = {"unknown": ["--bogus"], "not a number": ["--num-layers", "two"], "none": []}


@pytest.fixture(scope="module")
def bad_flags_in_the_trainer(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """:data:`BAD_TRAINER_FLAGS` through ``python -m opskit.train``'s ``main``, in one process (conftest's
    ``run_trainer_cases``)."""
    return run_trainer_cases(BAD_TRAINER_FLAGS, tmp_path_factory.mktemp("bad-flags"))


@pytest.mark.parametrize("name", BAD_TRAINER_FLAGS)
def test_a_bad_trainer_flag_is_one_line_with_a_hint(tmp_path, name, bad_flags_in_the_trainer):
    argv = BAD_TRAINER_FLAGS[name]
    cli = subprocess.run([OPSKIT, "train", *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    for done in (cli, bad_flags_in_the_trainer[name]):
        assert done.returncode == 2 and done.stdout == "", done.stdout
        assert done.stderr.count("\n") == 1 and "usage:" not in done.stderr, done.stderr
        assert done.stderr.startswith("python -m opskit.train: error: ") and \
            done.stderr.endswith("(python -m opskit.train --help lists the flags)\n"), done.stderr
    if argv == ["--bogus"]:
        assert "unrecognized arguments: --bogus" in done.stderr

# A `python -c` prelude that makes torch (and what needs it) unimportable, as on a login node without the extra.
NO_TORCH = ("import sys\n"
            "class _Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'deepspeed'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, _Block())\n")

def test_the_trainer_without_its_extra_is_one_line(tmp_path):

    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-samples", "1", "--lr", "1e-3",
            "--data-path", "x", "--tokenizer-name-or-path", "x"]
    for entry in ("import runpy; runpy.run_module('opskit.train', run_name='__main__')",
                  "import sys; from opskit.cli.app import main; sys.argv[0] = 'opskit'; main()"):
        argv_of = ["train", *argv] if "cli" in entry else argv
        done = subprocess.run([sys.executable, "-c", NO_TORCH + entry, *argv_of], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert "pip install 'opskit[train]'" in done.stderr and "torch" in done.stderr, done.stderr

    help_ = subprocess.run([sys.executable, "-c", NO_TORCH + "import runpy; runpy.run_module('opskit.train', "
                            "run_name='__main__')", "--help"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert help_.returncode == 0 and "--num-layers" in help_.stdout  # --help needs no torch


def test_a_log_whose_iteration_total_is_zero_or_absurd_is_no_traceback(tmp_path):
    (tmp_path / "z.log").write_text(" iteration 5/ 0 | lm loss: 1.0 | elapsed time per iteration (s): 1.0 |\n"
                                    " iteration 6/ 0 | consumed samples: -8 | consumed tokens: 8 | "
                                    "global batch size: 0 | lm loss: 1e400 |\n")
    for command in (["show"], ["spikes"]):
        done = opskit_cli("logs", *command, "z.log", cwd=tmp_path)
        assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "progress: iteration 6 of 0 (no total logged), 0 left" in opskit_cli("logs", "show", "z.log",
                                                                               cwd=tmp_path).stdout


@pytest.mark.parametrize("command", [["kill-switch"], ["status"], ["logs", "show"], ["nodes", "list"]])
def test_a_run_directory_below_a_file_is_one_line(tmp_path, command):
    raw = tiny()
    raw["paths"]["output"] = "afile/run"
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    argv = [*command, "s.yaml", *(["on"] if command == ["kill-switch"] else [])]
    line = one_error_line(opskit_cli(*argv, cwd=tmp_path), 2 if command == ["status"] else 1)
    assert line == f"error: s.yaml: paths.output: {tmp_path.resolve() / 'afile'} is a file, not a folder"


def test_error_lines_keep_their_colons(tmp_path):
    done = opskit_cli("logs", "plot", str(FIXTURES / "hang.txt"), "--range", "a:b:", "--out", "p.png", cwd=tmp_path)
    assert one_error_line(done, 1).startswith("error: --range a:b:: expected A:B")


def test_an_absurd_batch_size_is_refused_not_searched(in_tmp):
    # global_batch_size 2**64 used to hang `opskit plan` (the node-count search tried every divisor up to 2**32).
    raw = tiny()
    raw["batch"]["global_batch_size"] = 2**64
    (in_tmp / "huge.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"batch\.global_batch_size: Input should be less than or equal to 1048576"):
        load_spec("huge.yaml")


def test_an_absurd_ramp_up_or_curriculum_length_is_refused_not_replayed(in_tmp):
    # A curriculum of 2**63 steps (found by the fuzzer) made `opskit plan` replay iterations for ever.
    cl = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tr8b-104B.yaml").read_text())
    cl["variants"]["cl"]["curriculum_learning"]["total_curriculum_step"] = 2**63
    (in_tmp / "cl.yaml").write_text(yaml.safe_dump(cl))
    with pytest.raises(SpecError, match=r"total_curriculum_step: Input should be less than or equal to 4194304"):
        make_plan(load_spec("cl.yaml:cl"))
    raw = tiny()
    raw["batch"]["rampup_batch_size"] = [8, 8, 2**40]
    (in_tmp / "ramp.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"up to 137,438,953,472 iterations of ramp-up \(more than 4,194,304"):
        load_spec("ramp.yaml")


def test_a_garbled_iteration_time_is_no_eta(tmp_path):
    (tmp_path / "t.log").write_text(" iteration 1/ 10 | elapsed time per iteration (s): nan |\n"
                                    " iteration 2/ 10 | elapsed time per iteration (s): -inf |\n")
    done = opskit_cli("logs", "show", "t.log", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "ETA" not in done.stdout and "progress: iteration 2 of 10 (20.0%), 8 left" in done.stdout


def test_ckpt_commands_take_a_spec_file_as_a_spec_not_as_a_checkpoint_folder(tmp_path):
    raw = tiny()
    raw["paths"]["output"] = "run"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(raw))
    line = one_error_line(opskit_cli("ckpt", "list", "mine.yaml", cwd=tmp_path), 1)
    assert line == f"error: {tmp_path / 'run' / 'checkpoints'}: no global_stepN folders (not a checkpoint dir)", line
    (tmp_path / "binary.yaml").write_bytes(b"\x00\x01\xff")
    assert one_error_line(opskit_cli("ckpt", "list", "binary.yaml", cwd=tmp_path), 1).startswith("error: binary.yaml")


# --------------------------------------------------------------------------- OS errors: one line, any command


@pytest.fixture
def immutable(tmp_path):
    """``immutable(folder)`` makes a folder immutable (chattr +i: even root cannot write in it); undone at the end."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    frozen: list[Path] = []

    def freeze(folder: Path) -> Path:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i not supported on this file system")
        frozen.append(folder)
        return folder

    yield freeze
    for folder in frozen:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


def test_an_immutable_folder_is_one_line_in_every_command(bloom_run, tmp_path, immutable):
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(bloom_run / "checkpoints", checkpoints)
    ro = tmp_path / "ro"
    ro.mkdir()
    immutable(ro)
    immutable(checkpoints)
    runs = {
        "logs plot": opskit_cli("logs", "plot", str(FIXTURES / "hang.txt"), "--out", str(ro / "p.png"), cwd=tmp_path),
        "set-latest": opskit_cli("ckpt", "set-latest", str(checkpoints), "10", cwd=tmp_path),
        "convert": opskit_cli("ckpt", "convert", str(checkpoints), "--out", str(ro / "out"), "--no-verify",
                              cwd=tmp_path),
    }
    for command, done in runs.items():
        line = one_error_line(done, 1)
        assert re.fullmatch(r"error: /\S+: Operation not permitted", line), (command, line)
    assert (checkpoints / "latest").read_text() == "global_step20" and not list(ro.iterdir())

    # OPSKIT_DEBUG=1 keeps the traceback for a developer.
    debug = opskit_cli("ckpt", "set-latest", str(checkpoints), "10", cwd=tmp_path, env={"OPSKIT_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "PermissionError" in debug.stderr


def test_generate_on_a_corrupt_config_is_one_line(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bloom", "n_layer": ')
    line = one_error_line(opskit_cli("ckpt", "generate", str(model), cwd=tmp_path), 1)
    assert str(model / "config.json") in line or str(model) in line, line

def test_specs_list_refuses_what_plan_refuses(in_tmp):
    """`specs list` validates each spec with plan's loader, names each bad file, exit 1."""
    (in_tmp / "trainings").mkdir()
    (in_tmp / "trainings" / "good.yaml").write_text(PRESET.read_text())
    foreign, badtype = tiny(), tiny()
    foreign["mine"] = 1
    badtype["model"]["num_layers"] = True
    (in_tmp / "trainings" / "foreign.yaml").write_text(yaml.safe_dump(foreign))
    (in_tmp / "trainings" / "badtype.yaml").write_text(yaml.safe_dump(badtype))
    entries = {e.name: e for e in list_specs()}
    assert entries["good"].error is None
    for name in ("foreign", "badtype"):
        with pytest.raises(SpecError) as info:
            load_spec(name)
        assert entries[name].error == str(info.value)  # the one rule: the message plan/submit/status give

    done = opskit_cli("specs", "list", cwd=in_tmp)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "good" in done.stdout and "tiny" in done.stdout
    assert "foreign" not in done.stdout and "badtype" not in done.stdout
    assert "Traceback" not in done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("error: trainings/") for line in errors), errors
    assert any(line.startswith("error: trainings/foreign.yaml: mine: unknown key") for line in errors), errors
    assert any(line.startswith("error: trainings/badtype.yaml: model.num_layers: Input should be a valid integer")
               for line in errors), errors
