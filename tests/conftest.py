"""Shared fixtures: real data (the KJV Bible through opskit.data.corpus), a real local SLURM, a tiny trainer command
line, and the session's trained runs (:func:`trained`: one training per flag set, shared by every test and xdist
worker that asks for it).

Under pytest-xdist (`make test` runs two workers, ``--dist loadgroup``), :func:`pytest_collection_modifyitems` puts
every test of a module in one group (its module-scoped fixtures are built once), except the tests that use the
single-node SLURM (group ``slurm``) or the multi-node clusters (group ``multinode``): each of those groups runs on one
worker, in order, beside the other worker's tests. docs/design.md (Testing) says how the suite is shaped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import settings

from opskit.slurm import client

# CI replays the same bounded fuzz cases every run (a failure there is reproducible, never a new draw); a developer's
# run explores new ones: `CI=true pytest` replays CI's.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parents[1]

# xdist sets COLUMNS=80 in its workers, and rich fixes a console's width from COLUMNS when the console is made (at the
# CLI's import): the CLI tests that render at COLUMNS=200 through CliRunner would get 80 under xdist alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

SOAK = os.environ.get("OPSKIT_SOAK") == "1"
"""`make soak`: the long loops at their full size (every SIGKILL of the series, every preset rehearsed end to end);
CI runs a random sample of each."""

# Fixtures whose tests run in one xdist group, in order, on one worker: the shared single-node SLURM (and root's
# crontab), and the multi-node clusters (network namespaces, many daemons on two cores).
SERIAL_GROUPS = {"slurm": "slurm", "jobs": "slurm", "cancel_after": "slurm", "user_crontab": "slurm",
                 "slurm_cluster": "multinode"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Each test's xdist group (``--dist loadgroup``): ``slurm`` or ``multinode`` for a test that uses those
    clusters (or carries the ``slurm`` mark), else its module's, so that a module's fixtures are built on one worker."""
    for item in items:
        groups = {SERIAL_GROUPS[name] for name in item.fixturenames if name in SERIAL_GROUPS}
        if not groups and item.get_closest_marker("slurm"):
            groups = {"slurm"}
        group = "multinode" if "multinode" in groups else "slurm" if groups else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup`` each test id a worker collected must end in its group (every test has one:
    :func:`pytest_collection_modifyitems`): xdist sends a group to one worker by that suffix, written into a field
    pytest 9.2 no longer reads (pytest-xdist issue 1386), and the groups then split silently (two tests editing
    root's crontab at once failed a CI run)."""
    lost = [i for i in ids if "@" not in i.rsplit("]", 1)[-1]]
    if node.config.getvalue("dist") == "loadgroup" and lost:
        raise pytest.UsageError(f"--dist loadgroup: {len(lost)} test ids without their group (e.g. {lost[0]}): "
                                "pytest >= 9.2 with pytest-xdist <= 3.8 loses them; pip install 'pytest<9.2'")


def shared_dir(tmp_path_factory) -> Path:
    """A folder every xdist worker of this session shares (the parent of the workers' own temporary folders), or the
    session's temporary folder without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick), for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The lint every rendered job script passes: every note counts, down to style.
SHELLCHECK = ("shellcheck", "--shell=bash", "--severity=style")


@pytest.fixture(scope="session")
def shellcheck():
    """``shellcheck(*scripts, exclude=())`` asserts the scripts pass :data:`SHELLCHECK` (``exclude``: codes like
    ``SC2016`` a test expects). ShellCheck is required under CI and as root, where `make test` installs it
    (scripts/system-deps.sh): missing there, the test fails; elsewhere it is skipped, saying how to install it."""
    if shutil.which("shellcheck") is None:
        reason = "shellcheck is missing: apt-get install -y shellcheck (`make test` does, as root)"
        if os.environ.get("CI") or os.geteuid() == 0:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)

    def check(*scripts: Path, exclude: tuple[str, ...] = ()) -> None:
        args = [*SHELLCHECK, *(f"--exclude={code}" for code in exclude), *map(str, scripts)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.fail(done.stdout + done.stderr, pytrace=False)

    return check


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory):
    """The KJV Bible as tokenizer + indexed dataset (vocab 2000 to keep the tiny models fast), prepared once for
    every xdist worker (a second preparation of the same request reuses it)."""
    from opskit.data.corpus import prepare_data

    folder = shared_dir(tmp_path_factory) / "kjv"
    with FileLock(f"{folder}.lock"):
        return prepare_data("kjv", folder, vocab_size=2000, name="kjv")


def tiny_trainer_args(data, out: Path, **overrides) -> list[str]:
    """Flags for a ~0.4 M-parameter BLOOM that trains at a few ms per iteration on 2 CPU cores.

    ``overrides`` replace or add flags: ``train_samples=64`` -> ``--train-samples 64``; ``True`` adds a switch,
    ``None`` removes the flag.
    """
    flags = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "max_position_embeddings": 32, "position_embedding_type": "alibi", "embed_layernorm": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "micro_batch_size": 4, "global_batch_size": 8,
        "train_samples": 320, "lr": 3e-3, "min_lr": 3e-4, "lr_decay_style": "cosine", "lr_warmup_samples": 32,
        "seed": 1234, "log_interval": 1, "data_path": data.data_prefix,
        "tokenizer_name_or_path": data.tokenizer_dir, "save": out / "checkpoints", "load": out / "checkpoints",
        "save_interval": 20, "tensorboard_dir": out / "tensorboard",
    }
    flags.update(overrides)
    args: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        args.append("--" + (key if key == "deepspeed_config" else key.replace("_", "-")))
        if value is not True:
            args.append(str(value))
    return args


def run_trainer(args: list[str], nproc: int = 1, timeout: float = 600, entry: tuple[str, ...] = ("-m", "opskit.train"),
                **popen) -> subprocess.CompletedProcess:
    """``python -m opskit.train`` (or under ``torchrun --nproc_per_node N``) as a real subprocess; ``entry`` replaces
    ``-m opskit.train`` (``("-c", code)``: a test's wrapper of the trainer, one process only: torchrun has no -c)."""
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else "2", PYTHONUNBUFFERED="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port())] if nproc > 1 else [sys.executable]
    return subprocess.run(launcher + [*entry, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO, **popen)


# One process runs many trainer command lines in turn (each one's stdout and stderr caught at the file descriptors, as
# a subprocess's would be): the cases whose whole point is the trainer's one-line refusal pay its imports once. The
# cases call opskit.train.main.main as it is when they run, so a prelude may wrap it.
_CASES = """\
import json, os, sys, tempfile, traceback
import opskit.train.main

cases, results = json.loads(open(sys.argv[1]).read()), {}
for name, argv in cases.items():
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # a fresh one-process world each
        os.environ.pop(var, None)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            code = opskit.train.main.main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        out.seek(0), err.seek(0)
        results[name] = {"returncode": code, "stdout": out.read(), "stderr": err.read()}
open(sys.argv[2], "w").write(json.dumps(results))
"""


def run_trainer_cases(cases: dict[str, list[str]], folder: Path, timeout: float = 600, prelude: str = ""
                      ) -> dict[str, subprocess.CompletedProcess]:
    """Each of ``cases`` (name -> trainer flags) through the trainer's ``main`` in ONE process, one after the other,
    as ``python -m opskit.train FLAGS`` would run it alone (one rank, no launcher): name -> a CompletedProcess with
    its exit code (argparse's SystemExit code included) and what it printed. For refusals at start; a case that
    trains runs too. ``prelude``: Python code run once before the cases (a test's patch of DeepSpeed, or a wrapper
    of ``opskit.train.main.main``, which the cases then call; what a wrapper prints counts as its case's).
    ``folder`` holds the case list and the results."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cases.json").write_text(json.dumps({k: [str(a) for a in v] for k, v in cases.items()}))
    done = run_trainer([str(folder / "cases.json"), str(folder / "results.json")],
                       entry=("-c", prelude + "\n" + _CASES), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((folder / "results.json").read_text())
    return {name: subprocess.CompletedProcess(cases[name], r["returncode"], r["stdout"], r["stderr"])
            for name, r in results.items()}


@dataclass(frozen=True)
class TrainedRun:
    """A finished training of :func:`trained`: its run folder (``checkpoints/``, ``tensorboard/``), what it printed,
    and the flags it ran with (``tiny_trainer_args`` overrides). Read only: a test that changes a step copies it."""

    out: Path
    stdout: str
    stderr: str
    flags: dict = field(repr=False)

    @property
    def save(self) -> Path:
        return self.out / "checkpoints"


@pytest.fixture(scope="session")
def trained(kjv_data, tmp_path_factory):
    """``trained(nproc=1, **flags) -> TrainedRun``: the tiny trainer run with ``tiny_trainer_args(..., **flags)``
    (under torchrun with ``nproc`` > 1), trained once per session and flag set, whichever test or xdist worker asks
    first (a file lock; the others wait and read its folder). It must succeed."""
    root = shared_dir(tmp_path_factory) / "trained"
    root.mkdir(exist_ok=True)

    def train(nproc: int = 1, **flags) -> TrainedRun:
        key = json.dumps([nproc, sorted((k, str(v)) for k, v in flags.items())])
        folder = root / hashlib.sha256(key.encode()).hexdigest()[:16]
        with FileLock(f"{folder}.lock"):
            if not (folder / "printed.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)  # a training that failed in an earlier test
                done = run_trainer(tiny_trainer_args(kjv_data, folder, **flags), nproc=nproc)
                assert done.returncode == 0, done.stderr[-3000:]
                (folder / "printed.json").write_text(json.dumps({"stdout": done.stdout, "stderr": done.stderr}))
        printed = json.loads((folder / "printed.json").read_text())
        return TrainedRun(folder, printed["stdout"], printed["stderr"], flags)

    return train


def copy_run(run: TrainedRun, to: Path, steps: tuple[str, ...] | None = None) -> Path:
    """``run``'s checkpoint folder copied to ``to/checkpoints`` (only ``steps`` and a ``latest`` naming the last of
    them, when given): a test's own copy to resume from or to damage. Returns ``to``."""
    save = to / "checkpoints"
    if steps is None:
        shutil.copytree(run.save, save)
    else:
        save.mkdir(parents=True)
        for step in steps:
            shutil.copytree(run.save / step, save / step)
        (save / "latest").write_text(steps[-1])
    return to


BLOOM_RUN = dict(train_samples=160, save_interval=10, log_interval=10)
"""20 iterations of the tiny BLOOM (TP=1, PP=1), checkpoints at 10 and 20: the checkpoint tests' run."""


@pytest.fixture(scope="session")
def bloom_run(trained) -> Path:
    """:data:`BLOOM_RUN`'s run folder. Shared by the checkpoint tests (test_convert.py, test_ckpt.py, ...): they only
    read it or copy steps out of it."""
    run = trained(**BLOOM_RUN)
    assert (run.save / "latest").read_text() == "global_step20"
    return run.out


BASELINE_RUN = dict(train_samples=640)
"""TP=1 PP=1 DP=1, dropout 0, 80 iterations, checkpoints every 20: test_train.py's baseline, what the other layouts
are held to."""

TP2_RUN = dict(BASELINE_RUN, tensor_model_parallel_size=2, exit_interval=20, save_interval=10)
"""TP=2 (2 processes), dropout 0, 20 iterations, checkpoints at 10 and 20: test_train.py's TP=2 run."""

TP2_PP2_BF16_RUN = dict(TP2_RUN, exit_interval=10, sequence_parallel=True, pipeline_model_parallel_size=2,
                        checkpoint_activations=True, bf16=True, zero_stage=0)
"""TP=2 x PP=2 (4 processes) in tr11's setting (bf16, ZeRO-0, full recompute) with sequence parallelism, 10
iterations, a checkpoint at 10: test_train.py's sequence-parallel pipeline run."""


def plant_redundant_optimizer_copy(step: Path) -> list[dict]:
    """Make ``step`` (a bf16 ZeRO-0 step, DP=1) what DeepSpeed 0.18.5-0.19.8 wrote before
    ``ds_compat.save_bf16_zero0_optimizer_once``: each ``mp_rank_XX_model_states.pt`` holds its shard's
    ``optimizer_state_dict`` as ``optimizer`` (DeepSpeed objects in the pickle), no ``param_shapes``. Changes the
    files in place; returns the planted state dicts, one per model-parallel rank."""
    import torch

    planted = []
    for path in sorted(step.glob("mp_rank_*_model_states.pt")):
        mp = path.name.split("_")[2]
        shard = torch.load(step / f"bf16_zero_pp_rank_0_mp_rank_{mp}_optim_states.pt", weights_only=False)
        state = torch.load(path, weights_only=False)
        state.update(optimizer=shard["optimizer_state_dict"], param_shapes=None, shared_params=None)
        torch.save(state, path)
        planted.append(shard["optimizer_state_dict"])
    return planted


@pytest.fixture(scope="session")
def tp2_run(trained) -> Path:
    """:data:`TP2_RUN`'s run folder (test_ckpt.py checks its checkpoints; read only)."""
    return trained(2, **TP2_RUN).out


@pytest.fixture(scope="session")
def tp2_pp2_bf16_run(trained) -> Path:
    """:data:`TP2_PP2_BF16_RUN`'s run folder (test_ckpt.py checks its checkpoints; read only)."""
    return trained(4, **TP2_PP2_BF16_RUN).out


@pytest.fixture(scope="session")
def gpt_pp2_run(trained) -> Path:
    """A GPT-style run (absolute position embeddings, no embedding LayerNorm) at PP=2 (torchrun, 2 processes),
    2 iterations, a checkpoint after each; the run folder."""
    return trained(2, train_samples=16, save_interval=1, log_interval=1, position_embedding_type="absolute",
                   embed_layernorm=None, pipeline_model_parallel_size=2).out


@pytest.fixture(scope="session")
def slurm():
    """A running single-node SLURM (scripts/local-slurm.sh start; needs root, as in CI)."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM needs root")
    with FileLock("/tmp/opskit-local-slurm-start.lock"):  # xdist workers: one start at a time (it is idempotent)
        done = subprocess.run([str(REPO / "scripts" / "local-slurm.sh"), "start"], capture_output=True, text=True,
                              timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return True


LOCAL_SLURM = REPO / "scripts" / "local-slurm.sh"


@dataclass
class SlurmCluster:
    """A multi-node SLURM started by ``scripts/local-slurm.sh start --nodes N`` in a state dir of its own.

    ``env`` is ``os.environ`` plus ``SLURM_CONF``: pass it to every SLURM client (sbatch, sinfo, ...) meant for this
    cluster; the test process's own environment keeps pointing at the shared single-node cluster."""

    state_dir: Path
    nodes: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    def script(self, action: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``local-slurm.sh ACTION --nodes N`` on this cluster's state dir."""
        return subprocess.run([str(LOCAL_SLURM), action, "--nodes", str(len(self.nodes))], capture_output=True,
                              text=True, timeout=timeout, env=self.env)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A command (a SLURM client) against this cluster."""
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env)

    def sbatch(self, *args: str, wrap: str) -> str:
        """``sbatch --parsable ARGS --wrap WRAP`` -> job id."""
        done = self.run("sbatch", "--parsable", "--time=5", *args, "--wrap", wrap)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def wait_job(self, job_id: str, timeout: float = 120) -> str:
        """Poll squeue until the job has ended; its final state (COMPLETED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").stdout.strip()
            if state and state not in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}:
                return state
            time.sleep(0.3)
        pytest.fail(f"job {job_id} did not end within {timeout}s", pytrace=False)

    def node_states(self) -> dict[str, str]:
        """``{node: sinfo state}``, e.g. ``{"node1": "idle", "node3": "down*"}``."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def slurmd_pid(self, node: str) -> int | None:
        """The pid in the node's slurmd pid file (the script names it slurmd-<node>.pid), or None."""
        try:
            return int((self.state_dir / f"slurmd-{node}.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None


def multinode_unavailable() -> str | None:
    """Why this machine cannot run a multi-node local SLURM, or None."""
    if os.geteuid() != 0:
        return "a multi-node local SLURM needs root (network namespaces, daemons)"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is missing: apt-get install -y {package}"
    if shutil.which("slurmctld", path="/usr/sbin:" + os.environ.get("PATH", "")) is None \
            and shutil.which("apt-get") is None:
        return "SLURM is missing and apt-get cannot install it: apt-get install -y slurm-wlm munge"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """``slurm_cluster(nodes=3, name="main")`` -> a running :class:`SlurmCluster` of ``nodes`` nodes (node1..nodeN).

    One cluster per (nodes, name) a session, each in its own state dir under /tmp, beside the shared single-node
    cluster (own ports, munged, ClusterName); each call re-runs the idempotent ``start``, so a node whose slurmd a
    test killed is back. Every cluster is stopped (processes, namespaces, links) and its dir removed at session end,
    whatever the tests did. Skips, saying why, without root/iproute2/util-linux/SLURM; fails instead under CI."""
    reason = multinode_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    clusters: dict[tuple[int, str], SlurmCluster] = {}

    def start(nodes: int = 3, name: str = "main") -> SlurmCluster:
        cluster = clusters.get((nodes, name))
        if cluster is None:
            state_dir = Path(tempfile.mkdtemp(prefix=f"opskit-slurm-{name}{nodes}-", dir="/tmp"))
            env = dict(os.environ, OPSKIT_SLURM_DIR=str(state_dir), SLURM_CONF=str(state_dir / "slurm.conf"))
            cluster = clusters[(nodes, name)] = SlurmCluster(state_dir, [f"node{i}" for i in range(1, nodes + 1)], env)
        done = cluster.script("start", timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return cluster

    yield start
    failures = []
    for cluster in clusters.values():  # every one, even after a failed stop
        done = cluster.script("stop")
        if done.returncode != 0:
            failures.append(f"stop of {cluster.state_dir}: {done.stdout}{done.stderr}")
        else:
            shutil.rmtree(cluster.state_dir, ignore_errors=True)
    assert not failures, failures


@pytest.fixture
def cluster(slurm_cluster, monkeypatch):
    """The 3-node cluster (tests/test_multinode_failures.py, test_multinode_divergence.py), made the SLURM of this test
    process (opskit's library calls sbatch/squeue here)."""
    c = slurm_cluster(3)
    monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])
    jobs: list[str] = []
    c.jobs = jobs
    yield c
    if jobs:
        c.run("scancel", *jobs)
    done = c.script("start")  # a node a test took down serves again for the next test
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def jobs(slurm, tmp_path):
    """``submit(name, *sbatch_args, wrap=...)`` -> job id; every job is cancelled at the end of the test."""
    submitted: list[str] = []

    def submit(name: str, *args: str, wrap: str = "sleep 120") -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", "--time=3", f"--chdir={tmp_path}", "-o", "/dev/null",
             *args, "--wrap", wrap], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip().split(";")[0]
        submitted.append(job_id)
        return job_id

    yield submit
    if submitted:
        subprocess.run(["scancel", *submitted], capture_output=True, timeout=30)


def as_run(run_dir: Path) -> str:
    """The sbatch option that makes a test job one of the jobs of the run in ``run_dir`` (opskit's ``--comment``)."""
    from opskit.run.chain import job_comment
    from opskit.run.paths import RunPaths

    return f"--comment={job_comment(RunPaths(Path(run_dir).resolve()))}"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def queued(job_name: str, predicate, timeout: float = 90) -> list[client.QueueEntry]:
    """Poll squeue until ``predicate(entries of job_name)`` holds (a busy node may keep jobs pending a while)."""
    deadline = time.monotonic() + timeout
    while True:
        entries = [e for e in client.squeue() if e.name == job_name]
        if predicate(entries):
            return entries
        if time.monotonic() > deadline:
            pytest.fail(f"{job_name}: squeue never reached the expected state: {entries}")
        time.sleep(0.3)


def running(entries) -> bool:
    return any(e.state == "RUNNING" for e in entries)


@pytest.fixture
def cancel_after(slurm):
    """Job ids appended here are scancel-ed when the test ends, whatever happened."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


def write_spec(path: Path, prepared, output: Path, /, **sections) -> Path:
    """The tiny preset as a YAML file at ``path``: data from ``prepared`` (a PreparedData, e.g. ``kjv_data``), run
    directory ``output``, and ``sections`` merged in per key (``batch={"train_samples": 64}``; ``None`` drops a key,
    a non-dict value replaces a top-level key)."""
    import yaml

    raw = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
    raw["data"].update(dir=str(Path(prepared.data_prefix).parent), name="kjv", vocab_size=2000)
    raw["paths"]["output"] = str(output)
    for section, values in sections.items():
        if not isinstance(values, dict):
            raw[section] = values
            continue
        for key, value in values.items():
            raw.setdefault(section, {})[key] = value
            if value is None:
                del raw[section][key]
    if raw.get("name") is None:
        raw.pop("name", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def alive(pid: int) -> bool:
    """True while PID exists and is not a zombie: PID 1 here reaps slowly, so `kill -0` succeeds on zombies."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
