"""opskit.submission.submit end to end: a real 2-task chain on the local SLURM (each task stops on its exit duration
with a checkpoint, task 2 resuming exactly where task 1 saved), the same chain with the local executor (tasks stopped by
SIGUSR1), SIGUSR1 through srun, --dry-run, the rendered script under bash -n / shellcheck, hostile names and paths,
missing data."""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_spec

from opskit.fsutil import write_marker
from opskit.monitor.pulse import wait_until_gone
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.spec.load import load_spec
from opskit.submission.submit import SubmitError, submit

OPSKIT = str(Path(sys.executable).with_name("opskit"))
GBS = 8
# ~0.2 M parameters at ~40 iterations/s on one core. One OpenMP thread: with two, a second busy process on a 2-core
# machine slows such a tiny model down 10x or more (threads spin at every barrier).
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32}
# Chains train far longer than their tasks run (CHAIN_ITERATIONS), so every task stops on its time mechanism, however
# fast or loaded this machine is: the tests check the stops and the resume, never a speed.
CHAIN_ITERATIONS = 100_000

HEADER = re.compile(r"^\[opskit\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d job (\S+) \(array task (\S+)\) nodes (\S+): (.*)$",
                    re.M)


def chain_spec(folder: Path, data, job_name: str, iterations: int, output: Path | None = None,
               parallel: dict | None = None, log_interval: int = 50, watchdog: dict | None = None, **slurm):
    """The tiny preset shrunk to MODEL, ``iterations`` long, checkpointing only when a task exits; ``parallel`` and
    ``watchdog`` merged into those sections."""
    settings = {"job_name": job_name, "cpus_per_task": 1, "master_port": random.randint(20000, 29000),
                "array": 2, "env": {"OMP_NUM_THREADS": "1"}, **slurm}
    path = write_spec(
        folder / "spec.yaml", data, output or folder / "run", model=MODEL,
        batch={"micro_batch_size": 4, "global_batch_size": GBS, "train_samples": iterations * GBS},
        optimizer={"lr_warmup_samples": 32}, checkpoint={"save_interval": 100_000, "log_interval": log_interval},
        parallel=parallel or {}, watchdog=watchdog or {}, slurm=settings)
    return load_spec(str(path))


def tasks_of(log: str) -> list[tuple[str, str]]:
    """(array task, text) for each task's section of main_log.txt, in file order."""
    starts = [m for m in HEADER.finditer(log) if m.group(4) == "start"]
    return [(m.group(2), log[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(log))])
            for i, m in enumerate(starts)]


def one(pattern: str, text: str) -> re.Match:
    matches = list(re.finditer(pattern, text, re.M))
    assert len(matches) == 1, f"{pattern!r}: {len(matches)} matches in\n{text[-3000:]}"
    return matches[0]


def iterations_logged(text: str) -> list[tuple[int, int, int, float]]:
    """(iteration, train_iters, consumed samples, samples per second) of each iteration line."""
    return [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in re.finditer(
        r" iteration +(\d+)/ *(\d+) \| consumed samples: +(\d+) \|.*? samples per second: ([\d.]+) \|", text)]


def assert_resumed_chain(run: RunPaths, task_ids: list[str], stop: str) -> tuple[int, int]:
    """main_log.txt shows task 1 stopping with a checkpoint at K1 (``stop`` is the exit line's regex), task 2 loading
    K1 and stopping the same way with a checkpoint at K2 > K1, both exiting 0; returns (K1, K2)."""
    log = run.main_log.read_text()
    tasks = tasks_of(log)
    assert [t for t, _ in tasks] == task_ids, log[-3000:]
    (_, first), (_, second) = tasks

    assert "successfully loaded checkpoint" not in first
    assert "will not load any checkpoints and will start from random" in first
    loaded = one(r"successfully loaded checkpoint from (.+) at iteration (\d+)$", second)
    assert loaded.group(1) == str(run.checkpoints)
    saves = []
    for text in (first, second):
        one(r"\[" + stop + r"\] datetime: ", text)
        saves.append(int(one(r"successfully saved checkpoint at iteration +(\d+) to ", text).group(1)))
        assert all(it <= saves[-1] for it, *_ in iterations_logged(text)), "a task saved before its last iteration"
        assert "after training is done" not in text
        assert one(r"end, exit code (\d+)$", text).group(1) == "0"
    first_saved, second_saved = saves
    assert int(loaded.group(2)) == first_saved and 0 < first_saved < second_saved

    # No sample counted twice or skipped across the restart; task 2 continues where task 1 saved.
    lines = iterations_logged(log)
    assert lines and all(samples == it * GBS and total == CHAIN_ITERATIONS for it, total, samples, _ in lines)
    assert all(it > first_saved for it, *_ in iterations_logged(second))
    assert (run.checkpoints / "latest").read_text() == f"global_step{second_saved}"
    assert (run.checkpoints / f"global_step{first_saved}").is_dir()
    assert [r.state for r in chain.read_ledger(run)] == ["COMPLETED", "COMPLETED"]
    return first_saved, second_saved


