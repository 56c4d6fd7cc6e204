"""opskit ckpt prune / set-latest / backup / verify on hand-built Megatron-DeepSpeed checkpoints and file:// targets:
keep-rules (the 13B interpretability schedule), latest never deleted, unbacked-up steps protected, optimizer states
skipped, CRC32C manifests, corruption caught, an interrupted backup resumed."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import google_crc32c
import pytest
import torch
from megatron_ckpt import build_checkpoint

from opskit.ckpt.backup import backup, verify
from opskit.ckpt.prune import PruneError, parse_keep, prune, set_latest

OPSKIT = str(Path(sys.executable).with_name("opskit"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, "ckpt", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def run(kjv_data, tmp_path) -> Path:
    """Checkpoint dir with steps 100, 200, 300 (tiny fp16 GPT-2, TP=2); latest -> global_step200."""
    root = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        build_checkpoint(root, arch="gpt2", tp=2, iteration=step, dtype=torch.float16, layers=1, hidden=32,
                         tokenizer_dir=kjv_data.tokenizer_dir, data_prefix=kjv_data.data_prefix)
    (root / "latest").write_text("global_step200")
    return root


def steps_in(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.name.startswith("global_step")),
                  key=lambda n: int(n[11:]))


# --------------------------------------------------------------------------- keep-rules and prune


def test_interpretability_schedule_keeps_the_13b_rounds():
    kept = sorted(parse_keep("schedule:tr1-13B").keeps(list(range(1, 3001))))
    assert kept[:10] == list(range(10, 101, 10))  # round 1: every 10 up to 100
    assert kept[10:60] == list(range(108, 1000, 18))  # round 2: multiples of 18 in 101-1000 (Megatron's modulo)
    assert kept[60:] == [1500, 3000]  # round 3: every 1500


@pytest.mark.parametrize("text", ["last", "last:x", "every:0", "steps:", "schedule:1-100", "keep:3", "schedule:x/5"])
def test_bad_keep_rules_are_refused_in_one_line(text):
    with pytest.raises(PruneError, match=r"^--keep .*: expected last:K, every:N"):
        parse_keep(text)


def test_prune_never_deletes_latest_nor_the_newest_complete_nor_unbacked_up_steps(run, tmp_path):
    plan = prune(run, [parse_keep("last:0")], dry_run=True)
    assert (plan.delete, sorted(plan.protected)) == ([], [100])  # nothing is backed up yet
    assert plan.keep == {200: ["latest"], 300: ["newest complete step"]}

    forced = prune(run, [parse_keep("last:0")], force=True)
    assert forced.delete == [100]
    assert steps_in(run) == ["global_step200", "global_step300"]  # latest and the newest survive even --force
    assert not [p for p in run.iterdir() if p.name.startswith(".pruning")]


def test_prune_deletes_backed_up_steps_and_dry_run_deletes_nothing(run, tmp_path):
    backup(run, f"file://{tmp_path / 'backup'}", steps=[100], weights_only=False)  # a backup that can resume it
    dry = cli("prune", str(run), "--keep", "steps:300", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete global_step100" in dry.stdout
    assert "keep    global_step200  (latest)" in dry.stdout
    assert "keep    global_step300  (steps:300)" in dry.stdout
    assert steps_in(run) == ["global_step100", "global_step200", "global_step300"]

    done = cli("prune", str(run), "--keep", "steps:300", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["delete"] == [100]
    assert steps_in(run) == ["global_step200", "global_step300"]


def test_set_latest_checks_the_step_and_writes_atomically(run):
    (run / "global_step300" / "layer_03-model_01-model_states.pt").unlink()
    refused = cli("set-latest", str(run), "300")
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {run / 'global_step300'}: incomplete, latest not changed: "
                                     f"{run / 'global_step300' / 'layer_03-model_01-model_states.pt'}: no such file")
    assert (run / "latest").read_text() == "global_step200"

    assert set_latest(run, 100) == "global_step200"
    assert (run / "latest").read_text() == "global_step100"  # no newline, as DeepSpeed writes it
    assert sorted(p.name for p in run.iterdir() if p.is_file()) == ["latest"]
    with pytest.raises(PruneError, match=r"global_step7: no such checkpoint step$"):
        set_latest(run, 7)


def test_latest_is_never_seen_half_written(run, monkeypatch):
    """``write_latest`` (the trainer's and set-latest's) fills a staging file and renames it over ``latest``: a
    process killed before the rename (here: the rename fails) leaves the old ``latest`` whole, never a new one cut
    short, and no staging file (a write in place passed the SIGKILL series: its window is microseconds)."""
    from opskit.ckpt.format.layout import write_latest

    def killed(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr("os.replace", killed)
    monkeypatch.setattr("os.rename", killed)
    with pytest.raises(OSError, match="killed before the rename"):
        write_latest(run, "global_step300")
    assert (run / "latest").read_text() == "global_step200"
    assert sorted(p.name for p in run.iterdir() if p.is_file()) == ["latest"]


# --------------------------------------------------------------------------- backup and verify


def crc32c(path: Path) -> str:
    return base64.b64encode(google_crc32c.Checksum(path.read_bytes()).digest()).decode()


def test_backup_skips_optimizer_states_and_writes_a_verified_manifest(run, tmp_path):
    target = tmp_path / "backup"
    done = cli("backup", str(run), "--to", f"file://{target}", "--steps", "100,200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("global_step100: 8 copied, 0 already there, ")
    assert done.stdout.count(", verified\n") == 2
    copied = sorted(p.name for p in (target / "global_step100").iterdir())
    assert copied == ["layer_01-model_00-model_states.pt", "layer_01-model_01-model_states.pt",
                      "layer_03-model_00-model_states.pt", "layer_03-model_01-model_states.pt",
                      "layer_05-model_00-model_states.pt", "layer_05-model_01-model_states.pt",
                      "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # no zero_*_optim_states.pt
    manifest = json.loads((target / "manifests" / "global_step100.json").read_text())
    assert manifest["complete"] is True and manifest["weights_only"] is True
    for entry in manifest["files"]:
        local = run / entry["path"]
        assert (entry["size"], entry["crc32c"]) == (local.stat().st_size, crc32c(local))
    assert (target / "latest").read_text() == "global_step200"
    assert not (target / "global_step300").exists()

    with_optim = backup(run, f"file://{tmp_path / 'full'}", steps=[300], weights_only=False)
    assert any(k.endswith("zero_pp_rank_0_mp_rank_01_optim_states.pt") for k in with_optim[0].copied)
    assert not (tmp_path / "full" / "latest").exists()  # latest's step is not in that backup

    ok = cli("verify", f"file://{target}")
    assert (ok.returncode, ok.stdout) == (0, "global_step100: OK\nglobal_step200: OK\n")


def test_verify_catches_a_corrupted_and_a_missing_object(run, tmp_path):
    target = tmp_path / "backup"
    backup(run, f"file://{target}", steps=[100])
    victim = target / "global_step100" / "layer_03-model_00-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    victim.write_bytes(bytes(data))
    (target / "global_step100" / "mp_rank_01_model_states.pt").unlink()
    report = verify(f"file://{target}")
    problems = report.steps["global_step100"]
    assert problems[0].startswith("global_step100/layer_03-model_00-model_states.pt: CRC32C ")
    assert problems[1] == "global_step100/mp_rank_01_model_states.pt: missing"
    done = cli("verify", f"file://{target}")
    assert done.returncode == 1
    assert "FAILED" in done.stdout and "mp_rank_01_model_states.pt: missing" in done.stdout

    empty = cli("verify", f"file://{tmp_path / 'nothing'}")
    assert empty.returncode == 1
    assert empty.stderr == f"error: file://{tmp_path / 'nothing'}: no manifests/*.json (not a backup made by " \
                           "opskit ckpt backup)\n"


def test_interrupted_backup_resumes_without_copying_again(run, tmp_path, monkeypatch):
    from opskit.targets.base import TargetError
    from opskit.targets.file import FileTarget

    url = f"file://{tmp_path / 'backup'}"
    real_put, puts = FileTarget.put, []

    def put_then_fail(self, local, key):  # the share fills up (or the job is killed) at the 4th object
        if len(puts) == 3:
            raise OSError(28, "No space left on device")
        real_put(self, local, key)
        puts.append(key)

    monkeypatch.setattr(FileTarget, "put", put_then_fail)
    with pytest.raises(TargetError, match=r"copy failed \(No space left on device\); run the backup again to resume$"):
        backup(run, url, steps=[100], workers=1)
    monkeypatch.setattr(FileTarget, "put", real_put)
    assert not (tmp_path / "backup" / "manifests").exists()  # nothing claims to be a backup yet
    assert not [p for p in (tmp_path / "backup").rglob(".*") if p.is_file()], "temporary files left behind"

    (result,) = backup(run, url, steps=[100], workers=2)
    assert sorted(result.skipped) == sorted(puts)
    assert len(result.copied) == 8 - 3 and result.verified
    assert verify(url).steps == {"global_step100": []}
    assert json.loads((run / ".opskit-backups.json").read_text())[url]["global_step100"]["files"] == 8


def test_unsupported_targets_are_refused_in_one_line(run):
    done = cli("backup", str(run), "--to", "s3://bucket/ckpt")
    assert (done.returncode, done.stderr) == (1, "error: --to s3://bucket/ckpt: expected file:///absolute/path, "
                                                 "gs://bucket/prefix or hf://[datasets/]org/repo[/path]\n")
    published = cli("publish", str(run), "--to", "hf://org/repo")
    assert published.returncode == 1 and "no converted global_stepN folders" in published.stderr


def test_the_model_cards_facts_come_from_the_checkpoint_and_the_log(run, tmp_path):
    from opskit.ckpt.publish import card_facts
    from opskit.train.log import validation_lines

    log = tmp_path / "main_log.txt"
    log.write_text("\n".join(validation_lines("iteration 200", 4.5)) + "\n")
    facts = card_facts(run, log)
    assert facts(200) == {"tokens": 200 * 16 * 32, "validation_loss": 4.5}  # the tokens the step's save recorded
    assert facts(100) == {"tokens": 100 * 16 * 32, "validation_loss": None}  # no validation at that iteration
    assert facts(400) == {"tokens": None, "validation_loss": None}  # a step no longer on disk (pruned)
    assert card_facts(run, tmp_path / "no_log.txt")(200)["validation_loss"] is None


# --------------------------------------------------------------------------- a backup is never trusted wrongly


@pytest.fixture
def other_run(run, tmp_path) -> Path:
    """Another run's checkpoint dir with the same steps; its global_step100 differs in one layer file."""
    import shutil

    root = tmp_path / "runB" / "checkpoints"
    shutil.copytree(run, root)
    layer = root / "global_step100" / "layer_03-model_00-model_states.pt"
    state = torch.load(layer, weights_only=False)
    for tensor in state.values():
        if torch.is_tensor(tensor) and tensor.is_floating_point():
            tensor.add_(1)
    torch.save(state, layer)
    return root


