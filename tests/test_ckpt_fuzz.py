"""Random damage of a real trainer checkpoint (conftest's ``bloom_run``, hard-linked copies, damaged files rewritten,
never the shared fixture) into ckpt list / inspect / check / set-latest / convert and the resume decision: never a
traceback (only the library's typed one-line errors), and damage the resume would read is never called complete or
OK. Truncation and deletion are caught by the header checks (``describe_step``); a flipped byte inside tensor data
only by ``ckpt check``'s CRC-32 pass, and a flip ``check`` passes must leave what ``torch.load`` reads unchanged.

Counts per run are printed (``pytest -s``) for docs/reliability.md."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opskit.ckpt.check import check_step
from opskit.ckpt.convert import ConvertError, convert_step
from opskit.ckpt.format.info import describe_step, inspect_step, list_steps, resume_point
from opskit.ckpt.format.layout import CheckpointFormatError, resolve_step_dir
from opskit.ckpt.prune import PruneError, set_latest

OPSKIT = str(Path(sys.executable).with_name("opskit"))
TYPED = (CheckpointFormatError, PruneError, ConvertError)
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def pristine(bloom_run, tmp_path_factory) -> Path:
    """One private copy of the run's checkpoints (latest -> global_step20, global_step10 complete)."""
    target = tmp_path_factory.mktemp("pristine") / "checkpoints"
    shutil.copytree(bloom_run / "checkpoints", target)
    return target


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print("\nfuzz case counts:", dict(sorted(COUNTS.items())))


def linked_copy(pristine: Path, where: Path) -> Path:
    """A copy whose files are hard links (fast): damage must replace a file, never write into it."""
    if where.exists():
        shutil.rmtree(where)
    shutil.copytree(pristine, where, copy_function=os.link)
    return where