# --------------------------------------------------------------------------- SIGUSR1 on SLURM


@pytest.fixture(scope="module")
def usr1_run(kjv_data, tmp_path_factory, slurm):
    """One SLURM task that trains until the test sends its batch shell SIGUSR1 (what --signal=B:USR1@N does), a few
    seconds into training."""
    folder = tmp_path_factory.mktemp("usr1")
    name = f"opskit-usr1-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(folder, kjv_data, name, CHAIN_ITERATIONS, time="10", exit_margin_mins=5, signal_margin_secs=10,
                      array=1)
    sub = submit(spec)
    try:
        deadline = time.monotonic() + 90
        while not (sub.run.main_log.is_file() and len(iterations_logged(sub.run.main_log.read_text())) >= 4):
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        signalled = subprocess.run(["scancel", "--batch", "--signal=USR1", sub.job_id], capture_output=True,
                                   text=True)
        ended = wait_until_gone(name, sub.job_id, lambda p: None, interval_s=0.5, timeout_s=60)
    finally:
        subprocess.run(["scancel", sub.job_id], capture_output=True, timeout=30)
    return sub, signalled, ended


def test_slurm_sigusr1_reaches_the_trainer_through_srun(usr1_run):
    sub, signalled, ended = usr1_run
    assert sub.command == ["sbatch", "--parsable", str(sub.run.script)]
    assert signalled.returncode == 0, signalled.stderr
    assert ended, "the job did not end after SIGUSR1"
    log = sub.run.main_log.read_text()
    one(r"nodes localhost: SIGUSR1: asking the trainer to save and exit$", log)
    stopped = int(one(r"\[exiting program on SIGUSR1 at iteration (\d+)\]", log).group(1))
    assert int(one(r"successfully saved checkpoint at iteration +(\d+) to ", log).group(1)) == stopped
    assert one(r"end, exit code (\d+)$", log).group(1) == "0"
    assert (sub.run.checkpoints / "latest").read_text() == f"global_step{stopped}"


# --------------------------------------------------------------------------- the local executor


@pytest.fixture(scope="module")
def local_chain(kjv_data, tmp_path_factory):
    """The local executor's 2-task chain, run once, in a run directory whose path and job name would run code if
    the script ever let the shell evaluate them. Runs in a scratch working directory that must stay empty."""
    folder = tmp_path_factory.mktemp("local")
    scratch = tmp_path_factory.mktemp("cwd")
    output = folder / "run dir $(touch PWNED-path) it's \"q\""
    spec = chain_spec(folder, kjv_data, "it's a \"local\" $(touch PWNED-name) chain", CHAIN_ITERATIONS, output=output,
                      time="1", exit_margin_mins=0.5, signal_margin_secs=40)
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        started = time.monotonic()
        sub = submit(spec, executor="local", array=2)
        elapsed = time.monotonic() - started
    finally:
        os.chdir(cwd)
    return spec, sub, elapsed, scratch


def test_local_executor_runs_resumes_and_exits_0(local_chain):
    spec, sub, elapsed, scratch = local_chain
    run = sub.run
    assert run.root.name == "run dir $(touch PWNED-path) it's \"q\""
    assert [(t.task_id, t.exit_code, t.timed_out) for t in sub.local_tasks] == [(1, 0, False), (2, 0, False)], \
        run.main_log.read_text()[-3000:]
    assert elapsed < 2 * 60, "a task ran to its time limit"
    job_id = f"local{os.getpid()}"
    assert sub.command == ["bash", str(run.script)]
    for task in sub.local_tasks:
        assert task.output == run.slurm_dir / f"{spec.job_name}-{job_id}_{task.task_id}.out"
        assert task.output.is_file()

    # Each task was stopped by the SIGUSR1 the executor sends 40 s before its 60 s limit (before its 30 s exit
    # duration): the batch shell passed it on to the trainer, which saved and exited 0.
    saves = assert_resumed_chain(run, [f"{job_id}_1", f"{job_id}_2"], r"exiting program on SIGUSR1 at iteration (\d+)")
    for (_, text), saved in zip(tasks_of(run.main_log.read_text()), saves, strict=True):
        assert int(one(r"exiting program on SIGUSR1 at iteration (\d+)", text).group(1)) == saved
        one(r"nodes \S+: SIGUSR1: asking the trainer to save and exit$", text)

    # Nothing in the name or the path was ever run by a shell.
    assert list(scratch.iterdir()) == []
    assert not any(p.name.startswith("PWNED") for p in run.root.parent.iterdir())


