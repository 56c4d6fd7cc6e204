"""``opskit ckpt reshape`` on a real trainer step (the tiny BLOOM of ``bloom_run``, ZeRO-1 fp32 at DP=1) and on
hand-built ZeRO-0 steps: the target layout checked in one line, the universal folder written verified beside the step
(or elsewhere with --out), an interrupted conversion, and what ``ckpt list/inspect/prune/backup`` do with universal
folders."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from megatron_ckpt import build_checkpoint

from opskit.ckpt.backup import backup
from opskit.ckpt.format.layout import load_state
from opskit.ckpt.format.universal import universal_origin

OPSKIT = str(Path(sys.executable).with_name("opskit"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, "ckpt", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def ckpt(bloom_run, tmp_path) -> Path:
    """A copy of bloom_run's checkpoint dir: global_step10, global_step20 (latest), saved at TP=1 PP=1 DP=1."""
    return Path(shutil.copytree(bloom_run / "checkpoints", tmp_path / "checkpoints"))


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tensors_in(step: Path) -> int:
    """The parameters of a TP=1 step: every tensor of its layer files."""
    return sum(len(load_state(f, light=True)) for f in step.glob("layer_*-model_00-model_states.pt"))


def test_reshape_writes_the_verified_universal_folder_the_trainer_reads(ckpt, tmp_path):
    before = digest(ckpt / "global_step20")
    done = cli("reshape", str(ckpt), "--tp", "1", "--pp", "1", "--dp", "2")
    assert done.returncode == 0, done.stderr
    universal = ckpt / "global_step20_universal"
    assert done.stdout.splitlines() == [
        f"wrote {universal}: universal, from global_step20 at TP=1 PP=1 DP=1 -> TP=1 PP=1 DP=2; "
        f"{tensors_in(ckpt / 'global_step20')} tensors verified against global_step20's weights",
        f"resume with --load {ckpt} on TP=1 PP=1 DP=2: the trainer reads global_step20_universal"]
    assert universal_origin(universal)["layout"] == "TP=1 PP=1 DP=1"
    assert (universal / "zero" / "3.self_attention.query_key_value.weight" / "exp_avg.pt").is_file()
    assert digest(ckpt / "global_step20") == before  # the step is only read
    assert not list(ckpt.glob(".*"))  # no staging folder left

    again = cli("reshape", str(ckpt / "global_step20"), "--tp", "2", "--pp", "2", "--dp", "1", "--json")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert (report["reused"], report["universal"], report["target"]) == (True, str(universal), "TP=2 PP=2 DP=1")

    # Not latest's step: the line says how to make the trainer resume from it.
    older = cli("reshape", str(ckpt / "global_step10"), "--tp", "1", "--pp", "1", "--dp", "2")
    assert older.returncode == 0, older.stderr
    assert older.stdout.splitlines()[1] == (
        f"resume with --load {ckpt} on TP=1 PP=1 DP=2: the trainer reads global_step10_universal (latest names "
        f"global_step20: `opskit ckpt set-latest {ckpt} 10` to resume from this one)")


