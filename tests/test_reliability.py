"""The trainer's checkpoints under failure, for real: SIGKILL at random moments of saves (the chain's next task resumes
from a complete step and prints the uninterrupted run's losses), and a file system that fills up during a save (one
error line, ``latest`` and the earlier steps untouched, the watchdog alerts)."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from argparse import Namespace
from datetime import datetime
from pathlib import Path

import pytest
from conftest import REPO, SOAK, run_trainer, tiny_trainer_args

from opskit.ckpt.format.info import describe_step, list_steps
from opskit.ckpt.format.layout import read_latest, write_latest
from opskit.logs.grammar import parse_iteration_line
from opskit.monitor.checks import log_findings
from opskit.monitor.snapshot import read_log
from opskit.monitor.watch_state import WatchdogState
from opskit.run.paths import RunPaths
from opskit.spec.schema import WatchdogSpec

GBS = 8
# Kills that land inside a save: the soak's full series (`make soak`), or CI's random sample of it. Four, one in each
# quarter of the save's bytes: one in the model files (the first 1/4), three in the optimizer shard, and with
# --async-save two or more after training went on (19 and 24 of 30 in two soaks, none below 0.2 of the bytes).
KILLS = 30 if SOAK else 4
MAX_KILL_RUNS = KILLS + max(6, KILLS // 3)  # runs in all: kills that missed their save, or topped up (series_done)
ITERATIONS = 2 * MAX_KILL_RUNS + 4  # each killed run moves `latest` on by one or two steps
SAVE_TIME = re.compile(r"^time \(ms\) \| save-checkpoint: ([\d.]+)$", re.M)
SEED_VARIABLE = "OPSKIT_SIGKILL_SEED"  # set it to a failed run's printed seed to replay its kill moments


def chain_args(data, out: Path, async_save: bool = False, **overrides) -> list[str]:
    """The flags of every run of the crash test (reference, killed and resumed): dropout on (a resume is exact with
    it), a save after every iteration, in the background with ``async_save``; ``overrides`` as
    ``tiny_trainer_args``'s."""
    return tiny_trainer_args(data, out, **{"train_samples": ITERATIONS * GBS, "save_interval": 1,
                                           "tensorboard_dir": None, "hidden_dropout": 0.1, "attention_dropout": 0.1,
                                           "async_save": async_save, **overrides})


def losses(stdout: str) -> dict[int, float]:
    """Iteration -> lm loss of every iteration line (as printed: equal strings give equal floats)."""
    parsed = [r for line in stdout.splitlines() if (r := parse_iteration_line(line))]
    return {r["iteration"]: r["lm_loss"] for r in parsed}


@pytest.fixture(scope="module")
def reference(kjv_data, tmp_path_factory):
    """The uninterrupted run: its checkpoints, losses and save durations (ms)."""
    out = tmp_path_factory.mktemp("reference")
    done = run_trainer(chain_args(kjv_data, out))
    assert done.returncode == 0, done.stderr[-3000:]
    saves_ms = [float(ms) for ms in SAVE_TIME.findall(done.stdout)]
    assert len(saves_ms) == ITERATIONS
    return Namespace(save=out / "checkpoints", losses=losses(done.stdout), saves_ms=saves_ms)


# --------------------------------------------------------------------------- SIGKILL during saves


def folder_bytes(folder: Path) -> int:
    try:
        return sum(entry.stat().st_size for entry in os.scandir(folder))
    except FileNotFoundError:  # not created yet, or a file renamed while we looked
        return 0


def kill_seed() -> int:
    """The seed of a test's kill moments: ``$OPSKIT_SIGKILL_SEED`` (a failure replayed), else a new one each run."""
    return int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2**32))


def kill_fractions(kills: int, seed: int) -> list[float]:
    """Where in the save's bytes each kill lands, spread evenly over the save: the k-th at a random point of the k-th
    of ``kills`` slices, in a random order."""
    rng = random.Random(seed)
    fractions = [(k + rng.random()) / kills for k in range(kills)]
    rng.shuffle(fractions)
    return fractions