def test_backup_refuses_another_runs_step_at_the_same_key(run, other_run, tmp_path):
    target = tmp_path / "backup"
    assert backup(run, f"file://{target}", steps=[100], weights_only=False)[0].verified
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    done = cli("backup", str(other_run), "--to", f"file://{target}", "--steps", "100")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: file://{target}/manifests/global_step100.json: holds global_step100 of "
                                  f"another checkpoint dir ({run.resolve()})")
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before  # nothing copied
    assert cli("verify", f"file://{target}").returncode == 0
    assert cli("prune", str(run), "--keep", "steps:300").stdout.count("deleted global_step100") == 1


def test_backup_over_an_old_manifest_without_a_source_refuses_other_bytes(run, other_run, tmp_path):
    target = tmp_path / "backup"
    backup(run, f"file://{target}", steps=[100])
    manifest_path = target / "manifests" / "global_step100.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["source"]  # as opskit before sources wrote it
    manifest_path.write_text(json.dumps(manifest))
    done = cli("backup", str(other_run), "--to", f"file://{target}", "--steps", "100")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "global_step100/layer_03-model_00-model_states.pt: differs from" in done.stderr
    assert "global_step100.json names no source" in done.stderr
    same = cli("backup", str(run), "--to", f"file://{target}", "--steps", "100")  # same bytes: adopted
    assert same.returncode == 0, same.stderr
    assert json.loads(manifest_path.read_text())["source"]["dir"] == str(run.resolve())


