"""The `opskit` command line as users run it (the installed console script, subprocesses): commands, version, light
imports on login nodes, one-line errors, `plan` numbers against the trainer's model, `logs show` on a real log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_trainer_args, write_spec

import opskit
from opskit.spec.files import preset_names
from opskit.spec.load import load_spec
from opskit.spec.schema import padded_vocab_size

OPSKIT = str(Path(sys.executable).with_name("opskit"))
HEAVY = ("torch", "deepspeed", "megatron", "transformers", "tokenizers", "numpy", "safetensors", "matplotlib", "polars")


def opskit_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120):
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_lists_every_command(tmp_path):
    done = opskit_cli("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = set(re.findall(r"^\s{2}(\w+)\s{2,}", done.stdout, re.M))
    assert {"plan", "submit", "train", "status", "ckpt", "logs", "data", "specs", "cancel", "hold", "release", "nodes",
            "cron"} <= listed, done.stdout
    assert re.search(r"^\s{2}kill-switch\s{2,}", done.stdout, re.M), done.stdout
    assert "Usage: opskit" in done.stdout

    bare = opskit_cli(cwd=tmp_path)  # no arguments: the same help, not a traceback
    assert "Usage: opskit" in bare.stdout + bare.stderr and "Traceback" not in bare.stderr

    for group, commands in {"ckpt": {"list", "inspect", "check", "convert", "prune", "backup", "verify", "generate"},
                            "logs": {"show"}, "data": {"prepare"}, "specs": {"list", "show", "new"},
                            "nodes": {"list", "add", "clear"}, "cron": {"install", "status", "uninstall"}}.items():
        done = opskit_cli(group, "--help", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert commands <= set(re.findall(r"^\s{2}(\w+)\s{2,}", done.stdout, re.M)), done.stdout


def test_version(tmp_path):
    done = opskit_cli("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout == f"opskit {opskit.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", opskit.__version__)


def test_python_dash_m_entry_point(tmp_path):
    done = subprocess.run([sys.executable, "-m", "opskit.cli.app", "--version"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"opskit {opskit.__version__}\n"


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["plan", "tiny"], ["status", "tiny"],
                                  ["logs", "--help"], ["ckpt", "--help"], ["train", "--help"],
                                  ["cron", "status", "tiny"], ["nodes", "list", "tiny"],
                                  ["kill-switch", "tiny", "off"]])
def test_login_node_commands_do_not_import_torch(argv, tmp_path):
    # `opskit status` runs from cron on login nodes: seconds of torch/deepspeed imports (and their CUDA probing)
    # per call are not acceptable there. The real app, in-process, then a look at sys.modules.
    probe = (
        "import sys\n"
        "from opskit.cli.app import app\n"
        "try:\n"
        "    app(sys.argv[1:], prog_name='opskit')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert "HEAVY=\n" in done.stderr, done.stderr[-2000:]


def test_bad_spec_is_one_line_on_stderr(tmp_path):
    raw = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
    raw["model"]["num_attention_heads"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    for args, message, code in [
        (["plan", str(bad)], f"{bad}: model: hidden_size 128 must be divisible by num_attention_heads 3", 1),
        # status keeps exit code 1 for its ALERT: a configuration error is 2 there.
        (["status", "no-such-spec"], "no spec named 'no-such-spec'; known: " + ", ".join(preset_names()), 2),
        (["submit", str(tmp_path / "missing.yaml"), "--dry-run"], f"{tmp_path / 'missing.yaml'}: no such spec file",
         1),
    ]:
        done = opskit_cli(*args, cwd=tmp_path)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert done.stderr == f"error: {message}\n", done.stderr
        assert done.stdout == ""

    # OPSKIT_DEBUG=1 is the way to the traceback.
    done = opskit_cli("plan", str(bad), cwd=tmp_path, env={"OPSKIT_DEBUG": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr and "SpecError" in done.stderr


def model_parameters(spec) -> int:
    """Parameters of the trainer's own model (tied LM head counted once) for a spec's architecture."""
    from opskit.train.inference import GPTModel
    from opskit.train.model import GPTConfig

    m = spec.model
    cfg = GPTConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size, seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        padded_vocab_size=padded_vocab_size(spec.data.vocab_size, m, spec.parallel.tensor_model_parallel_size),
        position_embedding_type=m.position_embedding_type, embed_layernorm=m.embed_layernorm)
    return sum(p.numel() for p in GPTModel(cfg).parameters())


def test_plan_json_counts_the_trainers_parameters(tmp_path):
    done = opskit_cli("plan", "tiny", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    spec = load_spec("tiny")
    h, layers, vocab = spec.model.hidden_size, spec.model.num_layers, 8064  # vocab 8000 padded to 128 * 63
    assert padded_vocab_size(spec.data.vocab_size, spec.model, 1) == vocab
    assert plan["parameters"] == layers * (12 * h**2 + 13 * h) + vocab * h + 4 * h == 1_825_792
    assert plan["parameters"] == model_parameters(spec)
    assert plan["name"] == "tiny"
    assert plan["data_parallel_size"] == 1
    assert plan["hidden_per_head"] == h / spec.model.num_attention_heads
    assert plan["train_iters"] == spec.batch.train_samples // spec.batch.global_batch_size
    assert plan["tokens"] == spec.batch.train_samples * spec.model.seq_length
    # fp32 training at ZeRO-1 over DP 1: 20 bytes per parameter (fp32 weights, ZeRO's fp32 copy, Adam, gradients).
    assert plan["model_state_gb_per_gpu"] == pytest.approx(20 * 1_825_792 / 1e9)

    table = opskit_cli("plan", "tiny", cwd=tmp_path)
    assert table.returncode == 0
    assert re.search(r"parameters\s+│?\s*1,825,792 \(0\.002B\)", table.stdout), table.stdout


def test_plan_counts_a_gpt_style_model_too(tmp_path):
    # Absolute positions and no embedding LayerNorm: + s*h, - 2h. Another vocab padding, 3 layers, 2 GPUs of TP.
    fake_data = type("Prepared", (), {"data_prefix": tmp_path / "d" / "kjv_text_document"})
    path = write_spec(tmp_path / "gpt.yaml", fake_data, tmp_path / "run",
                      model={"position_embedding_type": "absolute", "embed_layernorm": False, "num_layers": 3},
                      data={"vocab_size": 5001},
                      parallel={"gpus_per_node": 2, "tensor_model_parallel_size": 2})
    spec = load_spec(str(path))
    done = opskit_cli("plan", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    vocab = padded_vocab_size(5001, spec.model, 2)
    assert vocab == 5120  # a multiple of 128 * TP
    assert plan["parameters"] == 3 * (12 * 128**2 + 13 * 128) + vocab * 128 + 128 * 128 + 2 * 128
    assert plan["parameters"] == model_parameters(spec)
    assert plan["model_state_gb_per_gpu"] == pytest.approx(20 * plan["parameters"] / 2 / 1e9)


@pytest.fixture(scope="module")
def trainer_log(kjv_data, tmp_path_factory) -> Path:
    """A real training log: `opskit train` (the CLI's in-process trainer) for 20 iterations, stdout to a file."""
    folder = tmp_path_factory.mktemp("log")
    args = tiny_trainer_args(kjv_data, folder, train_samples=160, log_interval=2, save=None, load=None,
                             save_interval=None)
    log = folder / "train.log"
    with open(log, "w") as out:
        done = subprocess.run([OPSKIT, "train", *args], stdout=out, stderr=subprocess.PIPE, text=True, cwd=folder,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return log


def losses(text: str) -> list[tuple[int, float]]:
    return [(int(i), float(loss)) for i, loss in re.findall(r" iteration +(\d+)/ +20 \|.* lm loss: (\S+) \|", text)]


def test_logs_show_prints_first_and_last_loss(trainer_log, tmp_path):
    found = losses(trainer_log.read_text())
    assert [i for i, _ in found] == list(range(2, 21, 2))
    (first_it, first), (last_it, last) = found[0], found[-1]
    assert last < first  # it learned something
    summary = f"lm loss: first {first:.4f} (iteration {first_it}), last {last:.4f} (iteration {last_it} of 20)"

    done = opskit_cli("logs", "show", str(trainer_log), "--last", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n").endswith(summary), done.stdout
    rows = [line for line in done.stdout.splitlines() if re.match(r"^\W*\s*(14|16|18|20|2|4|6)\s", line)]
    assert [re.match(r"^\W*\s*(\d+)", row).group(1) for row in rows] == ["16", "18", "20"], done.stdout

    shown = json.loads(opskit_cli("logs", "show", str(trainer_log), "--json", cwd=tmp_path).stdout)
    records = shown["records"]
    assert [(r["iteration"], r["lm_loss"]) for r in records] == found
    assert (shown["first"]["iteration"], shown["progress"]["iterations_left"]) == (2, 0)
    assert all(r["consumed_samples"] == 8 * r["iteration"] and r["train_iters"] == 20 for r in records)

    # The same lines as they land in a chain's main_log.txt (torchrun --tee prefixes), found through a spec name.
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "main_log.txt").write_text(
        "".join(f"[default0]:{line}\n" for line in trainer_log.read_text().splitlines()))
    fake_data = type("Prepared", (), {"data_prefix": tmp_path / "d" / "kjv_text_document"})
    spec = write_spec(tmp_path / "trainings" / "mytrain.yaml", fake_data, run)
    done = opskit_cli("logs", "show", "mytr", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n").endswith(summary)
    assert load_spec(str(spec)).name == "mytrain"


def test_logs_show_without_iteration_lines(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("[opskit] 2026-01-01 00:00:00 job 1 (array task 1_1) nodes n1: start\n")
    done = opskit_cli("logs", "show", str(empty), cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout == f"{empty}: no iteration lines yet\n"


def test_train_passes_flags_to_the_trainer(tmp_path):
    done = opskit_cli("train", "--help", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m opskit.train")
    assert "--exit-duration-in-mins" in done.stdout

    done = opskit_cli("train", "--num-layers", "2", cwd=tmp_path)
    assert done.returncode == 2
    assert "error: the following arguments are required: --hidden-size" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("minutes", "bound"), [("-1", ">= 0"), ("nan", ">= 0"), ("inf", "< 1e+06")])
def test_a_stack_dump_time_that_faulthandler_would_refuse_is_one_error_line(minutes, bound, capsys):
    """faulthandler raises at the first iteration for a negative, NaN or infinite timeout: refused at start."""
    from opskit.train.args import parse_args

    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
             "--global-batch-size 1 --train-samples 1 --lr 1e-4 --data-path d --tokenizer-name-or-path t").split()
    assert parse_args([*flags, "--stack-dump-after-mins", "0"]).stack_dump_after_mins == 0  # off
    with pytest.raises(SystemExit) as stopped:
        parse_args([*flags, "--stack-dump-after-mins", minutes])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m opskit.train: error: argument --stack-dump-after-mins: must be {bound}, got {minutes} "
        "(python -m opskit.train --help lists the flags)")


# --------------------------------------------------------------------------- --json on every command (one sink)

LOGS = REPO / "tests" / "fixtures" / "logs"


def command_tree() -> dict[str, object]:
    """``"ckpt convert"`` -> its click command, for every command of the app (groups walked)."""
    import typer.main

    from opskit.cli.app import app

    def walk(command, path: tuple[str, ...]):
        if hasattr(command, "commands"):  # a group (typer vendors its own click: no isinstance on click.Group)
            for name, sub in command.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield " ".join(path), command

    return dict(walk(typer.main.get_command(app), ()))


def test_every_command_but_the_trainer_has_json():
    tree = command_tree()
    assert len(tree) >= 39 and {"submit", "logs tail", "ckpt convert", "specs new", "nodes clear"} <= set(tree)
    without = {name for name, command in tree.items() if not any("--json" in p.opts for p in command.params)}
    assert without == {"train"}  # the trainer's own flags pass through untouched


def json_of(*args: str, cwd: Path, env: dict | None = None, code: int = 0):
    """The command's stdout as JSON (all of it: nothing else may be printed there)."""
    done = opskit_cli(*args, "--json", cwd=cwd, env=env)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


def test_specs_json_holds_what_the_human_output_shows(tmp_path):
    listed = json_of("specs", "list", cwd=tmp_path)
    names = [entry["name"] for entry in listed]
    assert {"tiny", "tiny:gpu", "tr11-176B-ml"} <= set(names)
    tiny = listed[names.index("tiny")]
    assert (tiny["origin"], tiny["error"], Path(tiny["source"]).name) == ("preset", None, "tiny.yaml")

    shown = json_of("specs", "show", "tiny:gpu", cwd=tmp_path)
    assert (shown["name"], shown["variant"], shown["variants"]) == ("tiny:gpu", "gpu", ["gpu"])
    human = opskit_cli("specs", "show", "tiny:gpu", cwd=tmp_path).stdout
    assert human.startswith(f"# tiny:gpu from {shown['path']}\n")
    assert yaml.safe_load(human) == shown["spec"]  # one result, two renderings
    assert shown["spec"]["parallel"]["tensor_model_parallel_size"] == 2


def test_run_controls_say_in_json_what_they_did(tmp_path):
    fake_data = type("Prepared", (), {"data_prefix": tmp_path / "d" / "kjv_text_document"})
    spec = str(write_spec(tmp_path / "spec.yaml", fake_data, tmp_path / "run"))
    switch = tmp_path / "run" / "kill-switch"
    assert json_of("kill-switch", spec, "on", cwd=tmp_path) == {"kill_switch": str(switch), "state": "on",
                                                                "changed": True}
    assert switch.is_file()
    assert json_of("kill-switch", spec, "on", cwd=tmp_path)["changed"] is False
    assert json_of("kill-switch", spec, "off", cwd=tmp_path)["changed"] is True and not switch.exists()

    assert json_of("nodes", "add", spec, "n1", "n2", "--why", "xid 79", cwd=tmp_path) == {"added": ["n1", "n2"]}
    assert json_of("nodes", "add", spec, "n1", cwd=tmp_path) == {"added": []}
    listed = json_of("nodes", "list", spec, cwd=tmp_path)
    assert list(listed) == ["n1", "n2"] and listed["n1"].endswith(" xid 79")
    assert json_of("nodes", "clear", spec, "n2", cwd=tmp_path) == {"cleared": ["n2"]}
    assert json_of("nodes", "clear", spec, cwd=tmp_path) == {"cleared": ["n1"]}
    assert json_of("nodes", "list", spec, cwd=tmp_path) == {}

    refused = opskit_cli("kill-switch", spec, "maybe", "--json", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    # cancel asks before it acts; under --json it asks nothing (a script reads stdout): --yes, or one error line
    asked = opskit_cli("cancel", spec, "--json", cwd=tmp_path)
    assert (asked.returncode, asked.stdout, asked.stderr) == (1, "", "error: cancel --json asks nothing: add --yes "
                                                                     "to cancel the chain\n")


def test_dry_runs_in_json_write_nothing_and_say_what_would_be_done(tmp_path):
    fake_data = type("Prepared", (), {"data_prefix": tmp_path / "d" / "kjv_text_document"})
    spec = str(write_spec(tmp_path / "spec.yaml", fake_data, tmp_path / "run"))
    run = tmp_path / "run"
    no_slurm = {"PATH": str(tmp_path / "empty")}  # no squeue: the dry run goes on with a note, never asks SLURM
    dry = json_of("submit", spec, "--dry-run", "--array", "3", cwd=tmp_path, env=no_slurm)
    assert (dry["dry_run"], dry["executor"], dry["job_id"], dry["run"]) == (True, "slurm", None, str(run))
    assert dry["command"] == ["sbatch", "--parsable", "--array=1-3%1", str(run / "slurm" / "train.slurm")]
    assert dry["script"].startswith("#!/bin/bash") and dry["script_path"] == str(run / "slurm" / "train.slurm")
    assert any("SLURM did not answer" in note for note in dry["notes"])
    assert any("tokenizer.json is missing" in warning for warning in dry["warnings"])

    cron = json_of("cron", "install", spec, "--via", "slurm", "--dry-run", cwd=tmp_path)
    assert (cron["dry_run"], cron["installed"]["method"], cron["installed"]["job_ids"]) == (True, "slurm", [])
    assert cron["command"] == ["sbatch", "--parsable", str(run / "cron" / "cron.slurm")]
    assert f"status {spec}" in cron["script"]
    assert not run.exists()  # neither wrote anything

    # An error under --json is still the one `error:` line on stderr, with the command's exit code, and no JSON.
    for args, code in ((["cron", "uninstall", spec, "--dry-run"], 1), (["status", "no-such-spec"], 2)):
        done = opskit_cli(*args, "--json", cwd=tmp_path)
        assert (done.returncode, done.stdout) == (code, ""), done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr


def test_logs_commands_in_json(tmp_path):
    log = LOGS / "tr11-176B-spike.txt"
    assert opskit_cli("logs", "parse", str(log), "--json", cwd=tmp_path).stdout == \
        opskit_cli("logs", "parse", str(log), cwd=tmp_path).stdout  # JSON Lines: what --format jsonl writes
    both = opskit_cli("logs", "parse", str(log), "--json", "--format", "csv", cwd=tmp_path)
    assert (both.returncode, both.stdout, both.stderr) == (1, "", "error: --json writes JSON Lines: leave out "
                                                                  "--format csv\n")

    shown = json_of("logs", "show", str(log), "--last", "2", cwd=tmp_path)
    assert len(shown["records"]) == 2 and shown["file"] == str(log)
    found = json_of("logs", "spikes", str(log), cwd=tmp_path)
    assert {s["metric"] for s in found["spikes"]} == {"lm_loss", "grad_norm"}
    assert all(s["peak_iteration"] == 31219 for s in found["spikes"])

    plotted = json_of("logs", "plot", str(log), "--out", str(tmp_path / "loss.png"), cwd=tmp_path)
    assert plotted["image"] == str(tmp_path / "loss.png") and (tmp_path / "loss.png").stat().st_size > 0
    [series] = plotted["series"]
    assert (series["name"], plotted["y"], series["spikes"]) == ("tr11-176B-spike", "lm_loss", [[31219, 5.098124]])
    assert series["points"] > 10 and series["x_first"] < series["x_last"]
    terminal = opskit_cli("logs", "plot", str(log), "--json", cwd=tmp_path)
    assert (terminal.returncode, terminal.stdout) == (1, "") and "--json needs --out" in terminal.stderr


@pytest.mark.timeout(60)
def test_logs_tail_json_is_one_object_per_line(tmp_path):
    log = tmp_path / "main_log.txt"
    log.write_text("first\nsecond {\"quoted\"}\n")
    proc = subprocess.Popen([OPSKIT, "logs", "tail", str(log), "-n", "2", "--json", "--interval", "0.1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"line": "first"}
        assert json.loads(proc.stdout.readline()) == {"line": 'second {"quoted"}'}
        with open(log, "a") as f:
            f.write("third\n")
        assert json.loads(proc.stdout.readline()) == {"line": "third"}
    finally:
        proc.kill()
        proc.wait()
