"""Without an optional extra, every command says which one in one line: the CLI runs in a
subprocess where the extra's modules cannot be imported (a meta path finder raising ModuleNotFoundError, as on a
login node without them); one rule (opskit.errors.extra_for) maps the module to its extra of pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from megatron_ckpt import build_checkpoint

REPO = Path(__file__).resolve().parents[1]

# argv[1]: comma-separated top-level modules made unimportable; the rest is opskit's command line.
BLOCKED_CLI = ("import sys\n"
               "BLOCKED = sys.argv.pop(1).split(',')\n"
               "class _Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in BLOCKED:\n"
               "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
               "sys.meta_path.insert(0, _Block())\n"
               "from opskit.cli.app import main\n"
               "sys.argv[0] = 'opskit'\n"
               "main()\n")


def without(modules: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED_CLI, modules, *map(str, argv)], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def inputs(kjv_data, tmp_path_factory) -> dict[str, Path]:
    """A checkpoint step, a converted-looking model folder, a tokenizer and a data spec: what each command reads
    before it imports the extra's modules."""
    root = tmp_path_factory.mktemp("extras")
    step = build_checkpoint(root / "checkpoints", arch="gpt2", tp=1, layers=1, dtype=torch.float32,
                            tokenizer_dir=kjv_data.tokenizer_dir, data_prefix=kjv_data.data_prefix)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}\n")
    (root / "doc.txt").write_text("In the beginning God created the heaven and the earth.\n")
    spec = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
    spec["data"] = {"corpus": [str(root / "doc.txt")], "dir": str(root / "data"), "name": "c", "vocab_size": 300}
    (root / "d.yaml").write_text(yaml.safe_dump(spec))
    return {"root": root, "step": step, "model": root / "model", "tokenizer": kjv_data.tokenizer_dir,
            "spec": root / "d.yaml"}


CASES = [
    ("torch", ["ckpt", "check", "{step}"], "train"),
    ("torch", ["ckpt", "generate", "{model}"], "train"),
    ("transformers", ["ckpt", "generate", "{model}"], "convert"),
    ("tokenizers", ["ckpt", "convert", "{step}", "--tokenizer", "{tokenizer}", "--out", "{root}/hf"], "convert"),
    ("transformers", ["ckpt", "convert", "{step}", "--tokenizer", "{tokenizer}", "--out", "{root}/hf"], "convert"),
    ("tokenizers", ["data", "prepare", "{spec}"], "train"),  # data prepare needs all of the trainer's extra
    ("megatron", ["data", "prepare", "{spec}"], "train"),
    ("matplotlib", ["logs", "plot", str(REPO / "tests" / "fixtures" / "logs" / "restart.txt"), "--out", "{root}/p.png"],
     "plot"),
]


@pytest.mark.parametrize(("blocked", "argv", "extra"), CASES, ids=[f"{c[1][0]} {c[1][1]} without {c[0]}"
                                                                    for c in CASES])
def test_a_command_without_its_extra_is_one_line_naming_it(inputs, blocked, argv, extra):
    done = without(blocked, *(a.format(**inputs) for a in argv), cwd=inputs["root"])
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and done.stdout.strip() == "", done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith(("  ", "/"))]  # torch's numpy warning
    assert lines == [f"error: {blocked} is not installed: pip install 'opskit[{extra}]'"], done.stderr
    assert not (inputs["root"] / "hf").exists()


def test_the_rule_maps_modules_to_pyproject_extras():
    from opskit.errors import extra_for

    assert extra_for("torch") == "train" and extra_for("megatron") == "train" and extra_for("numpy") == "train"
    assert extra_for("transformers") == "convert" and extra_for("tokenizers") == "convert"  # the smaller extra
    assert extra_for("tokenizers", prefer="train") == "train"
    assert extra_for("google.cloud.storage") == "gcs" and extra_for("google_crc32c") == "backup"
    assert extra_for("huggingface_hub") == "hub" and extra_for("plotext") == "plot"
    assert extra_for("PIL") is None and extra_for("opskit.nothing") is None  # no extra's: a traceback, not a hint


def test_submit_checks_that_the_jobs_python_can_import_the_trainer(tmp_path):
    """From an install without the train extra, `submit --dry-run` was clean and every task failed
    at start with "No module named 'torch'". The job's Python (this one, as rendered) is asked now; a sitecustomize
    hides torch from it as such an install would."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hide'}{os.pathsep}{REPO}"}
    opskit = [sys.executable, "-m", "opskit.cli.app", "submit", "tiny", "--executor", "local"]  # no queue to ask
    dry = subprocess.run([*opskit, "--dry-run"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr
    want = f"the job's Python {sys.executable} cannot import torch: every task would fail at start"
    assert want in dry.stdout + dry.stderr
    real = subprocess.run(opskit, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert real.returncode == 1 and want in real.stderr and not (tmp_path / "runs").exists(), real.stderr
    fine = subprocess.run([*opskit, "--dry-run"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "cannot import" not in fine.stdout + fine.stderr