@pytest.mark.parametrize("damage", ["target removed", "object removed", "object truncated", "manifest incomplete",
                                    "other source"])
def test_prune_checks_the_backup_is_still_there(run, tmp_path, damage):
    import shutil

    target = tmp_path / "backup"
    backup(run, f"file://{target}", steps=[100], weights_only=False)
    manifest_path = target / "manifests" / "global_step100.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "target removed":
        shutil.rmtree(target)
    elif damage == "object removed":
        (target / "global_step100" / "mp_rank_01_model_states.pt").unlink()
    elif damage == "object truncated":
        (target / "global_step100" / "mp_rank_01_model_states.pt").write_bytes(b"x")
    else:
        manifest.update(complete=False) if damage == "manifest incomplete" else \
            manifest.update(source={"dir": "/elsewhere/checkpoints"})
        manifest_path.write_text(json.dumps(manifest))
    done = cli("prune", str(run), "--keep", "steps:300")
    assert done.returncode == 0, done.stderr
    assert "deleted" not in done.stdout
    assert f"keep    global_step100  (backup file://{target}: " in done.stdout
    assert steps_in(run) == ["global_step100", "global_step200", "global_step300"]


@pytest.mark.parametrize("text", [b"{garbage", b"", b"\xff\xfe\x00binary", b"[]", b"{}", b'{"files":5}',
                                  b'{"step": "global_step100", "complete": true, "files": [{"path": 3}]}'])