def series_done(kills: list[dict], async_save: bool) -> bool:
    """Whether the series has its :data:`KILLS` kills inside a save and, saved in the background, at least half that
    many while training went on. Which of the training thread (handing the save off) and the writer thread (reaching
    the kill's byte count) comes first is a race the machine's load decides: on a busy machine (19 of a soak's 30
    went on) a sample of four falls short about one time in seven, and is then topped up with more kills at the same
    moments."""
    went_on = sum(k["training_went_on"] for k in kills)
    return len(kills) >= KILLS and (not async_save or went_on >= KILLS // 2)


def run_and_kill_in_a_save(args: list[str], save: Path, kill_at_bytes: int, stderr_path: Path) -> str:
    """Start the trainer in its own process group; its first save runs whole (and rewrites whatever an earlier kill
    left of that step); in the second one, SIGKILL the whole group as soon as the step's folder holds
    ``kill_at_bytes``: moments spread by bytes written, whatever the machine's load does to the timing. That folder
    is new: the chain never got that far before. Returns all it printed to stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "opskit.train", *args], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env=env, cwd=REPO, start_new_session=True)
    kill = lambda: os.killpg(proc.pid, signal.SIGKILL)  # noqa: E731
    guard = threading.Timer(300, kill)  # a trainer that never gets there fails the test instead of hanging it
    guard.start()
    printed, saves = [], 0
    try:
        for line in proc.stdout:
            printed.append(line)
            if line.startswith("saving checkpoint at iteration"):
                saves += 1
                if saves == 2:
                    step = save / f"global_step{int(line.split()[4])}"
                    while proc.poll() is None and folder_bytes(step) < kill_at_bytes:
                        time.sleep(0.0002)
                    kill()
                    break
        printed.append(proc.stdout.read())
        proc.wait()
    finally:
        guard.cancel()
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}:\n{''.join(printed)[-3000:]}\n" \
                                               f"{stderr_path.read_text()[-3000:]}"
    return "".join(printed)


def assert_resumed_exactly(stdout: str, save: Path, tag: str, reference) -> list[int]:
    """The run loaded ``tag`` and printed the reference's losses from the next iteration on; its iterations."""
    assert f"loading checkpoint from {save} at {tag}" in stdout, stdout[-3000:]
    got = losses(stdout)
    start = int(tag.removeprefix("global_step")) + 1
    assert got and sorted(got) == list(range(start, start + len(got))), (tag, sorted(got))
    for iteration, loss in got.items():
        assert loss == reference.losses[iteration], (iteration, loss, reference.losses[iteration])
    return sorted(got)


def assert_latest_is_complete(save: Path) -> str:
    tag = read_latest(save)
    assert tag is not None and (save / tag).is_dir(), f"latest names {tag}, which does not exist"
    step = describe_step(save / tag, latest=True)
    assert step.complete, step.problems
    return tag


def interrupted_save(stdout: str) -> int | None:
    """The iteration whose save was under way when the run died, or None when every save it began had finished."""
    begun = re.findall(r"^saving checkpoint at iteration +(\d+)", stdout, re.M)
    finished = set(re.findall(r"^  successfully saved checkpoint at iteration +(\d+)", stdout, re.M))
    return int(begun[-1]) if begun and begun[-1] not in finished else None


def handed_off(stdout: str, iteration: int) -> bool:
    """Whether the save at ``iteration`` had returned to training while its files were still being written (a
    background save: its ``save-checkpoint`` time printed, its ``successfully saved`` line not)."""
    after = stdout[stdout.rindex(f"saving checkpoint at iteration {iteration:7d}"):]
    return "time (ms) | save-checkpoint: " in after and "successfully saved checkpoint" not in after


def shares(kills) -> list[float]:
    """The share of its step's bytes on disk at each of ``kills``, ascending, to two places."""
    return sorted(round(k["written"], 2) for k in kills)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_during_saves_resumes_from_a_complete_step_with_the_same_losses(kjv_data, reference, tmp_path,
                                                                                 async_save):
    """The chain's tasks killed with SIGKILL at moments spread over whole saves: after every kill ``latest`` names a
    complete step, and the next task (same flags) resumes from it and prints the uninterrupted run's losses; in the
    end every step folder is complete (each one a kill cut short was written again by the next task). With
    ``--async-save`` the kills land in the background writes, while training goes on (the reference run saved
    synchronously: the losses are the same either way). CI kills :data:`KILLS` times at moments drawn anew each run
    (the seed is printed), more if too few went on in the background (:func:`series_done`); `make soak` runs the
    full series."""
    save = tmp_path / "checkpoints"
    save.mkdir()
    shutil.copytree(reference.save / "global_step1", save / "global_step1")
    write_latest(save, "global_step1")
    args = chain_args(kjv_data, tmp_path, async_save)
    step_bytes = sum(f.stat().st_size for f in (reference.save / "global_step1").iterdir())
    seed = kill_seed()
    print(f"\nkill moments: seed {seed} ({SEED_VARIABLE}={seed} replays them)", flush=True)
    fractions = kill_fractions(KILLS, seed)
    kills: list[dict] = []  # the kills that landed inside a save
    runs = 0
    while not series_done(kills, async_save):
        assert runs < MAX_KILL_RUNS, f"{runs} runs, not enough kills inside a save (seed {seed}): {kills}"
        runs += 1
        before = assert_latest_is_complete(save)
        fraction = fractions[len(kills) % KILLS]  # tried again when the kill missed its save
        stdout = run_and_kill_in_a_save(args, save, int(fraction * step_bytes), tmp_path / "stderr.txt")
        assert_resumed_exactly(stdout, save, before, reference)
        after = assert_latest_is_complete(save)
        interrupted = interrupted_save(stdout)
        if interrupted is None:
            continue
        step = save / f"global_step{interrupted}"
        assert after in (f"global_step{interrupted - 1}", step.name), (before, after, interrupted)
        kills.append({"latest_moved": after == step.name, "written": folder_bytes(step) / step_bytes,
                      "files": len(list(step.iterdir())) if step.is_dir() else 0,
                      "training_went_on": handed_off(stdout, interrupted)})
    before = assert_latest_is_complete(save)
    final = subprocess.run([sys.executable, "-m", "opskit.train", *args], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"), cwd=REPO)
    assert final.returncode == 0, final.stderr[-3000:]
    assert assert_resumed_exactly(final.stdout, save, before, reference)[-1] == ITERATIONS
    assert assert_latest_is_complete(save) == f"global_step{ITERATIONS}"
    assert [s.iteration for s in list_steps(save)[1] if not s.complete] == []
    went_on = sum(k["training_went_on"] for k in kills)
    if async_save:  # the kills that matter: training had left the save to the writer thread
        assert went_on >= KILLS // 2, kills
    else:
        assert went_on == 0, kills
    files = {n: sum(k["files"] == n for k in kills) for n in sorted({k["files"] for k in kills})}
    print(f"\nseed {seed}: {runs} kills ({len(kills)} inside a save, {runs - len(kills)} after it had finished), "
          f"{runs} clean resumes; a save of {step_bytes} bytes took {statistics.median(reference.saves_ms):.1f} ms "
          f"(median of the reference run's; {min(reference.saves_ms):.1f}-{max(reference.saves_ms):.1f}); kills after "
          f"`latest` moved: {sum(k['latest_moved'] for k in kills)}; kills while training went on (the save in "
          f"the background): {went_on}, at shares {shares(k for k in kills if k['training_went_on'])}; files of the "
          f"step being written at the kill -> kills: {files}; share of the step's bytes written at the kill: "
          f"{shares(kills)}")


# --------------------------------------------------------------------------- SIGKILL during start-up


def test_a_start_killed_while_torch_extensions_was_locked_does_not_hang_the_next_start(kjv_data, tmp_path,
                                                                                       monkeypatch):
    """torch's JIT extension loader leaves ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` behind when its process is killed
    while holding it, and waits for ever on it afterwards; DeepSpeed took it for its CPU shared-memory op at every
    start (a cancelled job or a killed test hung all later trainer starts of the machine). The trainer starts, trains
    and leaves that file alone (not opskit's)."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    args = tiny_trainer_args(kjv_data, tmp_path / "run", train_samples=2 * GBS, save=None, load=None,
                             save_interval=None, tensorboard_dir=None)
    done = run_trainer(args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(done.stdout)) == [1, 2]
    assert lock.exists()


# --------------------------------------------------------------------------- disk full during a save


def pages(path: Path) -> int:
    """Bytes ``path`` takes on a tmpfs: whole 4 KiB pages."""
    return -(-path.stat().st_size // 4096) * 4096


def file_hashes(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in root.rglob("*")
            if f.is_file()}


@pytest.fixture
def small_fs(tmp_path):
    """``mount(size_bytes) -> Path``: a tmpfs of that size at ``tmp_path/fs``, unmounted at the end whatever
    happened. Skips where mounting is not permitted (CI runs as root)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / "fs"
        point.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                                  capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("no mount command")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        if subprocess.run(["umount", str(point)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "--lazy", str(point)], capture_output=True, timeout=30)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("full_in", ["layer file", "optimizer shard"])
def test_disk_full_during_a_save_is_one_line_and_loses_nothing(kjv_data, reference, small_fs, tmp_path, full_in,
                                                               async_save):
    """A file system with room for one step and part of the next: it fills inside the next step's first layer file,
    or inside its ZeRO optimizer shard (written after every model file: the likeliest case, 3/4 of the bytes). It
    holds the reference's global_step2 (the chain's earlier task); the next task resumes there and fails to save
    global_step4 with one error line and exit 2, ``latest`` and every earlier file are untouched, the cut-short step
    is not complete, and the watchdog alerts on the line. A background save (``--async-save``) fails the same way,
    from its writer thread."""
    one_step = reference.save / "global_step1"
    room = sum(pages(f) for f in one_step.iterdir()) + sum(pages(f) for f in reference.save.iterdir() if f.is_file())
    if full_in == "layer file":  # DeepSpeed writes the layer files first
        room += pages(one_step / "layer_01-model_00-model_states.pt") // 2
    else:
        shard = one_step / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        room += sum(pages(f) for f in one_step.glob("*model_states.pt")) + pages(shard) // 2
    fs = small_fs(room)
    save = fs / "checkpoints"
    save.mkdir()
    for top in (f for f in reference.save.iterdir() if f.is_file()):  # as the earlier task left them (zero_to_fp32.py)
        shutil.copy(top, save)
    shutil.copytree(reference.save / "global_step2", save / "global_step2")
    write_latest(save, "global_step2")
    kept = file_hashes(fs)

    second = run_trainer(chain_args(kjv_data, tmp_path, async_save, save_interval=2, save=save, load=save))
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
    assert "Traceback" not in second.stdout + second.stderr, second.stderr[-4000:]
    [line] = [line for line in second.stderr.splitlines() if "error:" in line]
    assert re.fullmatch(rf"error: saving global_step4 failed: \[Errno 28\] No space left on device "
                        rf"\({re.escape(str(save))}/global_step4/[\w.-]+\.pt\)", line), line
    assert read_latest(save) == "global_step2" and describe_step(save / "global_step2").complete
    after = file_hashes(fs)
    assert {name: after.get(name) for name in kept} == kept
    assert all(name.startswith("checkpoints/global_step4/") for name in set(after) - set(kept)), sorted(after)
    assert not describe_step(save / "global_step4").complete

    run = RunPaths(tmp_path / "run")  # the job script appends the trainer's stdout and stderr to main_log.txt
    run.logs.mkdir(parents=True)
    run.main_log.write_text(second.stdout + second.stderr)
    findings = log_findings(read_log(run, WatchdogState()), WatchdogSpec(), datetime.now(), None)
    [finding] = [f for f in findings if f.key == "log.save_failed"]
    assert finding.severity == "alert" and finding.data["tag"] == "global_step4", finding
    assert "No space left on device" in finding.message and "log.crash" not in {f.key for f in findings}
    print(f"\n{line}\n{finding.key} ({finding.severity}): {finding.message}")
