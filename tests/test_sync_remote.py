"""opskit sync, ckpt backup/verify and logs tail --remote against real local servers: the GCS emulator (behind a
fault-injecting proxy), olah serving a local Hub repo (reads), and tests/hub_standin.py (Hub uploads; a stand-in,
pinned by a contract test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hub_standin import HubStandIn, serve
from remote_services import FaultProxy, olah_cli, start_gcs_emulator, start_olah

from opskit.logs.follow import follow_published
from opskit.run.paths import RunPaths
from opskit.targets import open_target
from opskit.targets.base import TargetError, TargetOptions, scrub
from opskit.upkeep.sync import sync

TOKEN = "hf_opskitTestToken0123456789abcdef"
FAST = TargetOptions(workers=4, create_repo=True, retries=2, backoff_s=0.01)
KINDS = ["logs", "tensorboard", "codecarbon"]


@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory):
    proc, endpoint = start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
    yield endpoint
    proc.kill()
    proc.wait()


@pytest.fixture
def gcs(gcs_emulator, monkeypatch, request):
    """A fresh bucket behind a fault proxy; STORAGE_EMULATOR_HOST points at the proxy."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    proxy = FaultProxy(gcs_emulator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
    bucket = f"b{abs(hash(request.node.name)) % 10**8}"
    storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(bucket)
    yield proxy, bucket
    proxy.close()