def test_verify_reports_a_corrupt_manifest_as_a_problem_of_its_step(run, tmp_path, text):
    target = tmp_path / "backup"
    backup(run, f"file://{target}", steps=[100, 200])
    (target / "manifests" / "global_step100.json").write_bytes(text)
    done = cli("verify", f"file://{target}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("global_step100: FAILED\n  manifests/global_step100.json: not a manifest of opskit "
                                  "ckpt backup (expected JSON {step, complete, files: [{path, size, crc32c}]})\n")
    assert "global_step200: OK" in done.stdout


@pytest.mark.parametrize("text", [b"{garbage", b"[]", b'{"file:///x": 5}', b'{"file:///x": {"global_step1": 3}}',
                                  b"\xff\xfe\x00binary", None])
@pytest.mark.parametrize("command", ["prune", "backup"])
def test_a_corrupt_backup_record_is_one_line(run, tmp_path, text, command):
    record = run / ".opskit-backups.json"
    if text is None:
        record.mkdir()
    else:
        record.write_bytes(text)
    target = tmp_path / "backup"
    args = ["--keep", "steps:300"] if command == "prune" else ["--to", f"file://{target}"]
    done = cli(command, str(run), *args)
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {record}: expected ")
    assert not target.exists()  # refused before copying
    assert steps_in(run) == ["global_step100", "global_step200", "global_step300"]


def test_prune_refuses_a_symlinked_step_before_renaming_anything(run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "global_step100").rename(elsewhere / "global_step100")
    (run / "global_step100").symlink_to(elsewhere / "global_step100")
    done = cli("prune", str(run), "--keep", "steps:300", "--force")
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stderr
    assert done.stderr.startswith(f"error: {run / 'global_step100'}: a symbolic link")
    assert sorted(p.name for p in run.iterdir()) == ["global_step100", "global_step200", "global_step300", "latest"]
    assert (elsewhere / "global_step100" / "mp_rank_00_model_states.pt").is_file()


def test_a_missing_checkpoint_dir_is_refused_by_prune_and_backup(tmp_path):
    from opskit.ckpt.format.layout import CheckpointFormatError

    missing = tmp_path / "run" / "checkpoints"  # a spec's run that never saved (the CLI resolves a spec to this)
    for command in (lambda: prune(missing, [parse_keep("last:1")]), lambda: backup(missing, f"file://{tmp_path}/b")):
        with pytest.raises(CheckpointFormatError, match=rf"^{missing}: no such checkpoint dir \(expected a folder"):
            command()
    assert not (tmp_path / "b").exists()


def test_a_backwards_schedule_range_is_refused():
    with pytest.raises(PruneError, match=r"^--keep 'schedule:100-1/10': .*100-1 ends before it starts"):
        parse_keep("schedule:100-1/10")


# --------------------------------------------------------------------------- nothing lost, nothing falsely verified


