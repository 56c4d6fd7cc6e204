"""A built wheel, installed outside the repository, renders its job scripts: the templates ship inside the package
(opskit/slurm/templates/, which the repository's slurm_templates/ links to) and are read from it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

from conftest import REPO

TEMPLATES = ("opskit/slurm/templates/train.slurm", "opskit/slurm/templates/cron.slurm")


def test_slurm_templates_is_the_package_folder():
    link = REPO / "slurm_templates"
    assert link.is_symlink() and os.readlink(link) == "opskit/slurm/templates"
    assert sorted(p.name for p in link.iterdir()) == ["cron.slurm", "train.slurm"]


def test_built_wheel_submits_and_installs_cron_from_anywhere(tmp_path):
    # Build from a copy of what the wheel is made of, so that the build leaves nothing in the repository.
    source = tmp_path / "source"
    shutil.copytree(REPO / "opskit", source / "opskit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=120, env=env)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp_path / "dist").glob("opskit-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for template in TEMPLATES:  # the files themselves, not links
            assert archive.read(template) == (REPO / template).read_bytes()

    # A fresh venv that sees this interpreter's packages (the dependencies) but not the repository.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    [site] = venv.glob("lib/python*/site-packages")
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                                "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=120,
                               env=env)
    assert installed.returncode == 0, installed.stderr

    work = tmp_path / "work"
    for name in ("tokenizer/tokenizer.json", "kjv_text_document.bin", "kjv_text_document.idx"):  # tiny's data.dir
        (work / "data" / "kjv" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "data" / "kjv" / name).touch()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import opskit; print(opskit.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert where.stdout.strip() == str(site / "opskit" / "__init__.py"), where.stdout + where.stderr

    opskit = str(venv / "bin" / "opskit")
    done = subprocess.run([opskit, "submit", "tiny", "--dry-run"], capture_output=True, text=True, cwd=work, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=tiny\n")
    assert done.stdout.splitlines()[-1].startswith("# would run: sbatch --parsable --array=1-2%1 ")
    done = subprocess.run([opskit, "cron", "install", "tiny", "--via", "slurm", "--dry-run"], capture_output=True,
                          text=True, cwd=work, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=tiny-cron\n")
    assert sorted(p.name for p in work.iterdir()) == ["data"]  # dry runs: no runs/ folder