def test_reshape_out_elsewhere_and_the_targets_it_refuses(ckpt, tmp_path):
    out = tmp_path / "elsewhere" / "u20"
    done = cli("reshape", str(ckpt), "--tp", "1", "--pp", "1", "--dp", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == (f"the trainer reads only {ckpt / 'global_step20_universal'}: move the "
                                           "folder there to resume from it (or the trainer converts the step again)")
    assert universal_origin(out)["step"] == "global_step20"
    assert not (ckpt / "global_step20_universal").exists()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for target, message in [
        (foreign, f"error: {foreign}: exists and holds files opskit did not write; choose another --out (opskit "
                  "never deletes what it did not write)\n"),
        (out, f"error: {out}: holds the universal form of global_step20, not of global_step10; choose another "
              "--out\n"),
    ]:
        refused = cli("reshape", str(ckpt / "global_step10"), "--tp", "1", "--pp", "1", "--dp", "2", "--out",
                      str(target))
        assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", message)
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1


def test_unreachable_layouts_are_refused_in_one_line_before_anything_is_written(ckpt):
    step = ckpt / "global_step20"
    for flags, why in [
        (("--tp", "3", "--pp", "1", "--dp", "1"), "cannot run on TP=3 PP=1 DP=1: the checkpoint's num_attention_heads "
                                                  "4 is not divisible by TP=3 (Megatron splits heads over TP): use TP "
                                                  "in 1, 2, 4"),
        (("--tp", "1", "--pp", "5", "--dp", "1"), "cannot run on TP=1 PP=5 DP=1: PP=5 exceeds the 2 layers (+2 "
                                                  "embeddings): some pipeline stages would be empty"),
    ]:
        refused = cli("reshape", str(step), *flags)
        assert (refused.returncode, refused.stderr) == (1, f"error: {step}: {why}\n")
    assert cli("reshape", str(step), "--tp", "0", "--pp", "1", "--dp", "1").returncode == 2  # typer: usage
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step10", "global_step20"]


def test_zero0_steps_need_no_conversion_for_dp_and_refuse_the_rest(tmp_path):
    fp32 = build_checkpoint(tmp_path / "fp32", arch="bloom", tp=2, dtype=torch.float32, zero_stage=0)
    same_mp = cli("reshape", str(fp32), "--tp", "2", "--pp", "1", "--dp", "4")
    assert same_mp.returncode == 0, same_mp.stderr
    assert same_mp.stdout == ("global_step100 was saved at TP=2 PP=1 DP=1; TP=2 PP=1 DP=4 needs no conversion (ZeRO "
                              "stage 0 keeps the optimizer unpartitioned in the mp_rank files, which fit any DP size: "
                              "the trainer resumes it as it is); nothing written\n")
    tp_change = cli("reshape", str(fp32), "--tp", "1", "--pp", "1", "--dp", "2")
    assert (tp_change.returncode, tp_change.stderr) == (
        1, f"error: {fp32}: layout TP=2 PP=1 DP=1 -> TP=1 PP=1 DP=2: a ZeRO stage 0 step keeps its optimizer "
           "unpartitioned; it resumes on another DP size, but a TP or PP change needs ZeRO stage 1\n")

    # bf16 ZeRO-0 partitions its optimizer (BF16_Optimizer): converted like ZeRO-1 (tests/test_reshape.py runs it);
    # this Megatron-DeepSpeed-made step pickles megatron.enums, which torch.load cannot import here: one line
    bf16 = build_checkpoint(tmp_path / "bf16", arch="bloom", tp=1, dtype=torch.bfloat16, zero_stage=0)
    refused = cli("reshape", str(bf16), "--tp", "1", "--pp", "1", "--dp", "2")
    assert (refused.returncode, refused.stderr) == (
        1, f"error: {bf16}: its pickles need the module megatron.enums (Megatron-DeepSpeed's own "
           "checkpoints pickle megatron.enums): convert it where that module is importable\n")
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == ["global_step100", "latest"]
    assert sorted(p.name for p in (tmp_path / "bf16").iterdir()) == ["global_step100", "latest"]


def test_an_interrupted_reshape_leaves_the_step_untouched_and_the_next_one_completes(ckpt):
    step = ckpt / "global_step20"
    before = digest(step)
    command = [OPSKIT, "ckpt", "reshape", str(step), "--tp", "1", "--pp", "1", "--dp", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = ckpt / f".global_step20_universal.tmp-{proc.pid}"
    try:
        while not staging.exists() and proc.poll() is None:  # created before DeepSpeed is even imported
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert staging.is_dir()  # the killed conversion's leftovers, under their hidden name only
    assert not (ckpt / "global_step20_universal").exists()
    assert digest(step) == before

    listed = cli("list", str(ckpt))
    assert "universal" not in listed.stdout  # a hidden staging folder is no universal folder
    done = cli("reshape", str(step), "--tp", "1", "--pp", "1", "--dp", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {ckpt / 'global_step20_universal'}: ")
    assert not staging.exists() and not list(ckpt.glob(".*"))
    assert digest(step) == before


def test_list_and_inspect_show_where_a_universal_folder_and_a_reshaped_step_come_from(ckpt):
    assert cli("reshape", str(ckpt), "--tp", "1", "--pp", "1", "--dp", "2").returncode == 0
    unfinished = ckpt / "global_step10_universal"
    unfinished.mkdir()  # e.g. someone's own ds_to_universal output: no marker
    listed = cli("list", str(ckpt))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-2:] == [
        "global_step10_universal  not a universal checkpoint opskit finished (no marker): the trainer refuses it; "
        "move it away",
        "global_step20_universal  universal, from global_step20 at TP=1 PP=1 DP=1"]
    as_json = json.loads(cli("list", str(ckpt), "--json").stdout)
    assert [(u["step"], u["origin"] and u["origin"]["layout"]) for u in as_json["universal"]] == \
        [(10, None), (20, "TP=1 PP=1 DP=1")]
    assert [s["step"] for s in as_json["steps"]] == [10, 20]  # universal folders are not steps

    shown = cli("inspect", str(ckpt / "global_step20_universal"))
    assert (shown.returncode, shown.stdout) == (
        0, f"{ckpt / 'global_step20_universal'}: universal, from global_step20 at TP=1 PP=1 DP=1\n")

    # A step saved after a resume on another layout carries the trainer's reshaped_from in its client state.
    client = ckpt / "global_step20" / "mp_rank_00_model_states.pt"
    state = torch.load(client, map_location="cpu", weights_only=False)
    state["reshaped_from"] = "global_step10 at TP=1 PP=1 DP=2"
    torch.save(state, client)
    inspected = cli("inspect", str(ckpt / "global_step20"))
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.splitlines()[1] == \
        "  reshaped from global_step10 at TP=1 PP=1 DP=2 (resumed on another layout)"
    assert json.loads(cli("inspect", str(ckpt), "--json").stdout)["reshaped_from"] == "global_step10 at TP=1 PP=1 DP=2"


def test_prune_removes_opskits_universal_folder_of_a_pruned_step_only_and_backup_skips_them(ckpt, tmp_path):
    shutil.copytree(ckpt / "global_step10", ckpt / "global_step5")
    assert cli("reshape", str(ckpt / "global_step10"), "--tp", "1", "--pp", "1", "--dp", "2").returncode == 0
    assert cli("reshape", str(ckpt / "global_step20"), "--tp", "1", "--pp", "1", "--dp", "2").returncode == 0
    foreign = ckpt / "global_step5_universal"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not opskit's")

    target = tmp_path / "backup"
    results = backup(ckpt, f"file://{target}")
    assert [r.tag for r in results] == ["global_step5", "global_step10", "global_step20"]
    assert not [p for p in target.rglob("*") if "_universal" in str(p)]  # rebuilt from the step when needed

    dry = cli("prune", str(ckpt), "--keep", "last:1", "--force", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-3:] == ["would delete global_step5", "would delete global_step10",
                                            "would delete global_step10_universal  (its universal form)"]
    done = cli("prune", str(ckpt), "--keep", "last:1", "--force", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["universal"] == [str(ckpt / "global_step10_universal")]
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step20", "global_step20_universal",
                                                                   "global_step5_universal"]
    assert (foreign / "notes.txt").read_text() == "not opskit's"