def flip_a_tensor_byte(layer: Path) -> None:
    """Flip one byte inside the first weight's data of a layer file: its zip headers stay intact (only CRC-32 sees)."""
    state = torch.load(layer, weights_only=False)
    weight = next(v for k, v in state.items() if k.endswith("weight") and v.numel() >= 64)
    data = bytearray(layer.read_bytes())
    at = data.find(weight.contiguous().view(torch.uint8).numpy().tobytes())
    assert at > 0
    data[at + 7] ^= 0x40
    layer.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["itself", "inside", "holding"])
def test_backup_into_its_own_source_is_refused_and_prune_keeps_the_only_copies(run, tmp_path, where):
    to = {"itself": run, "inside": run / "backup", "holding": run.parent}[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    done = cli("backup", str(run), "--to", f"file://{to}", "--with-optim")
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stdout + done.stderr
    assert done.stderr.startswith(f"error: --to file://{to}: ") and "Traceback" not in done.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written
    pruned = cli("prune", str(run), "--keep", "last:1")
    assert pruned.returncode == 0 and "deleted" not in pruned.stdout, pruned.stdout + pruned.stderr
    assert steps_in(run) == ["global_step100", "global_step200", "global_step300"]


def test_prune_does_not_trust_a_recorded_backup_that_lives_in_the_checkpoint_dir(run, monkeypatch):
    import opskit.ckpt.backup as backup_module

    with monkeypatch.context() as patched:  # as an older opskit let it happen
        patched.setattr(backup_module, "overlap_problem", lambda *_: None, raising=False)
        assert all(r.verified for r in backup(run, f"file://{run}", weights_only=False))
    plan = prune(run, [parse_keep("last:1")])
    assert plan.delete == [] and "no second copy (the target is the checkpoint dir" in plan.protected[100]
    assert steps_in(run) == ["global_step100", "global_step200", "global_step300"]


def test_backup_to_the_filesystem_root_is_refused(run, monkeypatch):
    from opskit.fsutil import OutputRefusedError
    from opskit.targets.file import FileTarget

    def never(*_):  # the old code wrote /global_step100 here: fail the test instead
        raise AssertionError("wrote at the filesystem root")

    monkeypatch.setattr(FileTarget, "put", never)
    monkeypatch.setattr(FileTarget, "write_text", never)
    with pytest.raises(OutputRefusedError, match=r"^--to file:///: the filesystem root; back up to a folder outside"):
        backup(run, "file:///", steps=[100])
    assert not (run / ".opskit-backups.json").exists()


def test_backup_refuses_a_step_with_a_flipped_tensor_byte_and_prune_keeps_it(run, tmp_path):
    layer = run / "global_step100" / "layer_03-model_01-model_states.pt"
    flip_a_tensor_byte(layer)
    target = tmp_path / "backup"
    done = cli("backup", str(run), "--to", f"file://{target}", "--steps", "100,300", "--with-optim")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "global_step100: 0 copied, 0 already there, 0 B, FAILED verification\n" \
           f"  corrupt, not backed up: {layer}: record " in done.stdout
    assert "fails its CRC-32 check" in done.stdout and "global_step300: 8 copied" not in done.stdout
    assert not (target / "global_step100").exists() and not (target / "manifests" / "global_step100.json").exists()
    assert "global_step100" not in json.loads((run / ".opskit-backups.json").read_text())[f"file://{target}"]
    assert cli("verify", f"file://{target}").stdout == "global_step300: OK\n"
    assert prune(run, [parse_keep("steps:300")]).delete == []  # the corrupt step is the only copy: kept
    assert (run / "global_step100").is_dir()


def test_verify_reports_every_step_folder_without_a_manifest(run, tmp_path):
    import shutil

    target = tmp_path / "backup"
    backup(run, f"file://{target}", steps=[100, 200])
    (target / "manifests" / "global_step200.json").unlink()  # the step latest names
    (target / "global_step200" / "mp_rank_00_model_states.pt").write_bytes(b"0123456789")
    shutil.copytree(run / "global_step300", target / "global_step300")  # copied by hand, never backed up
    done = cli("verify", f"file://{target}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[:4] == [
        "global_step100: OK", "global_step200: FAILED",
        "  global_step200/: no manifests/global_step200.json, cannot be verified (an interrupted first backup, or not "
        "copied by opskit ckpt backup): back it up again", "global_step300: FAILED"]

    (target / "manifests").rename(tmp_path / "manifests")  # no manifest at all: still every folder reported
    report = verify(f"file://{target}")
    assert list(report.steps) == ["global_step100", "global_step200", "global_step300"] and not report.ok
    assert all(report.steps.values())

    (target / "latest").write_text("global_step400")
    assert verify(f"file://{target}").steps["latest"] == [
        "latest: names 'global_step400', which is no step of this backup"]


def test_prune_needs_a_backup_that_can_resume_the_step(run, tmp_path):
    weights = f"file://{tmp_path / 'weights'}"
    backup(run, weights, steps=[100])  # the default: no optimizer states
    kept = cli("prune", str(run), "--keep", "steps:300")
    assert kept.returncode == 0 and "deleted" not in kept.stdout, kept.stdout + kept.stderr
    assert f"keep    global_step100  (backup {weights}: weights only (no optimizer states): serves convert/inspect, " \
           "cannot resume the step; back it up with --with-optim (use --force to delete anyway))\n" in kept.stdout

    forced = cli("prune", str(run), "--keep", "steps:300", "--force", "--dry-run")
    assert forced.returncode == 0 and "would delete global_step100\n" in forced.stdout, forced.stderr
    assert forced.stderr == f"warning: global_step100 would be deleted with no backup that can resume it (backup " \
                            f"{weights}: weights only (no optimizer states): serves convert/inspect, cannot resume " \
                            "the step; back it up with --with-optim)\n"

    backup(run, f"file://{tmp_path / 'full'}", steps=[100], weights_only=False)
    done = cli("prune", str(run), "--keep", "steps:300")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "deleted global_step100\n" in done.stdout
    assert steps_in(run) == ["global_step200", "global_step300"]


def test_restore_round_trip_backup_prune_restore(run, tmp_path):
    from opskit.ckpt.format.info import describe_step

    original = {p.name: p.read_bytes() for p in (run / "global_step100").iterdir()}
    full, weights = f"file://{tmp_path / 'full'}", f"file://{tmp_path / 'weights'}"
    backup(run, full, steps=[100], weights_only=False)
    backup(run, weights, steps=[100])
    assert "deleted global_step100\n" in cli("prune", str(run), "--keep", "steps:300").stdout

    partial = cli("restore", weights, str(run), "--step", "100")  # no optimizer states: not a resumable step
    assert (partial.returncode, partial.stderr.count("\n")) == (1, 1), partial.stdout + partial.stderr
    assert partial.stderr == f"error: {weights}/manifests/global_step100.json: a weights-only backup (without " \
                             "zero_pp_rank_0_mp_rank_00_optim_states.pt, ...): it serves convert/inspect, not a " \
                             "resume; restore from a --with-optim backup; nothing restored\n"
    assert steps_in(run) == ["global_step200", "global_step300"] and not list(run.glob(".global_step*"))

    done = cli("restore", full, str(run), "--step", "100")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"restored {run / 'global_step100'}: 10 files, ")
    assert f"latest names global_step200: `opskit ckpt set-latest {run} 100` to resume from it" in done.stdout
    assert {p.name: p.read_bytes() for p in (run / "global_step100").iterdir()} == original
    assert describe_step(run / "global_step100").complete
    assert cli("check", str(run / "global_step100")).returncode == 0

    again = cli("restore", full, str(run), "--step", "100")
    assert (again.returncode, again.stderr) == (1, f"error: {run / 'global_step100'}: exists; restore never replaces "
                                                   "a step (move it away first)\n")


def test_backup_of_a_read_only_checkpoint_dir_copies_every_step_and_says_prune_will_not_count_it(run, tmp_path,
                                                                                                monkeypatch):
    import opskit.ckpt.backup as backup_module

    def read_only(path, text, mode=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(backup_module, "atomic_write_text", read_only)  # as root, a mode-555 folder is writable
    results = backup(run, f"file://{tmp_path / 'b'}")
    assert [(r.tag, r.verified) for r in results] == [(f"global_step{s}", True) for s in (100, 200, 300)]
    assert all(r.unrecorded == f"not recorded in {run / '.opskit-backups.json'} (Permission denied): prune will "
                               "not count this backup" for r in results)
    assert not (run / ".opskit-backups.json").exists() and verify(f"file://{tmp_path / 'b'}").steps == {
        "global_step100": [], "global_step200": [], "global_step300": []}
