"""The output rule of every command that writes: nothing opskit did not write itself is deleted, replaced or re-moded.

For each writer (ckpt convert, ckpt backup and sync to file://, data prepare, logs plot, specs new): a user's folder
or file at the target is refused in one line and left byte-identical with its mode (paths, bytes and modes compared
before and after), also with --force; --force replaces only opskit's own earlier output (its marker: ``.opskit`` in a
folder, a PNG text chunk / SVG or PDF creator / JPEG comment in a plot, the first YAML comment of a spec); an empty
existing folder is used and keeps its mode; ``--out .`` and ``--out FILE`` give one line. The real CLI runs as a
subprocess, on a real trainer checkpoint (conftest's ``bloom_run``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_spec

from opskit.fsutil import MARKER, OutputRefusedError, has_marker

OPSKIT = str(Path(sys.executable).with_name("opskit"))
FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def opskit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([OPSKIT, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """relative path -> (mode, bytes; None for a folder), the root itself included, symlinks not followed."""
    tree = {".": (root.lstat().st_mode, None if root.is_dir() else root.read_bytes())}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            tree[str(path.relative_to(root))] = (path.lstat().st_mode, None if path.is_dir() else path.read_bytes())
    return tree


def users_folder(path: Path) -> Path:
    """A folder of someone else's: files, a subfolder, a non-default mode."""
    (path / "notes").mkdir(parents=True)
    (path / "config.json").write_text('{"mine": true}\n')
    (path / "notes" / "todo.txt").write_text("do not delete\n")
    (path / "notes" / "todo.txt").chmod(0o640)
    path.chmod(0o750)
    return path