# --------------------------------------------------------------------------- SLURM


def test_slurm_chain_exit_duration_then_resume(kjv_data, tmp_path, cancel_after):
    # Each task stops on its 30 s exit duration. (slurm.time 2 min minus 1.5: SLURM may send the USR1 up to a 30 s
    # check period early, so its 30 s signal margin still cannot fire before the exit duration.)
    name = f"opskit-chain-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, CHAIN_ITERATIONS, time="2", exit_margin_mins=1.5, signal_margin_secs=30)
    assert spec.exit_duration_in_mins == 0.5

    sub = submit(spec, array=2)
    cancel_after.append(sub.job_id)
    assert sub.command == ["sbatch", "--parsable", "--array=1-2%1", str(sub.run.script)]
    assert re.fullmatch(r"\d+", sub.job_id)

    pulses: list[str] = []
    ended = wait_until_gone(name, sub.job_id, lambda p: pulses.extend(p.lines), interval_s=1,
                                   timeout_s=240)
    assert ended, f"job {sub.job_id} still queued after 4 min: {pulses[-3:]}"

    # While task 1 ran, the watchdog saw task 2 held back by the array's %1 throttle.
    assert any(" is running for " in p and f"({sub.job_id}_1 on " in p for p in pulses), pulses
    assert any(f"{name} is waiting for the previous Job Array job to finish before scheduling a new one "
               f"({sub.job_id}_2 on 'debug' partition)" in p for p in pulses), pulses

    run = sub.run
    log = run.main_log.read_text()
    headers = [m for m in HEADER.finditer(log) if m.group(4) == "start"]
    assert [m.group(2) for m in headers] == [f"{sub.job_id}_1", f"{sub.job_id}_2"], log[-3000:]
    assert all(m.group(3) == "localhost" for m in headers)
    assert len({m.group(1) for m in headers}) == 2  # two SLURM jobs, one per task
    assert_resumed_chain(run, [f"{sub.job_id}_1", f"{sub.job_id}_2"], r"exiting program after (\d+\.\d+) minutes")
    for _, text in tasks_of(log):
        assert 0.5 <= float(one(r"\[exiting program after (\d+\.\d+) minutes\]", text).group(1)) < 0.6
    assert "SIGUSR1" not in log
    # SLURM's own output files (%x-%j.out), one per task.
    assert len(list(run.slurm_dir.glob(f"{name}-*.out"))) == 2


# --------------------------------------------------------------------------- rendering, dry run, refusals


