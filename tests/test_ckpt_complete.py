"""One definition of a complete checkpoint step (opskit.ckpt.format.info.describe_step), used by ckpt list / check /
set-latest / prune / backup / convert, the watchdog and the trainer's resume; a broken ``latest`` never crash-loops
the chain. Real trainer checkpoints (conftest's ``bloom_run``), copied before any damage; the trainer's resumes of the
damaged copies run in one process (:func:`resumed`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import run_trainer, run_trainer_cases, tiny_trainer_args

from opskit.ckpt.backup import backup
from opskit.ckpt.check import check_step
from opskit.ckpt.convert import convert_all, convert_step
from opskit.ckpt.format.info import describe_step, inspect_step, list_steps, resume_point
from opskit.ckpt.format.layout import CheckpointFormatError
from opskit.ckpt.prune import parse_keep, plan_prune, set_latest
from opskit.monitor.checks import checkpoint_findings, log_findings
from opskit.monitor.snapshot import LogRead, read_checkpoints
from opskit.run.paths import RunPaths
from opskit.spec.schema import WatchdogSpec

OPSKIT = str(Path(sys.executable).with_name("opskit"))
SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
ITERATION = re.compile(r" iteration\s+(\d+)/.*? lm loss: (\S+) \|")


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, *args], capture_output=True, text=True, timeout=timeout)


def copy_run(bloom_run: Path, tmp_path: Path) -> Path:
    """A private copy of the shared run folder (checkpoints only): damage is done to the copy."""
    shutil.copytree(bloom_run / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run"


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in ITERATION.finditer(stdout)}


def resume_args(data, run: Path) -> list[str]:
    """The trainer's flags for ``bloom_run``'s run (every iteration logged) on the run folder ``run``."""
    return tiny_trainer_args(data, run, train_samples=160, save_interval=10, log_interval=1)


def mtimes(checkpoints: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}


@pytest.fixture(scope="module")
def control(kjv_data, bloom_run, tmp_path_factory) -> dict[int, str]:
    """The losses of an uninterrupted resume from ``bloom_run``'s global_step10 (iterations 11..20), in a process of
    its own: the resumes compared with it run in another (:func:`resumed`)."""
    run = copy_run(bloom_run, tmp_path_factory.mktemp("control"))
    set_latest(run / "checkpoints", 10)
    done = run_trainer(resume_args(kjv_data, run))
    assert done.returncode == 0 and "WARNING: checkpoint" not in done.stdout, done.stderr[-3000:]
    return losses(done.stdout)


def damage_the_newest_step(run: Path) -> dict:
    truncate(run / "checkpoints" / "global_step20" / SHARD)
    return {}


def damage_every_step(run: Path) -> dict:
    """Both steps' first block truncated; ``before``: every checkpoint file's mtime then."""
    for step in (10, 20):
        truncate(run / "checkpoints" / f"global_step{step}" / "layer_03-model_00-model_states.pt")
    return {"before": mtimes(run / "checkpoints")}


def write_a_binary_latest(run: Path) -> dict:
    (run / "checkpoints" / "latest").write_bytes(BAD_LATEST["binary"])
    return {}


def prune_and_restore(run: Path) -> dict:
    """The runbook's round trip through the CLI: a --with-optim backup beside ``run``, prune deletes global_step10,
    restore brings it back, set-latest. Each command's finished process (by its name), ``pruned``: whether step 10
    was gone after prune, ``latest``: what latest named at the end."""
    checkpoints, url = run / "checkpoints", f"file://{run.parent / 'backup'}"
    done = {"backup": cli("ckpt", "backup", str(checkpoints), "--to", url, "--with-optim"),
            "prune": cli("ckpt", "prune", str(checkpoints), "--keep", "last:1")}
    done["pruned"] = not (checkpoints / "global_step10").exists()
    done["restore"] = cli("ckpt", "restore", url, str(checkpoints), "--step", "10")
    done["set-latest"] = cli("ckpt", "set-latest", str(checkpoints), "10")
    done["latest"] = (checkpoints / "latest").read_text()
    return done


# name -> how a copy of bloom_run is prepared for the trainer's resume; returns what the test reads of it
PREPARED = {
    "newest-step-damaged": damage_the_newest_step, "restored": prune_and_restore,
    "binary-latest": write_a_binary_latest, "no-complete-step": damage_every_step}


class Resumed(NamedTuple):
    run: Path  # the prepared copy of bloom_run, as the resume left it
    prepared: dict  # what its preparation returned
    done: subprocess.CompletedProcess  # the resume


@pytest.fixture(scope="module")
def resumed(kjv_data, bloom_run, tmp_path_factory) -> dict[str, Resumed]:
    """The trainer's resume of each of :data:`PREPARED`'s copies of ``bloom_run``, one after the other in one process
    (independent: each resumes its own copy, and the losses are compared with :func:`control`'s, from another
    process): name -> :class:`Resumed`."""
    root = tmp_path_factory.mktemp("resumed")
    runs = {name: copy_run(bloom_run, root / name) for name in PREPARED}
    prepared = {name: prepare(runs[name]) for name, prepare in PREPARED.items()}
    done = run_trainer_cases({name: resume_args(kjv_data, run) for name, run in runs.items()}, root / "cases")
    return {name: Resumed(runs[name], prepared[name], done[name]) for name in PREPARED}


# --------------------------------------------------------------------------- the truncated optimizer shard


def test_truncated_optimizer_shard_is_incomplete_for_every_command(bloom_run, tmp_path):
    run = copy_run(bloom_run, tmp_path)
    checkpoints = run / "checkpoints"
    victim = checkpoints / "global_step20" / SHARD
    truncate(victim)

    # list: the library and the CLI.
    latest, steps = list_steps(checkpoints)
    assert latest == "global_step20"
    assert [(s.iteration, s.complete) for s in steps] == [(10, True), (20, False)]
    assert steps[1].problems[0].startswith(f"{victim}: ")
    listed = cli("ckpt", "list", str(checkpoints), "--json")
    assert listed.returncode == 0, listed.stderr
    assert [s["complete"] for s in json.loads(listed.stdout)["steps"]] == [True, False]
    assert f"global_step20: {victim}: " in cli("ckpt", "list", str(checkpoints)).stdout

    # check: not OK, naming the shard.
    checked = cli("ckpt", "check", str(checkpoints / "global_step20"))
    assert checked.returncode == 1
    assert f"incomplete: {victim}: " in checked.stdout and "FAILED" in checked.stdout

    # inspect: shows what it can, names the shard, exit 1 (and complete: false in --json).
    inspected = cli("ckpt", "inspect", str(checkpoints / "global_step20"))
    assert inspected.returncode == 1 and f"incomplete: {victim}: " in inspected.stderr, inspected.stderr
    inspected = cli("ckpt", "inspect", str(checkpoints / "global_step20"), "--json")
    report = json.loads(inspected.stdout)
    assert inspected.returncode == 1 and not report["complete"] and report["problems"][0].startswith(f"{victim}: ")
    assert cli("ckpt", "inspect", str(checkpoints / "global_step10")).returncode == 0

    # set-latest: refused, latest unchanged; the complete step is accepted.
    set_latest(checkpoints, 10)
    refused = cli("ckpt", "set-latest", str(checkpoints), "20")
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {checkpoints / 'global_step20'}: incomplete, latest not changed: "
                                     f"{victim}: ") and refused.stderr.count("\n") == 1
    assert (checkpoints / "latest").read_text() == "global_step10"
    (checkpoints / "latest").write_text("global_step20")  # as the trainer left it

    # watchdog: an ALERT naming the bad file and the step the next job resumes from.
    [finding, age] = checkpoint_findings(read_checkpoints(RunPaths(run)), 10, 1.0, running=False, wd=WatchdogSpec(),
                                         now=datetime.now())
    assert (finding.key, finding.severity) == ("checkpoint.incomplete", "alert")
    assert str(victim) in finding.message and "global_step10" in finding.message
    assert finding.data["resume_from"] == "global_step10"
    assert (age.key, age.data["tag"]) == ("checkpoint.age", "global_step10")

    # convert: refused, naming the shard.
    with pytest.raises(CheckpointFormatError, match=re.escape(f"{victim}: ")):
        convert_step(checkpoints / "global_step20", tmp_path / "hf", verify=False)
    assert not (tmp_path / "hf").exists()

    # backup: the incomplete step is flagged and not recorded as backed up; the complete one is.
    results = backup(checkpoints, f"file://{tmp_path / 'backup'}", weights_only=False)
    assert [(r.tag, r.verified) for r in results] == [("global_step10", True), ("global_step20", False)]
    assert results[1].problems[0].startswith(f"incomplete, not backed up: {victim}: ")
    assert not (tmp_path / "backup" / "global_step20").exists()

    # prune: last:1 counts complete steps only, so the newest complete step is kept.
    plan = plan_prune(checkpoints, [parse_keep("last:1")], force=True)
    assert plan.keep == {10: ["last:1"], 20: ["latest"]} and plan.delete == []


def test_deleted_optimizer_shard_and_dp_size_from_the_saved_state(bloom_run, tmp_path):
    run = copy_run(bloom_run, tmp_path)
    step = run / "checkpoints" / "global_step10"
    info = describe_step(step)
    assert (info.tp, info.pp, info.dp, info.complete) == (1, 1, 1, True)
    assert sorted(f.name for f in info.files) == sorted(f.name for f in step.iterdir())  # every file is needed
    (step / SHARD).unlink()
    info = describe_step(step)
    assert (info.dp, info.complete) == (1, False)  # DeepSpeed's dp_world_size in mp_rank_00: DP without the shards
    assert info.problems == [f"{step / SHARD}: no such file"]


# --------------------------------------------------------------------------- the trainer's resume


def test_trainer_resumes_from_the_newest_complete_step_with_the_same_losses(resumed, control):
    damaged, _, done = resumed["newest-step-damaged"]
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {"damaged": done.stdout}
    step20 = damaged / "checkpoints" / "global_step20"
    warnings = [line for line in runs["damaged"].splitlines() if line.startswith("WARNING: checkpoint")]
    assert warnings == [f"WARNING: checkpoint {step20} is incomplete ({step20 / SHARD}: cannot be loaded (not a "
                        "torch.save zip file (File is not a zip file))); resuming from global_step10, the newest "
                        "complete step"]
    assert list(losses(runs["damaged"])) == list(range(11, 21))
    assert losses(runs["damaged"]) == control
    # The save at 20 rewrote the damaged step and moved latest: the chain is healthy again.
    assert describe_step(step20).complete and (damaged / "checkpoints" / "latest").read_text() == "global_step20"

    # The watchdog alerts on the line (it is news: the chain lost a checkpoint's worth of iterations).
    [finding] = [f for f in log_findings(LogRead([], [], runs["damaged"], 0, None), WatchdogSpec(), datetime.now(),
                                         None) if f.key == "log.resume_fallback"]
    assert finding.severity == "alert" and finding.data["resumed_from"] == "global_step10"
    assert str(step20 / SHARD) in finding.message


def test_pp2_ranks_take_the_same_fallback(kjv_data, gpt_pp2_run, tmp_path):
    # Stage 1's optimizer shard is read by rank 1 only: rank 0 decides for both, so neither loads global_step2.
    run = copy_run(gpt_pp2_run, tmp_path)
    victim = run / "checkpoints" / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    truncate(victim)
    done = run_trainer(tiny_trainer_args(kjv_data, run, train_samples=16, save_interval=1, log_interval=1,
                                         position_embedding_type="absolute", embed_layernorm=None,
                                         pipeline_model_parallel_size=2), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    [warning] = [line for line in done.stdout.splitlines() if "WARNING: checkpoint" in line]
    assert f"({victim}: cannot be loaded (" in warning and warning.endswith("resuming from global_step1, the newest "
                                                                            "complete step")
    assert list(losses(done.stdout)) == [2] and describe_step(victim.parent).complete


def test_no_complete_step_fails_in_one_line_and_changes_nothing(resumed):
    run, prepared, done = resumed["no-complete-step"]
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and losses(done.stdout) == {}
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error == [f"error: {run / 'checkpoints'}/latest names global_step20, which is incomplete "
                     f"({run / 'checkpoints' / 'global_step20' / 'layer_03-model_00-model_states.pt'}: cannot be "
                     "loaded (not a torch.save zip file (File is not a zip file))), and no older step is complete: "
                     "restore a step from a backup (opskit ckpt verify), or move latest away to start from scratch"]
    assert mtimes(run / "checkpoints") == prepared["before"]


# --------------------------------------------------------------------------- a broken latest


BAD_LATEST = {"binary": b"\x80\xff\x00global_step20\xfe", "path": b"../x", "empty": b"", "directory": None,
              "no step folder": b"global_step30"}


@pytest.mark.parametrize("kind", list(BAD_LATEST))
def test_broken_latest_is_one_line_in_every_command(bloom_run, tmp_path, kind):
    run = copy_run(bloom_run, tmp_path)
    checkpoints = run / "checkpoints"
    (checkpoints / "latest").unlink()
    if BAD_LATEST[kind] is None:
        (checkpoints / "latest").mkdir()
    else:
        (checkpoints / "latest").write_bytes(BAD_LATEST[kind])

    point = resume_point(checkpoints)
    assert point.step.path.name == "global_step20" and point.problem.startswith(f"{checkpoints}/latest")
    for argv in (["ckpt", "inspect", str(checkpoints)], ["ckpt", "check", str(checkpoints)],
                 ["ckpt", "convert", str(checkpoints), "--out", str(tmp_path / "hf"), "--no-verify"]):
        done = cli(*argv)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert done.stderr.startswith(f"error: {checkpoints}/latest") and done.stderr.count("\n") == 1, argv
    listed = cli("ckpt", "list", str(checkpoints))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    listed_json = json.loads(cli("ckpt", "list", str(checkpoints), "--json").stdout)
    if kind == "no step folder":
        assert listed.stdout.splitlines()[0].endswith("latest: global_step30 (no such step)")
        assert (listed_json["latest"], listed_json["latest_problem"]) == ("global_step30", None)
    else:
        assert f"latest: unusable ({checkpoints}/latest: " in listed.stdout.splitlines()[0]
        assert listed_json["latest"] is None and listed_json["latest_problem"].startswith(f"{checkpoints}/latest: ")

    if kind != "directory":  # set-latest repairs it (a directory named latest is not ours to replace)
        fixed = cli("ckpt", "set-latest", str(checkpoints), "10")
        assert fixed.returncode == 0, fixed.stderr
        was = "global_step30" if kind == "no step folder" else "unusable"
        assert fixed.stdout.startswith(f"{checkpoints}/latest: {was}") and fixed.stdout.endswith(" -> global_step10\n")
        assert (checkpoints / "latest").read_text() == "global_step10"
    else:
        refused = cli("ckpt", "set-latest", str(checkpoints), "10")
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr


def test_trainer_with_a_binary_latest_resumes_from_the_newest_complete_step(resumed):
    run, _, done = resumed["binary-latest"]
    latest = run / "checkpoints" / "latest"
    # Nothing left to train after step 20: no save, so latest shows the trainer never rewrites it itself.
    assert done.returncode == 0, done.stderr[-3000:]
    [warning] = [line for line in done.stdout.splitlines() if line.startswith("WARNING: checkpoint")]
    assert warning.startswith(f"WARNING: checkpoint {latest} is unusable ({latest}: ")
    assert warning.endswith("; resuming from global_step20, the newest complete step")
    assert " successfully loaded checkpoint from " in done.stdout and "at iteration 20" in done.stdout
    assert latest.read_bytes() == BAD_LATEST["binary"]


def test_status_reports_a_binary_latest_in_one_alert(bloom_run, tmp_path):
    run = copy_run(bloom_run, tmp_path)
    (run / "checkpoints" / "latest").write_bytes(BAD_LATEST["binary"])
    findings = checkpoint_findings(read_checkpoints(RunPaths(run)), 10, None, running=False, wd=WatchdogSpec(),
                                   now=datetime.now())
    assert [(f.key, f.severity) for f in findings] == [("checkpoint.incomplete", "alert"), ("checkpoint.age", "ok")]
    assert findings[0].data["resume_from"] == "global_step20"
    assert os.fspath(run / "checkpoints" / "latest") in findings[0].message


# --------------------------------------------------------------------------- the right keys in the right place


def test_a_layer_file_in_the_wrong_position_or_an_extra_shard_is_incomplete(bloom_run, tmp_path):
    checkpoints = copy_run(bloom_run, tmp_path) / "checkpoints"
    step = checkpoints / "global_step20"
    num_layers = describe_step(step).num_layers
    final = step / f"layer_{num_layers + 4:02d}-model_00-model_states.pt"
    shutil.copy(step / "layer_03-model_00-model_states.pt", final)  # a block where the final LayerNorm belongs
    info = describe_step(step)
    assert not info.complete and info.problems[0].startswith(f"{final}: keys ")
    assert "expected only 'weight' and 'bias' (the final LayerNorm)" in info.problems[0]
    assert cli("ckpt", "check", str(step)).returncode == 1
    refused = cli("ckpt", "set-latest", str(checkpoints), "20")
    assert refused.returncode == 1 and str(final) in refused.stderr
    with pytest.raises(Exception, match="keys"):  # convert agrees
        convert_step(step, tmp_path / "hf", verify=False)

    # An optimizer shard of a DP rank the step does not have is flagged as an extra layer file is.
    step10 = checkpoints / "global_step10"
    shutil.copy(step10 / SHARD, step10 / SHARD.replace("rank_0_", "rank_1_"))
    assert describe_step(step10).problems == [f"{step10 / SHARD.replace('rank_0_', 'rank_1_')}: not expected for "
                                              f"TP=1, PP=1, {num_layers} layers"]


# --------------------------------------------------------------------------- backups: weights only, and the round trip


def note(step: Path, what: str) -> str:
    return f"note: {step}: a weights-only backup (no optimizer states): {what}; it cannot resume training\n"


def test_a_weights_only_backups_step_converts_inspects_and_checks_with_a_note(bloom_run, tmp_path):
    checkpoints = copy_run(bloom_run, tmp_path) / "checkpoints"
    weights = tmp_path / "weights"
    assert cli("ckpt", "backup", str(checkpoints), "--to", f"file://{weights}").returncode == 0  # the default kind
    step = weights / "global_step20"
    info = describe_step(step)
    assert not (step / SHARD).exists() and (info.complete, info.weights_problems) == (False, [])

    converted = cli("ckpt", "convert", str(step), "--out", str(tmp_path / "hf"))
    assert (converted.returncode, converted.stderr) == (0, note(step, "converted its weights")), converted.stderr
    assert converted.stdout.startswith(f"converted {step} (iteration 20, bloom, ") and ", verified: " in \
        converted.stdout
    original = convert_step(checkpoints / "global_step20", tmp_path / "hf-original", verify=False)
    shards = sorted(p.name for p in original.out_dir.glob("*.safetensors"))
    assert shards and all((tmp_path / "hf" / n).read_bytes() == (original.out_dir / n).read_bytes() for n in shards)
    every = convert_all(weights, tmp_path / "hf-all", verify=False).converted  # --all: both steps' copies
    assert [(c.iteration, c.weights_only_backup) for c in every] == [(10, True), (20, True)]

    inspected = cli("ckpt", "inspect", str(step))
    assert (inspected.returncode, inspected.stderr) == (0, note(step, "inspecting its weights")), inspected.stderr
    assert "layer_03-model_00-model_states.pt\n" in inspected.stdout
    report = json.loads(cli("ckpt", "inspect", str(weights), "--json").stdout)  # the backup's latest
    assert (report["complete"], report["weights_only_backup"]) == (False, True)
    assert report["problems"] == [f"{step / SHARD}: no such file"]

    checked = cli("ckpt", "check", str(step))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stderr == note(step, "checked the files it has, not its 1 optimizer shard(s)")
    assert checked.stdout.startswith(f"{step}: OK, weights only (") and "CRC-checked" in checked.stdout
    # It stays incomplete for everything that resumes: list, set-latest, restore.
    assert [s.complete for s in list_steps(weights)[1]] == [False, False]
    assert cli("ckpt", "set-latest", str(weights), "20").returncode == 1
    assert cli("ckpt", "restore", f"file://{weights}", str(tmp_path / "restored")).returncode == 1


def test_a_step_lacking_its_optimizer_shard_is_refused_unless_its_weights_only_backup_left_it_out(bloom_run, tmp_path):
    checkpoints = copy_run(bloom_run, tmp_path) / "checkpoints"
    full, weights = tmp_path / "full", tmp_path / "weights"
    assert all(r.verified for r in backup(checkpoints, f"file://{full}", weights_only=False)
               + backup(checkpoints, f"file://{weights}"))
    (checkpoints / "global_step20" / SHARD).unlink()  # a local step
    (full / "global_step20" / SHARD).unlink()  # a --with-optim backup's step: its manifest lists the shard
    manifest = weights / "manifests" / "global_step10.json"  # a manifest that does not say it left the shard out
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "left_out": []}))
    (weights / "global_step20" / "layer_03-model_00-model_states.pt").unlink()  # a weights-only copy lacking weights
    local = checkpoints / "global_step20"
    converted = cli("ckpt", "convert", str(local), "--out", str(tmp_path / "hf"), "--no-verify")
    assert (converted.returncode, converted.stderr) == (1, f"error: {local / SHARD}: no such file\n")
    inspected = cli("ckpt", "inspect", str(local))
    assert (inspected.returncode, inspected.stderr) == (1, f"incomplete: {local / SHARD}: no such file\n")
    checked = cli("ckpt", "check", str(local))
    assert checked.returncode == 1 and f"incomplete: {local / SHARD}: no such file\n" in checked.stdout
    assert not checked.stderr
    for step, missing in ((full / "global_step20", SHARD), (weights / "global_step10", SHARD),
                          (weights / "global_step20", "layer_03-model_00-model_states.pt")):
        with pytest.raises(CheckpointFormatError, match=f"^{re.escape(str(step / missing))}: no such file$"):
            convert_step(step, tmp_path / "hf", verify=False)
        assert not inspect_step(step)["weights_only_backup"]
        report = check_step(step, crc=False)
        assert not report.ok and report.left_out == [] and f"{step / missing}: no such file" in report.problems
    assert not (tmp_path / "hf").exists()


def test_backup_prune_restore_and_resume_gives_the_same_losses(resumed, control):
    """The runbook's round trip, through the CLI: a --with-optim backup, prune deletes global_step10, restore brings
    it back, set-latest, and the resume from it logs exactly the losses of a resume from the step never deleted."""
    run, steps, done = resumed["restored"]
    step10 = run / "checkpoints" / "global_step10"
    backed_up, pruned, restored, moved = steps["backup"], steps["prune"], steps["restore"], steps["set-latest"]
    assert backed_up.returncode == 0 and backed_up.stdout.count(", verified\n") == 2, backed_up.stdout
    assert (pruned.returncode, pruned.stderr) == (0, "") and "deleted global_step10\n" in pruned.stdout
    assert steps["pruned"]
    assert restored.returncode == 0 and restored.stdout.startswith(f"restored {step10}: "), restored.stderr
    assert moved.returncode == 0 and steps["latest"] == "global_step10", moved.stderr

    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING: checkpoint" not in done.stdout
    assert list(losses(done.stdout)) == list(range(11, 21))
    assert losses(done.stdout) == control
