"""Golden files: the job script and DeepSpeed JSON of every bundled preset and variant, rendered from fixed inputs and
compared byte for byte with tests/golden/, so that every change to what a cluster runs is a diff someone reviews.

After an intended change: ``OPSKIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`` rewrites the files (and
deletes those of removed presets), reports each file it changed as a skip, and the diff goes into the commit.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from opskit.run.paths import RunPaths
from opskit.spec.files import preset_names
from opskit.spec.load import load_spec, resolve_spec
from opskit.submission.render import RenderedJob, render_job

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("OPSKIT_UPDATE_GOLDEN") == "1"
REGENERATE = "OPSKIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py"

# The machine-independent world the goldens are rendered in: the project (the current directory, where a preset's
# relative data.dir starts) is /, the run directory /runs/<name>, and the environment holds only Jean Zay's variables.
PROJECT = Path("/")
PYTHON = "/opt/venv/bin/python"
ENVIRONMENT = {"six_ALL_CCFRWORK": "/gpfswork/rech/six/commun", "six_ALL_CCFRSCRATCH": "/gpfsscratch/rech/six/commun"}
FILES = ("train.slurm", "ds_config.json")


def spec_names() -> list[str]:
    """Every bundled preset, and each of its variants as ``NAME:VARIANT``."""
    return [name for preset in preset_names()
            for name in (preset, *(f"{preset}:{variant}" for variant in resolve_spec(preset).variants))]


def golden_dir(name: str) -> Path:
    """tests/golden/NAME/, and tests/golden/NAME/VARIANT/ for ``NAME:VARIANT``."""
    return GOLDEN.joinpath(*name.split(":"))


def render_fixed(name: str, monkeypatch: pytest.MonkeyPatch) -> RenderedJob:
    """The job of spec ``name`` rendered from the fixed inputs above, whatever this machine's environment and current
    directory (an unset ``$VAR`` a preset uses raises SpecError: add it to ENVIRONMENT)."""
    with monkeypatch.context() as m:
        for var in list(os.environ):
            m.delenv(var)
        for var, value in ENVIRONMENT.items():
            m.setenv(var, value)
        m.chdir(PROJECT)
        return render_job(load_spec(name), RunPaths(PROJECT / "runs" / name.replace(":", "/")), python=PYTHON,
                          exclude=[])


@pytest.fixture(scope="module", autouse=True)
def no_update_under_ci():
    """CI compares; only a developer rewrites."""
    if UPDATE and os.environ.get("CI"):
        pytest.fail("OPSKIT_UPDATE_GOLDEN is set under CI, where it would accept any output", pytrace=False)


@pytest.mark.parametrize("name", spec_names())
def test_rendered_job_matches_its_golden_files(name, monkeypatch):
    job = render_fixed(name, monkeypatch)
    rendered = {"train.slurm": job.script, "ds_config.json": job.ds_config}
    changed: list[str] = []
    for file in FILES:
        path = golden_dir(name) / file
        where = path.relative_to(GOLDEN.parent.parent)
        old = path.read_text() if path.exists() else None
        if old == rendered[file]:
            continue
        if UPDATE:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rendered[file])
            changed.append(str(where))
        elif old is None:
            pytest.fail(f"{where} is missing; write it with: {REGENERATE}", pytrace=False)
        else:
            diff = "".join(difflib.unified_diff(old.splitlines(keepends=True), rendered[file].splitlines(keepends=True),
                                                f"{where} (golden)", f"{where} (rendered now)"))
            pytest.fail(f"{diff}\nthe rendered {file} of {name} changed; if that is intended, regenerate the golden "
                        f"files and commit their diff: {REGENERATE}", pytrace=False)
    if changed:
        pytest.skip(f"rewrote {', '.join(changed)}: review `git diff tests/golden` and commit it")


def test_every_golden_file_belongs_to_a_spec():
    expected = {golden_dir(name) / file for name in spec_names() for file in FILES}
    stale = sorted(p for p in GOLDEN.rglob("*") if p.is_file() and p not in expected)
    if stale and UPDATE:
        for path in stale:
            path.unlink()
        deleted = ", ".join(str(path.relative_to(GOLDEN.parent.parent)) for path in stale)
        pytest.skip(f"deleted {deleted}: review `git diff tests/golden` and commit it")
    assert not stale, f"golden files of no bundled spec (a removed preset or variant?): delete them, or: {REGENERATE}"


def test_golden_job_scripts_pass_shellcheck(shellcheck):
    shellcheck(*(golden_dir(name) / "train.slurm" for name in spec_names()))