def test_dry_run_renders_without_sbatch(kjv_data, tmp_path, slurm):
    name = f"opskit-dry-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, 100)
    sub = submit(spec, array=2, dry_run=True)
    assert sub.job_id is None
    assert sub.command == ["sbatch", "--parsable", "--array=1-2%1", str(sub.run.script)]
    assert sub.script.startswith("#!/bin/bash\n") and f"\n#SBATCH --comment=opskit-run:{sub.run.root}\n" in sub.script
    assert not sub.run.root.exists()  # a dry run writes nothing
    assert not [e for e in client.squeue() if e.name == name]

    # One task: no --array at all; the spec's slurm.array is the default.
    assert submit(spec, array=1, dry_run=True).command == ["sbatch", "--parsable", str(sub.run.script)]
    assert submit(spec, dry_run=True).command[2] == "--array=1-2%1"

    done = subprocess.run([OPSKIT, "submit", str(tmp_path / "spec.yaml"), "--dry-run", "--array", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash\n")
    assert done.stdout.rstrip("\n").endswith(f"# would run: sbatch --parsable --array=1-3%1 {sub.run.script}")
    assert not [e for e in client.squeue() if e.name == name]


def test_rendered_script_passes_bash_n_and_shellcheck(kjv_data, tmp_path, shellcheck):
    script = tmp_path / "train.slurm"
    script.write_text(submit(chain_spec(tmp_path, kjv_data, "tr11-176B-ml", 100), dry_run=True).script)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck(script)
    text = script.read_text()
    assert "#SBATCH --job-name=tr11-176B-ml\n" in text
    assert "#SBATCH --array" not in text  # given on sbatch's command line, never baked in
    assert "--exit-duration-in-mins 2.0 " in text  # the preset's 3 min minus its 1 min margin


HOSTILE_NAME = "it's a \"job\" $(touch /tmp/opskit-pwned-{tag}) `touch /tmp/opskit-pwned2-{tag}` #1"


def test_hostile_names_and_paths_stay_literal(kjv_data, tmp_path, slurm, cancel_after, shellcheck):
    tag = uuid.uuid4().hex[:8]
    markers = [Path(f"/tmp/opskit-pwned-{tag}"), Path(f"/tmp/opskit-pwned2-{tag}")]
    name = HOSTILE_NAME.format(tag=tag)
    output = tmp_path / "runs" / "a b $(touch PWNED) `touch PWNED2` it's \"q\" ;x"
    spec = chain_spec(tmp_path, kjv_data, name, 100, output=output)
    sub = submit(spec, dry_run=True)
    script = sub.run.script
    assert script == output / "slurm" / "train.slurm"
    script.parent.mkdir(parents=True)
    script.write_text(sub.script)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck(script, exclude=("SC2016",))  # literal `$(...)` in single quotes is the point here

    # The script run by bash with its one exec replaced by printf: the exact paths arrive as the job's arguments, in
    # its environment, and nothing runs.
    text = script.read_text()
    assert "\nexport OMP_NUM_THREADS=" in text and text.count("\nexec ") == 1
    probe = text.replace("\nexec ", '\nprintf "%s\\n" "$OPSKIT_RUN_DIR" ', 1)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=scratch)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert printed[0] == str(output) and printed[2:4] == ["-m", "opskit.allocation.job"]
    assert printed[printed.index("--run-dir") + 1] == str(output)
    assert printed[printed.index("--save") + 1] == str(output / "checkpoints")
    assert list(scratch.iterdir()) == [] and not any(m.exists() for m in markers)

    # sbatch reads the #SBATCH header with shell-like quoting: the name and the output path arrive intact.
    done = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True,
                          cwd=scratch, timeout=30)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    cancel_after.append(job_id)
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert f"JobName={name}\n" in shown, shown
    assert f"StdOut={output}/slurm/{name}-{job_id}.out\n" in shown, shown
    [entry] = [e for e in client.squeue() if e.array_id == job_id]  # the run's comment, read back whole
    assert (entry.name, entry.comment, entry.command) == (name, f"opskit-run:{output}", str(script))
    assert list(scratch.iterdir()) == [] and not any(m.exists() for m in markers)