def refused_in_one_line(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


# --------------------------------------------------------------------------- ckpt convert


@pytest.fixture(scope="module")
def checkpoints(bloom_run) -> Path:
    return bloom_run / "checkpoints"


def convert(checkpoints: Path, out: Path | str, *flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return opskit("ckpt", "convert", checkpoints, "--step", "10", "--out", out, "--no-verify", *flags, cwd=cwd)


def test_convert_refuses_a_users_folder_even_with_force(checkpoints, tmp_path):
    out = users_folder(tmp_path / "mine")
    before = snapshot(tmp_path)
    refused_in_one_line(convert(checkpoints, out), f"{out}: exists and holds files opskit did not write")
    refused_in_one_line(convert(checkpoints, out, "--force"), f"{out}: exists and holds files opskit did not write")
    assert snapshot(tmp_path) == before  # nothing deleted, re-moded or left beside it


def test_convert_refuses_a_file_at_out(checkpoints, tmp_path):
    out = tmp_path / "model"
    out.write_text("a file of mine\n")
    out.chmod(0o600)
    before = snapshot(tmp_path)
    for flags in ((), ("--force",)):
        refused_in_one_line(convert(checkpoints, out, *flags), f"{out}: exists and is not a folder")
    assert snapshot(tmp_path) == before  # no hidden .model-old-PID beside it


def test_convert_out_dot_is_one_line(checkpoints, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused_in_one_line(convert(checkpoints, ".", cwd=empty), "--out .")
    assert list(empty.iterdir()) == [] and list(tmp_path.iterdir()) == [empty]
    users_folder(tmp_path / "work")
    before = snapshot(tmp_path)
    refused_in_one_line(convert(checkpoints, ".", "--force", cwd=tmp_path / "work"), "--out .")
    assert snapshot(tmp_path) == before


def test_convert_into_an_empty_folder_keeps_its_mode_and_force_replaces_only_its_own(checkpoints, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    out.chmod(0o750)
    done = convert(checkpoints, out)
    assert done.returncode == 0, done.stderr
    assert (out.stat().st_mode & 0o7777, has_marker(out)) == (0o750, True)
    assert json.loads((out / MARKER).read_text())["command"] == "ckpt convert"
    assert (out / "config.json").is_file()

    before = snapshot(tmp_path)
    refused_in_one_line(convert(checkpoints, out), f"{out}: exists (written by opskit earlier); --force replaces it")
    assert snapshot(tmp_path) == before

    (out / "config.json").write_text("{}")  # damaged: --force rewrites it
    done = convert(checkpoints, out, "--force")
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "bloom" and has_marker(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging or moved-aside folder left


def test_convert_all_refuses_a_users_step_folder_before_converting_anything(checkpoints, tmp_path):
    root = tmp_path / "hf"
    users_folder(root / "global_step20")
    before = snapshot(tmp_path)
    done = opskit("ckpt", "convert", checkpoints, "--all", "--out", root, "--no-verify")
    refused_in_one_line(done, f"{root / 'global_step20'}: exists and holds files opskit did not write")
    assert snapshot(tmp_path) == before  # global_step10 was not converted either


def marked_by(folder: Path, command: str) -> Path:
    """A folder another opskit command wrote (a run directory, a dataset): its marker and files of its own."""
    (folder / "checkpoints" / "global_step5").mkdir(parents=True)
    (folder / "checkpoints" / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (folder / "ledger.jsonl").write_text('{"task": "1_1"}\n')
    (folder / MARKER).write_text(json.dumps({"written_by": "opskit", "command": command}) + "\n")
    return folder


@pytest.mark.parametrize("command", ["submit", "data prepare"])
def test_convert_force_refuses_a_folder_another_command_wrote(checkpoints, tmp_path, command):
    out = marked_by(tmp_path / "run", command)
    before = snapshot(tmp_path)
    refused_in_one_line(convert(checkpoints, out, "--force"), f"{out}: written by `opskit {command}`, not `opskit "
                                                              "ckpt convert`")
    assert snapshot(tmp_path) == before


def test_convert_force_keeps_files_the_user_added_to_a_conversion(checkpoints, tmp_path):
    out = tmp_path / "o1"
    assert convert(checkpoints, out).returncode == 0
    (out / "mynotes.txt").write_text("mine\n")
    (out / "sub").mkdir()
    (out / "sub" / "y").write_text("mine too\n")
    before = snapshot(tmp_path)
    refused_in_one_line(convert(checkpoints, out, "--force"),
                        f"{out}: holds entries opskit did not write (mynotes.txt, sub); --force would delete them")
    assert snapshot(tmp_path) == before


def test_convert_all_skips_only_an_intact_conversion_of_the_same_save(small_checkpoints, tmp_path):
    root = tmp_path / "hf"
    step = root / "global_step10"
    convert_all = ("ckpt", "convert", small_checkpoints, "--all", "--out", root, "--no-verify")
    assert opskit(*convert_all).returncode == 0
    assert "already converted" in opskit(*convert_all).stdout  # intact: skipped
    [skipped] = json.loads(opskit(*convert_all, "--json").stdout)["converted"]
    assert (skipped["skipped"], skipped["out_dir"], skipped["iteration"]) == (True, str(step), 10)
    shard = next(step.glob("model*.safetensors"))
    shard.unlink()
    done = opskit(*convert_all)
    assert "already converted" not in done.stdout
    assert f"{step}: damaged conversion: {shard.name} (missing)" in done.stderr
    reported = json.loads(opskit(*convert_all, "--json").stdout)
    assert reported["converted"] == [] and [n["step_dir"] for n in reported["not_converted"]] == \
        [str(small_checkpoints / "global_step10")]
    assert not shard.exists()  # reported; only --force converts it again
    assert opskit(*convert_all, "--force").returncode == 0 and shard.is_file()

    states = small_checkpoints / "global_step10" / "mp_rank_00_model_states.pt"
    os.utime(states, ns=(states.stat().st_atime_ns, states.stat().st_mtime_ns + 10**9))  # saved again (rollback)
    done = opskit(*convert_all)
    assert "already converted" not in done.stdout and "(stale); --force converts it again" in done.stderr, done.stderr
    marker_before = (step / MARKER).read_text()
    assert opskit(*convert_all, "--force").returncode == 0
    assert "already converted" in opskit(*convert_all).stdout and (step / MARKER).read_text() != marker_before


# --------------------------------------------------------------------------- ckpt backup to file://


@pytest.fixture
def small_checkpoints(tmp_path, checkpoints) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoints / "global_step10", root / "global_step10")
    (root / "latest").write_text("global_step10")
    return root


def test_backup_into_a_shared_folder_leaves_other_files_alone(small_checkpoints, tmp_path):
    share = users_folder(tmp_path / "share")
    before = snapshot(share)
    done = opskit("ckpt", "backup", small_checkpoints, "--to", f"file://{share}")
    assert done.returncode == 0, done.stderr
    after = snapshot(share)
    assert {k: v for k, v in after.items() if k in before} == before
    assert (share / "latest").read_text() == "global_step10"
    again = opskit("ckpt", "backup", small_checkpoints, "--to", f"file://{share}")  # its own objects: all there
    assert again.returncode == 0 and again.stdout.startswith("global_step10: 0 copied, 5 already there, ")


@pytest.mark.parametrize("foreign", ["global_step10/mp_rank_00_model_states.pt", "latest",
                                     "manifests/global_step10.json"])
def test_backup_refuses_to_replace_an_object_it_did_not_write(small_checkpoints, tmp_path, foreign):
    share = users_folder(tmp_path / "share")
    (share / foreign).parent.mkdir(parents=True, exist_ok=True)
    (share / foreign).write_text("someone else's\n")
    before = snapshot(share)
    done = opskit("ckpt", "backup", small_checkpoints, "--to", f"file://{share}")
    refused_in_one_line(done, f"{foreign}: exists and was not written by opskit ckpt backup")
    assert snapshot(share) == before  # refused before anything was copied


# --------------------------------------------------------------------------- sync to file://


@pytest.fixture
def run_paths(tmp_path):
    from opskit.run.paths import RunPaths

    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text(" iteration        1/      10 | lm loss: 9.000000E+00 |\n")
    return run


def test_sync_refuses_to_replace_a_file_it_did_not_upload(run_paths, tmp_path):
    from opskit.upkeep.sync import sync

    share = users_folder(tmp_path / "share")
    (share / "logs").mkdir()
    (share / "logs" / "main_log.txt").write_text("another run's log\n")
    before = snapshot(share)
    with pytest.raises(OutputRefusedError, match=r"logs/main_log.txt: exists and was not written by this run's "
                                                 r"opskit sync"):
        sync(run_paths, ["logs"], f"file://{share}")
    assert snapshot(share) == before


def test_sync_delete_removes_only_what_it_uploaded(run_paths, tmp_path):
    from opskit.upkeep.sync import sync

    url, share = f"file://{tmp_path / 'share'}", users_folder(tmp_path / "share")
    old = run_paths.logs / "old_log.txt"
    old.write_text("an old log\n")
    assert sorted(sync(run_paths, ["logs"], url).copied) == ["logs/main_log.txt", "logs/old_log.txt"]
    old.unlink()
    (share / "logs" / "theirs.txt").write_text("someone else's log\n")  # not uploaded by this run
    (share / "logs" / "theirs.txt").chmod(0o600)
    theirs = snapshot(share / "logs" / "theirs.txt")
    users = {k: v for k, v in snapshot(share).items() if not k.startswith("logs")}
    assert sync(run_paths, ["logs"], url, delete=True, dry_run=True).deleted == ["logs/old_log.txt"]
    assert sync(run_paths, ["logs"], url, delete=True).deleted == ["logs/old_log.txt"]
    assert not (share / "logs" / "old_log.txt").exists()
    assert snapshot(share / "logs" / "theirs.txt") == theirs
    assert {k: v for k, v in snapshot(share).items() if not k.startswith("logs")} == users
    assert sync(run_paths, ["logs"], url, delete=True, dry_run=True).deleted == []  # forgotten once deleted


# --------------------------------------------------------------------------- data prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("corpus")
    texts = ["In the beginning God created the heaven and the earth. " * 20,
             "And the earth was without form, and void; and darkness was upon the face of the deep. " * 20]
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [folder / "c.jsonl"]


def test_data_prepare_refuses_a_users_folder_even_with_force(corpus, tmp_path):
    from opskit.data.corpus import prepare_data

    out = users_folder(tmp_path / "data")
    (tmp_path / "file").write_text("a file of mine\n")
    before = snapshot(tmp_path)
    for force in (False, True):
        with pytest.raises(OutputRefusedError, match=f"^{out}: exists and holds files opskit did not write"):
            prepare_data(corpus, out, 300, name="c", force=force)
        with pytest.raises(OutputRefusedError, match=f"^{tmp_path / 'file'}: exists and is not a folder"):
            prepare_data(corpus, tmp_path / "file", 300, name="c", force=force)
    assert snapshot(tmp_path) == before


def test_data_prepare_reuses_and_repairs_its_output_and_needs_force_for_other_settings(corpus, tmp_path):
    from opskit.data.corpus import prepare_data

    out = tmp_path / "data"
    out.mkdir()
    out.chmod(0o750)
    first = prepare_data(corpus, out, 300, name="c")
    assert has_marker(out) and has_marker(first.tokenizer_dir) and out.stat().st_mode & 0o7777 == 0o750
    assert prepare_data(corpus, out, 300, name="c").reused  # idempotent, no --force needed
    bin_path = Path(f"{first.data_prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    assert not prepare_data(corpus, out, 300, name="c").reused  # the same request, repaired without --force

    before = snapshot(tmp_path)
    with pytest.raises(OutputRefusedError, match=f"^{out}: holds a dataset opskit prepared with other inputs or "
                                                 "settings; --force rebuilds it"):
        prepare_data(corpus, out, 320, name="c")
    assert snapshot(tmp_path) == before
    assert prepare_data(corpus, out, 320, name="c", force=True).vocab_size == 320


def test_data_prepare_keeps_a_users_file_in_its_tokenizer_folder(corpus, tmp_path):
    from opskit.data.corpus import prepare_data

    out = tmp_path / "data"
    first = prepare_data(corpus, out, 300, name="c")
    (first.tokenizer_dir / "my-vocab-notes.txt").write_text("mine\n")
    bin_path = Path(f"{first.data_prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])  # a repair (no --force) rewrites the tokenizer folder
    for size, force in ((300, False), (320, True)):
        with pytest.raises(OutputRefusedError, match=f"^{first.tokenizer_dir}: holds entries opskit did not write "
                                                     r"\(my-vocab-notes.txt\)"):
            prepare_data(corpus, out, size, name="c", force=force)
        assert (first.tokenizer_dir / "my-vocab-notes.txt").read_text() == "mine\n"


def test_data_prepare_cli_refuses_in_one_line(corpus, kjv_data, tmp_path):
    out = users_folder(tmp_path / "data")
    before = snapshot(tmp_path / "data")
    spec = write_spec(tmp_path / "trainings" / "d.yaml", kjv_data, tmp_path / "run",
                      data={"corpus": [str(p) for p in corpus], "dir": str(out), "name": "c", "vocab_size": 300})
    for flags in ((), ("--force",)):
        refused_in_one_line(opskit("data", "prepare", spec, *flags),
                            f"{out}: exists and holds files opskit did not write")
    assert snapshot(tmp_path / "data") == before


def test_data_prepare_json_names_what_it_wrote_with_nothing_else_on_stdout(corpus, tmp_path):
    fake_data = type("Prepared", (), {"data_prefix": tmp_path / "d" / "c_text_document"})
    spec = write_spec(tmp_path / "trainings" / "d.yaml", fake_data, tmp_path / "run",
                      data={"corpus": [str(p) for p in corpus], "dir": str(tmp_path / "data"), "name": "c",
                            "vocab_size": 300})
    done = opskit("data", "prepare", spec, "--json")
    assert done.returncode == 0, done.stderr
    prepared = json.loads(done.stdout)  # the progress bar is not on stdout
    assert (prepared["data_prefix"], prepared["reused"]) == (str(tmp_path / "data" / "c_text_document"), False)
    assert Path(prepared["data_prefix"] + ".bin").is_file() and prepared["num_documents"] == 2
    assert json.loads(opskit("data", "prepare", spec, "--json").stdout)["reused"] is True


# --------------------------------------------------------------------------- logs plot


def plot(out: Path | str, *flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return opskit("logs", "plot", FIXTURES / "restart.txt", "--out", out, *flags, cwd=cwd)


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".jpg", b"\xff\xd8\xff"),
                                               (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_plot_writes_the_format_its_suffix_names_and_force_replaces_only_its_own(tmp_path, suffix, magic):
    from opskit.logs.plot import written_by_opskit

    out = tmp_path / f"loss{suffix}"
    done = plot(out)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(magic) and written_by_opskit(out)
    before = snapshot(tmp_path)
    refused_in_one_line(plot(out), f"{out}: exists (written by opskit earlier); --force replaces it")
    assert snapshot(tmp_path) == before
    assert plot(out, "--force").returncode == 0 and written_by_opskit(out)


def test_plot_refuses_a_users_image_an_unknown_suffix_a_folder_and_dot(tmp_path):
    from PIL import Image

    users = tmp_path / "mine.png"
    Image.new("RGB", (4, 4)).save(users, pnginfo=None)
    users.chmod(0o600)
    (tmp_path / "folder.png").mkdir()
    before = snapshot(tmp_path)
    for flags in ((), ("--force",)):
        refused_in_one_line(plot(users, *flags), f"{users}: exists and was not written by opskit")
    refused_in_one_line(plot(tmp_path / "folder.png"), "exists and is not a regular file")
    refused_in_one_line(plot(tmp_path / "loss.gif"), "--out", ".gif", ".png, .jpg, .svg or .pdf")
    refused_in_one_line(plot(".", cwd=tmp_path), "--out .")
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- specs new


def test_specs_new_refuses_a_long_name_and_does_not_warn_about_a_renamed_field(tmp_path):
    refused_in_one_line(opskit("specs", "new", "n" * 300, "--from", "tiny", cwd=tmp_path), "use at most 200")
    done = opskit("specs", "new", "mytiny", "--from", "tiny", cwd=tmp_path)
    assert done.returncode == 0 and "still mentions" not in done.stdout + done.stderr, done.stdout + done.stderr
    created = json.loads(opskit("specs", "new", "json", "--from", "tiny", "--json", cwd=tmp_path).stdout)
    assert (created["path"], Path(created["source"]).name) == ("trainings/json.yaml", "tiny.yaml")
    assert "paths.output" in created["renamed"] and (tmp_path / created["path"]).is_file()


def test_set_latest_keeps_the_mode_of_latest(small_checkpoints):
    latest = small_checkpoints / "latest"
    latest.chmod(0o600)
    done = opskit("ckpt", "set-latest", small_checkpoints, "10", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"latest": str(latest), "previous": "global_step10", "now": "global_step10"}
    assert latest.stat().st_mode & 0o7777 == 0o600 and latest.read_text().strip() == "global_step10"


def test_specs_new_force_replaces_only_a_spec_it_created(tmp_path):
    (tmp_path / "trainings").mkdir()
    users = tmp_path / "trainings" / "mine.yaml"
    users.write_text("# my own spec\nmodel: {}\n")
    users.chmod(0o600)
    before = snapshot(tmp_path)
    for flags in ((), ("--force",)):
        refused_in_one_line(opskit("specs", "new", "mine", "--from", "tiny", *flags, cwd=tmp_path), "mine.yaml")
    assert snapshot(tmp_path) == before

    assert opskit("specs", "new", "ours", "--from", "tiny", cwd=tmp_path).returncode == 0
    refused_in_one_line(opskit("specs", "new", "ours", "--from", "tr1-13B", cwd=tmp_path), "--force replaces it")
    done = opskit("specs", "new", "ours", "--from", "tr1-13B", "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--from tr1-13B" in (tmp_path / "trainings" / "ours.yaml").read_text().splitlines()[0]