@pytest.fixture
def hub(monkeypatch):
    standin = HubStandIn()
    server = serve(standin)
    monkeypatch.setenv("HF_ENDPOINT", standin.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield standin
    server.shutdown()


@pytest.fixture
def run(tmp_path):
    run = RunPaths(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text("".join(f" iteration {i:8d}/ 100 | lm loss: {9 - i / 10:.6E} |\n" for i in range(1, 4)))
    (run.tensorboard).mkdir()
    for i in range(3):
        (run.tensorboard / f"events.out.tfevents.{i}.node").write_bytes(os.urandom(3000 + i))
    run.codecarbon.mkdir()
    (run.codecarbon / "emissions-0.csv").write_text("timestamp,emissions\n2026-11-21T09:00:00,0.01\n")
    return run


def _append(run: RunPaths, line: str) -> None:
    with open(run.main_log, "a") as f:
        f.write(line)


# --- GCS ---------------------------------------------------------------------------------------------------------

def test_gcs_sync_is_incremental_checksummed_and_silent_when_nothing_changed(run, gcs):
    proxy, bucket = gcs
    url = f"gs://{bucket}/runs/tr1"
    first = sync(run, KINDS, url, options=FAST)
    assert len(first.copied) == 5 and not first.failed
    target = open_target(url, options=FAST)
    from opskit.targets.base import crc32c_of_file

    for key in first.copied:
        assert target.crc32c(key) == crc32c_of_file(run.root / key)
    seen = proxy.seen
    again = sync(run, KINDS, url, options=FAST)
    assert (again.copied, again.unchanged, proxy.seen) == ([], 5, seen)  # no request at all
    _append(run, " iteration        4/ 100 | lm loss: 8.6 |\n")
    grown = sync(run, KINDS, url, options=FAST)
    assert grown.copied == ["logs/main_log.txt"]
    assert target.read_text("logs/main_log.txt") == run.main_log.read_text()


def test_gcs_upload_that_fails_on_the_second_file_resumes_next_run(run, gcs):
    proxy, bucket = gcs
    url = f"gs://{bucket}/r"
    one_worker = TargetOptions(workers=1, retries=2, backoff_s=0.01)
    proxy.fail("/upload/", 503, times=3, skip=1)  # the 1st upload passes, the 2nd fails through all its retries
    first = sync(run, KINDS, url, options=one_worker)
    assert len(first.copied) == 4 and len(first.failed) == 1
    [(failed_key, reason)] = first.failed.items()
    assert "503" in reason and "after 3 attempts" in reason
    second = sync(run, KINDS, url, options=one_worker)
    assert second.copied == [failed_key] and not second.failed
    target = open_target(url, options=one_worker)
    assert sorted(target.keys()) == sorted(first.copied + [failed_key])
    assert (run.root / failed_key).read_bytes() == target.read_from(failed_key, 0)


def test_gcs_rate_limit_and_server_errors_are_retried_with_back_off(run, gcs):
    proxy, bucket = gcs
    sleeps = []
    from opskit.targets.base import with_retries

    target = open_target(f"gs://{bucket}/x", options=FAST)
    proxy.fail("/upload/", 429, times=1)
    proxy.fail("/upload/", 500, times=1)
    with_retries(lambda: target._bucket().blob("x/probe").upload_from_string(b"1", retry=None), "probe",
                 TargetOptions(retries=3, backoff_s=0.5), sleep=sleeps.append)
    assert sleeps == [0.5, 1.0]  # two failures, doubled back-off, then success
    assert target.read_text("probe") == "1"


def _checkpoint_step(root) -> list[str]:
    """``root/checkpoints/global_step10`` (+ ``latest``): a complete tiny GPT-2 checkpoint, TP=1 (four weight files and
    a ZeRO optimizer shard); returns the weight files' names."""
    import torch
    from megatron_ckpt import build_checkpoint

    step = build_checkpoint(root / "checkpoints", arch="gpt2", tp=1, layers=1, hidden=32, iteration=10,
                            dtype=torch.float16)
    return sorted(p.name for p in step.iterdir() if not p.name.endswith("_optim_states.pt"))


def test_ckpt_backup_and_verify_through_gs(gcs, tmp_path):
    from opskit.ckpt.backup import backup, verify

    proxy, bucket = gcs
    weights = _checkpoint_step(tmp_path)
    step = tmp_path / "checkpoints" / "global_step10"
    url = f"gs://{bucket}/backups/tr1"
    [result] = backup(tmp_path / "checkpoints", url)
    assert result.verified and sorted(k.split("/")[-1] for k in result.copied) == weights  # optimizer states stay
    assert verify(url).steps == {"global_step10": []}
    tampered = tmp_path / "tampered.pt"
    data = bytearray((step / "layer_01-model_00-model_states.pt").read_bytes())
    data[-100] ^= 0xFF  # same size, one byte changed
    tampered.write_bytes(data)
    open_target(url).put(tampered, "global_step10/layer_01-model_00-model_states.pt")
    assert "CRC32C" in verify(url).steps["global_step10"][0]


def test_interrupted_gs_backup_resumes_without_copying_again(gcs, tmp_path):
    from opskit.ckpt.backup import backup, verify

    proxy, bucket = gcs
    weights = _checkpoint_step(tmp_path)
    url = f"gs://{bucket}/backups/tr1"
    proxy.fail("/upload/", 403, times=1, skip=1)  # the 2nd object is refused (not retried: 403)
    with pytest.raises(TargetError, match="run the backup again to resume"):
        backup(tmp_path / "checkpoints", url, workers=1)
    assert not any(key.startswith("manifests/") for key in open_target(url).keys())  # no backup claimed yet

    [result] = backup(tmp_path / "checkpoints", url, workers=1)
    assert result.verified and sorted(result.copied + result.skipped) == [f"global_step10/{w}" for w in weights]
    assert f"global_step10/{weights[0]}" in result.skipped  # the 1st object reached the bucket: not sent again
    assert verify(url).steps == {"global_step10": []}


# --- Hub uploads (stand-in) --------------------------------------------------------------------------------------

def test_hub_sync_is_one_commit_of_new_files_and_none_when_nothing_changed(run, hub):
    url = "hf://datasets/bigscience/tr1-logs/run1"
    first = sync(run, KINDS, url, options=FAST)
    assert len(first.copied) == 5
    [commit] = hub.commits
    assert commit["files"] == sorted(f"run1/{k}" for k in first.copied)
    assert commit["summary"].startswith("opskit sync logs+tensorboard+codecarbon: 5 file(s) at 20")
    assert hub.repos["dataset:bigscience/tr1-logs"]["run1/logs/main_log.txt"] == run.main_log.read_bytes()
    requests = len(hub.requests)
    assert sync(run, KINDS, url, options=FAST).copied == [] and len(hub.requests) == requests
    _append(run, " iteration        4/ 100 | lm loss: 8.6 |\n")
    assert sync(run, KINDS, url, options=FAST).copied == ["logs/main_log.txt"]
    assert hub.commits[-1]["files"] == ["run1/logs/main_log.txt"] and len(hub.commits) == 2


def test_hub_client_requests_are_the_ones_the_stand_in_implements(run, hub):
    """The contract: if a huggingface_hub upgrade changes these requests, this fails and the stand-in needs a look."""
    run.main_log.write_text("one line\n")
    sync(run, ["logs"], "hf://datasets/org/repo", options=FAST)
    calls = [(r.method, r.path, r.content_type, r.authorized) for r in hub.requests if r.method == "POST"]
    assert calls == [("POST", "/api/repos/create", "application/json", True),
                     ("POST", "/api/datasets/org/repo/preupload/main", "application/json", True),
                     ("POST", "/api/datasets/org/repo/commit/main", "application/x-ndjson", True)]
    create, preupload, commit = [r.body for r in hub.requests if r.method == "POST"]
    assert create == {"name": "repo", "organization": "org", "visibility": "private", "type": "dataset"}
    assert preupload == {"files": [{"path": "logs/main_log.txt", "sample": "b25lIGxpbmUK", "size": 9}]}
    assert [line["key"] for line in commit] == ["header", "file"]
    assert commit[1]["value"] == {"content": "b25lIGxpbmUK", "path": "logs/main_log.txt", "encoding": "base64"}
    assert set(commit[0]["value"]) == {"summary", "description"}
    assert all(r.path.startswith("/api/") for r in hub.requests)


def test_hub_failure_keeps_everything_for_the_next_run_and_never_shows_the_token(run, hub):
    url = "hf://datasets/org/logs"
    hub.fail("/commit/", 500, times=3)  # the first commit and its two retries
    first = sync(run, KINDS, url, options=FAST)
    assert first.copied == [] and len(first.failed) == 5 and not hub.commits
    reason = next(iter(first.failed.values()))
    assert "500" in reason and "after 3 attempts" in reason and TOKEN not in reason and "***" in reason
    second = sync(run, KINDS, url, options=FAST)
    assert len(second.copied) == 5 and len(hub.commits) == 1


def test_hub_429_is_retried_and_cli_errors_are_scrubbed(run, hub, tmp_path, kjv_data):
    hub.fail("/commit/", 429, times=1)
    assert len(sync(run, KINDS, "hf://datasets/org/logs", options=FAST).copied) == 5

    from conftest import write_spec

    spec = write_spec(tmp_path / "trainings" / "t.yaml", kjv_data, run.root,
                      sync={"targets": ["hf://datasets/org/other"]})  # create_repo off: the repo does not exist
    done = subprocess.run([sys.executable, "-m", "opskit.cli.app", "sync", "all", str(spec)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 1
    assert "repository org/other not found or not writable with this token" in done.stderr
    assert TOKEN not in done.stdout + done.stderr


def test_scrub_removes_the_token_from_a_real_client_error(hub):
    from huggingface_hub import HfApi

    hub.fail("/repos/create", 401, times=1)
    with pytest.raises(Exception) as raw:
        HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo("org/x")
    assert TOKEN in str(raw.value)  # the server quoted the header back: exactly what must never be shown
    assert TOKEN not in scrub(str(raw.value)) and "***" in scrub(str(raw.value))
    hub.fail("/repos/create", 401, times=1)
    with pytest.raises(TargetError, match="create repo: Client error '401 Unauthorized'") as ours:
        open_target("hf://org/y", options=TargetOptions(create_repo=True, retries=0))._ensure_repo()
    assert TOKEN not in str(ours.value)


# --- remote tail -------------------------------------------------------------------------------------------------

def test_tail_remote_on_gcs_prints_only_new_bytes(run, gcs):
    _, bucket = gcs
    url = f"gs://{bucket}/tail"
    sync(run, ["logs"], url, options=FAST)
    target = open_target(url, options=FAST)
    reads = []
    real_read = target.read_from
    target.read_from = lambda key, offset: reads.append(offset) or real_read(key, offset)

    def sleep(_):
        _append(run, " iteration        4/ 100 | lm loss: 8.6 |\n")
        sync(run, ["logs"], url, options=FAST)

    lines = list(follow_published(target, "logs/main_log.txt", 2, 0, sleep, polls=1))
    assert [line.split("|")[0].split()[1] for line in lines] == ["2/", "3/", "4/"]
    size_before = len(run.main_log.read_bytes()) - len(" iteration        4/ 100 | lm loss: 8.6 |\n")
    assert reads == [0, size_before]  # the poll asked only for bytes after what was printed


@pytest.mark.skipif(olah_cli() is None, reason="olah not installed (make install puts it in .venv-olah)")
def test_tail_remote_on_the_hub_through_olah(run, tmp_path, monkeypatch):
    repo = tmp_path / "mirror" / "datasets" / "org" / "tr1-logs"
    (repo / "logs").mkdir(parents=True)
    published = run.main_log.read_bytes()
    (repo / "logs" / "main_log.txt").write_bytes(published)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "logs"], check=True)
    proc, endpoint = start_olah(tmp_path / "mirror", tmp_path / "olah")
    try:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        target = open_target("hf://datasets/org/tr1-logs", options=FAST)
        assert target.keys("logs/") == ["logs/main_log.txt"]
        lines = list(follow_published(target, "logs/main_log.txt", 1, 0, lambda _: None, polls=1))
        assert lines == [run.main_log.read_text().splitlines()[-1]]
        assert target.read_from("logs/main_log.txt", len(published) - 10) == published[-10:]
    finally:
        proc.kill()
        proc.wait()


def test_cli_tail_remote_follows_gcs(run, gcs, tmp_path):
    _, bucket = gcs
    url = f"gs://{bucket}/cli"
    sync(run, ["logs"], url, options=FAST)
    proc = subprocess.Popen([sys.executable, "-m", "opskit.cli.app", "logs", "tail", str(run.root), "--remote", url,
                             "-n", "1", "--interval", "0.1"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().startswith(" iteration        3/")
        _append(run, " iteration        4/ 100 | lm loss: 8.6 |\n")
        sync(run, ["logs"], url, options=FAST)
        assert proc.stdout.readline() == " iteration        4/ 100 | lm loss: 8.6 |\n"
    finally:
        proc.kill()
        proc.wait()


# --- ckpt publish (stand-in) -------------------------------------------------------------------------------------

def test_ckpt_publish_tags_one_commit_per_step_and_skips_published_ones(hub, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from opskit.train.log import validation_lines

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "logs" / "main_log.txt").write_text("\n".join(validation_lines("iteration 100", 5.25)
                                                         + validation_lines("iteration 200", 4.5)) + "\n")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    for step in (100, 200):  # real converted folders (config.json + safetensors), as `ckpt convert` leaves them
        model.save_pretrained(run / "hf" / f"global_step{step}")
    cli = [sys.executable, "-m", "opskit.cli.app", "ckpt", "publish", str(run / "checkpoints"), "--to",
           "hf://bigscience/tiny-intermediate"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    from opskit.ckpt.publish import publish

    hub.fail("/tag/", 503, times=3)  # the first step's tag fails through its retries: interrupted after the commit
    with pytest.raises(TargetError, match="tag global_step100: .*503.* after 3 attempts") as e:
        publish(run / "hf", "hf://bigscience/tiny-intermediate", [100], lambda s: {}, FAST)
    assert TOKEN not in str(e.value) and len(hub.commits) == 1
    done = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "global_step100: 3 file(s), commit " in done.stdout and "global_step200: 3 file(s)" in done.stdout
    tags = hub.tags["model:bigscience/tiny-intermediate"]
    assert sorted(tags) == ["global_step100", "global_step200"]
    for step, commit in ((100, tags["global_step100"]), (200, tags["global_step200"])):
        files = hub.snapshots[commit]
        folder = run / "hf" / f"global_step{step}"
        assert files["config.json"] == (folder / "config.json").read_bytes()
        assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    card = hub.snapshots[tags["global_step200"]]["README.md"].decode()
    assert "| `global_step100` | 100 | — | 5.2500 |" in card and "| `global_step200` | 200 | — | 4.5000 |" in card
    assert 'revision="global_step200"' in card
    commits = len(hub.commits)
    again = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert again.stdout == "global_step100: already published, skipped\nglobal_step200: already published, skipped\n"
    as_json = subprocess.run([*cli, "--json"], capture_output=True, text=True, env=env)
    assert [(p["tag"], p["commit"]) for p in json.loads(as_json.stdout)] == [("global_step100", None),
                                                                            ("global_step200", None)]
    assert len(hub.commits) == commits


def test_an_unreachable_server_fails_after_retries_with_the_reason_and_loses_nothing(run, monkeypatch):
    from remote_services import free_port

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    url = "gs://bucket/run"
    # A new key is first looked for at the target (never replace someone else's object): that listing fails.
    with pytest.raises(TargetError) as failed:
        sync(run, ["logs"], url, options=TargetOptions(retries=2, backoff_s=0.01))
    reason = str(failed.value)
    assert reason.startswith("gs://bucket/run: list logs/: ") and "Connection refused" in reason
    assert reason.endswith("after 3 attempts") and "\n" not in reason
    assert run.main_log.is_file() and not run.sync_manifest(url).exists()