def test_submit_without_data_names_the_prepare_command(kjv_data, tmp_path, slurm):
    spec_path = write_spec(tmp_path / "my spec.yaml", kjv_data, tmp_path / "run", data={"dir": str(tmp_path / "nd")})
    spec = load_spec(str(spec_path))
    with pytest.raises(SubmitError) as info:
        submit(spec, array=2)
    message = str(info.value)
    assert message == (f"{tmp_path / 'nd' / 'tokenizer' / 'tokenizer.json'} is missing: run "
                       f"`opskit data prepare {shlex.quote(str(spec_path))}` first")
    assert not (tmp_path / "run").exists()  # refused before rendering anything

    done = subprocess.run([OPSKIT, "submit", str(spec_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == f"error: {message}\n"
    assert not [e for e in client.squeue() if e.name == spec.job_name]

    with pytest.raises(SubmitError, match=r"^--executor pbs: expected 'slurm' or 'local'$"):
        submit(load_spec(str(write_spec(tmp_path / "ok.yaml", kjv_data, tmp_path / "run2"))), executor="pbs")


def test_submit_says_what_happens_to_a_checkpoint_of_another_layout(kjv_data, bloom_run, tmp_path, slurm):
    import shutil

    import torch
    from megatron_ckpt import build_checkpoint

    from opskit.fsutil import write_marker

    name = f"opskit-reshape-{uuid.uuid4().hex[:8]}"
    spec = chain_spec(tmp_path, kjv_data, name, 100)
    run = RunPaths.of(spec)
    run.root.mkdir(parents=True)
    write_marker(run.root, "submit")
    shutil.copytree(bloom_run / "checkpoints", run.checkpoints)  # global_step20, saved at TP=1 PP=1 DP=1
    assert not [n for n in submit(spec, dry_run=True).notes if "was saved at" in n]  # the same layout: nothing to say

    spec_file = str(tmp_path / "spec.yaml")
    done = subprocess.run([OPSKIT, "submit", spec_file, "--nodes", "2", "--dry-run"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert (f"# note: latest checkpoint global_step20 was saved at TP=1 PP=1 DP=1; this job runs TP=1 PP=1 DP=2: the "
            f"trainer converts it to global_step20_universal at start (or run `opskit ckpt reshape "
            f"{run.checkpoints / 'global_step20'} --tp 1 --pp 1 --dp 2` before)\n") in done.stdout

    # A node count the batch cannot split over is refused by the spec's rules (opskit plan's valid node counts).
    refused = subprocess.run([OPSKIT, "submit", spec_file, "--nodes", "3", "--dry-run"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "valid parallel.nodes for this layout: 1, 2" in refused.stderr

    # A change the trainer cannot load (TP of a ZeRO-0 step) is refused before anything is queued or written.
    shutil.rmtree(run.checkpoints)
    step = build_checkpoint(run.checkpoints, arch="bloom", tp=2, layers=2, dtype=torch.float32, zero_stage=0)
    with pytest.raises(SubmitError) as info:  # the trainer's ReshapeError, as submit's one problem
        submit(spec)
    assert str(info.value) == (f"{step}: layout TP=2 PP=1 DP=1 -> TP=1 PP=1 DP=1: a ZeRO stage 0 step keeps its "
                               "optimizer unpartitioned; it resumes on another DP size, but a TP or PP change needs "
                               "ZeRO stage 1")
    assert not run.script.exists() and not [e for e in client.squeue() if e.name == name]


# --------------------------------------------------------------------------- every problem at once


def without_bigscience_variables() -> dict[str, str]:
    """This environment as a new user's: none of BigScience's ``$six_*`` variables."""
    return {key: value for key, value in os.environ.items() if not key.startswith("six_")}


def listing(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*"))


def test_tr11_dry_run_shows_the_script_and_every_problem_at_once(tmp_path):
    """A new user's first command: the script with the variables as they must be provided, every problem after it,
    exit 0, nothing written; the real submission refuses the same problems in one error."""
    run = [OPSKIT, "submit", "tr11", "--dry-run"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=without_bigscience_variables())
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("#!/bin/bash\n")
    script = "'$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml/slurm/train.slurm'"
    assert ("--train-weighted-split-paths-path "
            "'$six_ALL_CCFRWORK/code/tr11-176B-ml/Megatron-DeepSpeed/data/train-splits.txt'") in done.stdout
    assert "export OPSKIT_RUN_DIR='$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml'\n" in done.stdout
    fix = ("export it as on the cluster's login node, or write it into your copy: opskit specs new mine --from "
           "tr11-176B-ml")
    assert done.stdout.splitlines()[-3:] == [
        f"# would run: sbatch --parsable --array=1-3%1 {script}",
        f"# warning: $six_ALL_CCFRSCRATCH is not set here (used by paths.output): {fix} "
        "--set six_ALL_CCFRSCRATCH=/path",
        "# warning: $six_ALL_CCFRWORK is not set here (used by data.train_weighted_split_paths_path, "
        "data.valid_weighted_split_paths_path, slurm.env.TRANSFORMERS_CACHE, slurm.env.HF_DATASETS_CACHE, "
        f"slurm.env.HF_MODULES_CACHE, slurm.env.HF_METRICS_CACHE): {fix} --set six_ALL_CCFRWORK=/path"]
    assert listing(tmp_path) == []

    refused = subprocess.run(run[:-1], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env=without_bigscience_variables())
    assert (refused.returncode, refused.stdout) == (1, "")
    lines = refused.stderr.splitlines()
    assert lines[0] == "error: cannot submit tr11-176B-ml: 2 problems"
    assert lines[1:] == [f"  - {w.removeprefix('# warning: ')}" for w in done.stdout.splitlines()[-2:]]
    assert listing(tmp_path) == []

    # With the variables set, what is missing behind them: both catalogue split files, in one run.
    env = {**without_bigscience_variables(), "six_ALL_CCFRWORK": str(tmp_path / "work"),
           "six_ALL_CCFRSCRATCH": str(tmp_path / "scratch")}
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    warnings = [line for line in done.stdout.splitlines() if line.startswith("# warning: ")]
    assert done.returncode == 0 and [w.split(" is missing")[0].rsplit("/", 1)[1] for w in warnings] == [
        "train-splits.txt", "valid-splits.txt"], done.stdout[-2000:] + done.stderr
    assert listing(tmp_path) == []


def test_real_submit_lists_all_blocking_problems_and_queues_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("OPSKIT_TEST_NEVER_SET", raising=False)
    missing = tmp_path / "nowhere" / "oscar_text_document"
    spec = load_spec(str(write_spec(
        tmp_path / "spec.yaml", SimpleNamespace(data_prefix=str(tmp_path / "unused")), tmp_path / "run",
        data={"corpus": None, "dir": None, "data_path": str(missing), "tokenizer_name_or_path": "gpt2"},
        slurm={"env": {"HF_HOME": "$OPSKIT_TEST_NEVER_SET/hf"}})))

    def never(*args, **kwargs):
        raise AssertionError("a refused submission asked SLURM")

    monkeypatch.setattr(client, "sbatch", never)
    monkeypatch.setattr(client, "squeue", never)
    with pytest.raises(SubmitError) as info:
        submit(spec, array=2)
    lines = str(info.value).splitlines()
    assert lines[0] == f"cannot submit {spec.name}: 3 problems"
    assert lines[1] == (f"  - $OPSKIT_TEST_NEVER_SET is not set here (used by slurm.env.HF_HOME): export it as on the "
                        f"cluster's login node, or write the value into {tmp_path / 'spec.yaml'}")
    assert lines[2:] == [f"  - {missing}.{suffix} is missing (data.data_path of {tmp_path / 'spec.yaml'}): prepare it "
                         "before submitting (Megatron's tools/preprocess_data.py writes indexed datasets)"
                         for suffix in ("bin", "idx")]
    assert listing(tmp_path) == [str(tmp_path / "spec.yaml")]  # no run directory, no script

    # The dry run returns the same problems with the script, which shows the variable as written.
    monkeypatch.setattr(client, "squeue", lambda *a, **k: [])
    sub = submit(spec, array=2, dry_run=True)
    assert sub.warnings == [line.removeprefix("  - ") for line in lines[1:]]
    assert "export HF_HOME='$OPSKIT_TEST_NEVER_SET/hf'\n" in sub.script
    assert listing(tmp_path) == [str(tmp_path / "spec.yaml")]

    # What the run directory holds is listed too, every flag at once.
    (tmp_path / "run").mkdir()
    write_marker(tmp_path / "run", "submit")
    (tmp_path / "run" / "kill-switch").touch()
    (tmp_path / "run" / "finished").write_text("training finished at iteration 50\n")
    with pytest.raises(SubmitError) as info:
        submit(spec, array=2)
    lines = str(info.value).splitlines()
    assert lines[0] == f"cannot submit {spec.name}: 5 problems"
    assert lines[4].startswith(f"  - the kill switch {tmp_path / 'run' / 'kill-switch'} is on")
    assert lines[5].startswith(f"  - the training finished ({tmp_path / 'run' / 'finished'}: training finished at")


@pytest.mark.parametrize("name", ["tr1-13B", "tr8-104B", "tr8b-104B:cl", "tr8b-104B:bnb", "tr11-176B-ml:24n"])
def test_every_bigscience_preset_dry_runs_with_its_variables_as_warnings(tmp_path, name):
    done = subprocess.run([OPSKIT, "submit", name, "--dry-run"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=without_bigscience_variables())
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("# warning: ")]
    assert [w.split(" is not set here")[0] for w in warnings] == ["# warning: $six_ALL_CCFRSCRATCH",
                                                                  "# warning: $six_ALL_CCFRWORK"], warnings
    assert done.stdout.startswith("#!/bin/bash\n") and listing(tmp_path) == []


def test_tiny_dry_run_warns_only_of_its_unprepared_data(tmp_path):
    def dry_run() -> list[str]:
        done = subprocess.run([OPSKIT, "submit", "tiny", "--dry-run"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.startswith("#!/bin/bash\n"), done.stderr
        return [line for line in done.stdout.splitlines() if line.startswith("# warning: ")]

    assert dry_run() == [f"# warning: {tmp_path}/data/kjv/tokenizer/tokenizer.json is missing: run `opskit data "
                         "prepare tiny` first"]
    for name in ("tokenizer/tokenizer.json", "kjv_text_document.bin", "kjv_text_document.idx"):  # what it checks
        (tmp_path / "data" / "kjv" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "kjv" / name).touch()
    assert dry_run() == []