def replace_bytes(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def step_files(pristine: Path, step: int) -> list[str]:
    return sorted(f.name for f in (pristine / f"global_step{step}").iterdir())


def exercise(checkpoints: Path, out: Path, damaged: int | None = None) -> dict:
    """Every reader on a (damaged) copy; only typed errors are allowed out. Returns what each said; ``check`` runs on
    the ``damaged`` step only (the other is the pristine one)."""
    said = {}
    shutil.rmtree(out, ignore_errors=True)
    _latest, steps = list_steps(checkpoints)
    said["complete"] = {s.iteration: s.complete for s in steps}
    point = resume_point(checkpoints)
    said["resume"] = point.step.iteration if point.step else None
    for step in steps:
        try:
            inspect_step(step.path)
        except TYPED:
            pass
        if step.iteration == damaged:
            said["ok"] = {damaged: check_step(step.path).ok}
    try:
        resolve_step_dir(checkpoints)
    except TYPED:
        pass
    for step in steps:
        try:
            set_latest(checkpoints, step.iteration)
            said.setdefault("set_latest", set()).add(step.iteration)
        except TYPED:
            pass
    damaged_latest = point.latest is None
    if not damaged_latest:
        (checkpoints / "latest").write_text(point.latest)
    try:
        convert_step(checkpoints / "global_step20", out, verify=False)
        said["converted"] = True
    except TYPED:
        said["converted"] = False
    return said


def equal(a, b) -> bool:
    """Deep equality of what torch.load returns (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):  # compared as bytes: NaN == NaN
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and equal(vars(a), vars(b))
    return a == b


def assert_never_certified(said: dict, step: int) -> None:
    assert not said["complete"][step] and not said["ok"][step]
    assert step not in said.get("set_latest", set())
    assert said["resume"] != step
    if step == 20:
        assert said["converted"] is False


@FUZZ
@given(data=st.data())
def test_truncation_is_never_complete(pristine, tmp_path, data):
    step = data.draw(st.sampled_from([10, 20]), label="step")
    name = data.draw(st.sampled_from(step_files(pristine, step)), label="file")
    size = (pristine / f"global_step{step}" / name).stat().st_size
    keep = data.draw(st.integers(0, size - 1), label="keep bytes")
    checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
    victim = checkpoints / f"global_step{step}" / name
    replace_bytes(victim, victim.read_bytes()[:keep])
    said = exercise(checkpoints, tmp_path / "hf", step)
    assert_never_certified(said, step)
    assert said["resume"] == (20 if step == 10 else 10)
    COUNTS["truncated"] += 1


@pytest.mark.parametrize("step", [10, 20])
def test_deletion_of_any_file_is_never_complete(pristine, tmp_path, step):
    for name in step_files(pristine, step):
        checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
        (checkpoints / f"global_step{step}" / name).unlink()
        said = exercise(checkpoints, tmp_path / "hf", step)
        assert_never_certified(said, step)
        COUNTS["deleted"] += 1


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_flipped_bytes_are_caught_or_harmless(pristine, tmp_path, data):
    """A flip that ``check`` (CRC-32) passes must not change what the resume's torch.load reads."""
    step = 20
    name = data.draw(st.sampled_from(step_files(pristine, step)), label="file")
    original = pristine / f"global_step{step}" / name
    raw = bytearray(original.read_bytes())
    offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
    raw[offset] ^= data.draw(st.integers(1, 255), label="xor")
    checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
    victim = checkpoints / f"global_step{step}" / name
    replace_bytes(victim, bytes(raw))
    said = exercise(checkpoints, tmp_path / "hf", step)
    if said["ok"][step]:
        assert said["complete"][step]
        try:
            loaded = torch.load(victim, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any failure of the resume's reader is the finding
            pytest.fail(f"check passed a flip at byte {offset} of {name} that torch.load fails on: {e}")
        assert equal(loaded, torch.load(original, map_location="cpu", weights_only=False)), (name, offset)
        COUNTS["flipped: harmless (zip metadata), passed"] += 1
    elif said["complete"][step]:
        COUNTS["flipped: caught by check's CRC-32 only"] += 1
    else:
        assert_never_certified(said, step)
        COUNTS["flipped: caught by the header checks"] += 1


@settings(FUZZ, max_examples=25)
@given(content=st.one_of(st.binary(max_size=64), st.text(max_size=40).map(str.encode),
                         st.sampled_from([b"../x", b"", b"global_step", b"global_step-1", b"/etc/passwd",
                                          b"global_step20/../global_step10", "global_step٢٠".encode()])))
def test_any_latest_bytes_give_one_line_and_a_complete_resume_step(pristine, tmp_path, content):
    checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").write_bytes(content)
    said = exercise(checkpoints, tmp_path / "hf")
    tag = content.decode("utf-8", "replace").strip()
    assert said["resume"] == (10 if tag == "global_step10" else 20)
    assert said["complete"] == {10: True, 20: True}
    COUNTS["latest bytes"] += 1


CLI_CASES = {
    "truncated layer file": ("global_step20/layer_03-model_00-model_states.pt", "truncate", 30_000),
    "flipped tensor byte": ("global_step20/layer_01-model_00-model_states.pt", "flip", 50_000),
    "binary latest": ("latest", "replace", b"\xff\xfe\x00\x01"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_on_damaged_checkpoints_is_one_line(pristine, tmp_path, case):
    relative, how, value = CLI_CASES[case]
    checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
    victim = checkpoints / relative
    raw = bytearray(victim.read_bytes())
    if how == "truncate":
        raw = raw[:value]
    elif how == "flip":
        raw[value] ^= 0x40
    else:
        raw = bytearray(value)
    replace_bytes(victim, bytes(raw))
    step20 = str(checkpoints / "global_step20")
    runs = {"list": ["list", str(checkpoints)], "check": ["check", step20],
            "set-latest": ["set-latest", str(checkpoints), "20"],
            "convert": ["convert", step20, "--out", str(tmp_path / "hf"), "--no-verify"]}
    codes = {}
    for command, argv in runs.items():
        done = subprocess.run([OPSKIT, "ckpt", *argv], capture_output=True, text=True, timeout=300)
        assert "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        assert done.returncode in (0, 1) and done.stderr.count("\n") <= 1, (command, done.stderr)
        codes[command] = done.returncode
    damaged_step20 = case != "binary latest"
    assert codes["check"] == (1 if damaged_step20 else 0)
    assert codes["set-latest"] == (1 if case.startswith("truncated") else 0)  # a flip is seen only by check
    assert codes["convert"] == (1 if case.startswith("truncated") else 0)


def _structure(path: Path) -> dict[str, int]:
    """Byte offsets of zip fields that Python's zipfile reads past but torch's reader (miniz) does not."""
    import zipfile

    archive = zipfile.ZipFile(path)
    zip64_end = archive.start_dir + sum(46 + len(i.orig_filename) + len(i.extra) + len(i.comment)
                                        for i in archive.infolist())
    return {"zip64 end record: disk number": zip64_end + 16, "zip64 locator: total disks": zip64_end + 56 + 16,
            "central entry: directory attribute": archive.start_dir + 38,
            "central entry: data offset": archive.start_dir + 43}


@pytest.mark.parametrize("field", ["zip64 end record: disk number", "zip64 locator: total disks",
                                   "central entry: directory attribute", "central entry: data offset"])
def test_zip_fields_torch_refuses_are_never_complete(pristine, tmp_path, field):
    """Found by fuzzing: flips zipfile reads past, but torch.load fails on (or reads other bytes through)."""
    checkpoints = linked_copy(pristine, tmp_path / "checkpoints")
    victim = checkpoints / "global_step20" / "layer_01-model_00-model_states.pt"
    raw = bytearray(victim.read_bytes())
    raw[_structure(victim)[field]] ^= 0x10
    replace_bytes(victim, bytes(raw))
    try:
        same = equal(torch.load(victim, weights_only=False),
                     torch.load(pristine / "global_step20" / victim.name, weights_only=False))
    except Exception:  # noqa: BLE001 - torch's reader fails in several ways (RuntimeError, UnpicklingError)
        same = False
    assert not same  # the damage matters to the resume
    info = describe_step(checkpoints / "global_step20")
    assert not info.complete and info.problems[0].startswith(f"{victim}: cannot be loaded (")
