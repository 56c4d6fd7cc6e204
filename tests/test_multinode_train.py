"""The training across nodes: ``opskit submit SPEC --nodes 2`` on a real multi-node SLURM (scripts/local-slurm.sh
--nodes 10, the ``slurm_cluster`` fixture), rendering and running the real job script: one torchrun per node through
``srun``, DP=2 and then PP=2 across two nodes, global rank 0 on the allocation's first node (also for node9 and node10,
whose names sort the other way), each node's lines labelled in main_log.txt, the single-node checkpoint layout, a second
array task resuming on the two nodes. Tiny model, CPU, gloo, 1 CPU and 1 OpenMP thread per node."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import run_trainer, write_spec

from opskit.ckpt.check import check_step
from opskit.ckpt.format.info import describe_step
from opskit.logs.parse import read_from
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.submission.render import render_job, trainer_args

pytestmark = pytest.mark.slurm

OPSKIT = str(Path(sys.executable).with_name("opskit"))
GBS = 8
ITERATIONS = 10
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32}
HEADER = re.compile(r"^\[opskit\] \S+ \S+ job (\S+) \(array task (\S+)\) nodes (\S+): (.*)$", re.M)
LABEL = re.compile(r"^(\d+): (.*)$")


def tiny_2n_spec(folder: Path, data, pp: int = 1, array: int = 1, **megatron_args) -> Path:
    """The tiny preset for nodes of one CPU: a ~0.2 M-parameter model, 1 CPU per task, 1 OpenMP thread, GBS 8
    (micro-batch 4: DP=2 needs no accumulation), ``ITERATIONS`` long, a checkpoint every 5 iterations. The spec says
    ``nodes: 1``: the tests give ``--nodes 2`` as the user would."""
    return write_spec(
        folder / "spec.yaml", data, folder / "run", model=MODEL, parallel={"pipeline_model_parallel_size": pp},
        batch={"micro_batch_size": 4, "global_batch_size": GBS, "train_samples": ITERATIONS * GBS},
        optimizer={"lr_warmup_samples": 32}, checkpoint={"save_interval": 5, "log_interval": 1},
        megatron_args=megatron_args,
        slurm={"job_name": f"opskit-mn-{uuid.uuid4().hex[:8]}", "cpus_per_task": 1, "array": array, "time": "5",
               "master_port": random.randint(20000, 29000), "env": {"OMP_NUM_THREADS": "1"}})


def submit_and_wait(cluster, spec: Path, timeout: float = 420) -> subprocess.CompletedProcess:
    """``opskit submit SPEC --nodes 2 --wait`` against the cluster (its ``SLURM_CONF``), until the chain has ended."""
    done = subprocess.run([OPSKIT, "submit", str(spec), "--nodes", "2", "--wait"], capture_output=True, text=True,
                          timeout=timeout, env=cluster.env)
    assert done.returncode == 0 and "has left the queue" in done.stdout, done.stdout + done.stderr
    return done


def labelled(log: str) -> dict[str, list[str]]:
    """srun --label's task id -> the lines it prefixed, unprefixed (the ``[opskit]`` lines are the batch shell's,
    ``srun:`` ones srun's own)."""
    by_task: dict[str, list[str]] = {}
    for line in log.splitlines():
        if line.startswith(("[opskit] ", "srun: ")):
            continue
        label = LABEL.match(line)
        assert label, f"a trainer line without its node's label: {line!r}"
        by_task.setdefault(label.group(1), []).append(label.group(2))
    return by_task


def losses(path: Path) -> dict[int, float]:
    """Iteration -> lm loss, read by opskit's log parser; fails on an iteration logged twice."""
    records = [r for r in read_from(path).records if r["kind"] == "iteration"]
    by_iteration = {r["iteration"]: r["lm_loss"] for r in records}
    assert len(by_iteration) == len(records), "an iteration was logged twice"
    return by_iteration


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    """Ten nodes, so that a job can run on node9 and node10: the allocation's order (node9 first) is not the order of
    their names (node10 < node9), by which torchrun's c10d rendezvous would rank them."""
    return slurm_cluster(10, name="train")


@pytest.fixture(scope="module")
def single_process(kjv_data, tmp_path_factory) -> dict[int, float]:
    """lm loss per iteration of one process (DP=1, PP=1) given the flags the job scripts give (same seed, same global
    batch): what the runs across nodes must reproduce."""
    folder = tmp_path_factory.mktemp("single")
    spec = load_spec(str(tiny_2n_spec(folder, kjv_data)))
    run = RunPaths(folder / "run")
    run.slurm_dir.mkdir(parents=True)
    run.ds_config.write_text(render_job(spec, run).ds_config)
    done = run_trainer(trainer_args(spec, run))
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / "main_log.txt").write_text(done.stdout)
    return losses(folder / "main_log.txt")


@pytest.fixture(scope="module")
def dp2_chain(cluster, kjv_data, tmp_path_factory) -> RunPaths:
    """DP=2 across the two nodes as a 2-task chain: task 1 stops at iteration 5 (``--exit-interval 5``) with a
    checkpoint, task 2 resumes there and finishes at 10."""
    folder = tmp_path_factory.mktemp("dp2")
    submit_and_wait(cluster, tiny_2n_spec(folder, kjv_data, array=2, exit_interval=5))
    return RunPaths(folder / "run")


@pytest.fixture(scope="module")
def pp2_run(cluster, kjv_data, tmp_path_factory) -> RunPaths:
    """PP=2 across node9 and node10 (the run's bad-node list excludes node1..node8), one task, 10 iterations."""
    folder = tmp_path_factory.mktemp("pp2")
    run = RunPaths(folder / "run")
    chain.write_bad_nodes(run, {f"node{i}": "test: leave node9 and node10" for i in range(1, 9)})
    submit_and_wait(cluster, tiny_2n_spec(folder, kjv_data, pp=2))
    return run


def close(a: float, b: float, rel: float = 1e-4) -> bool:
    """tests/test_train.py's tolerance for DP=2 and PP=2 against PP=1 DP=1."""
    return abs(a - b) <= rel * abs(b)


def assert_trains_like_one_process(run: RunPaths, single_process: dict[int, float]) -> None:
    got = losses(run.main_log)
    assert sorted(got) == list(range(1, ITERATIONS + 1)), got
    for iteration, loss in got.items():
        assert close(loss, single_process[iteration]), (iteration, loss, single_process[iteration])


def assert_ranks_in_node_order(run: RunPaths, first: str, second: str) -> dict[str, list[str]]:
    """Label 0 is the allocation's first node and holds global rank 0 (it saves the checkpoints); label 1 is the second
    and holds the last rank (it prints the iteration lines); each labelled line is also in its node's own log. Returns
    the labelled lines."""
    log = run.main_log.read_text()
    by_task = labelled(log)
    assert sorted(by_task) == ["0", "1"], sorted(by_task)
    job_ids = {m.group(1) for m in HEADER.finditer(log)}
    for task, node in (("0", first), ("1", second)):
        own = "".join((run.node_logs / f"{job}-{node}.log").read_text() for job in sorted(job_ids))
        assert all(line in own for line in by_task[task]), f"{node}'s log lacks lines labelled {task}"
    assert any("successfully saved checkpoint" in line for line in by_task["0"])
    assert not any("successfully saved checkpoint" in line for line in by_task["1"])
    assert not any(" iteration " in line and "lm loss" in line for line in by_task["0"])
    return by_task


def test_dp2_chain_across_two_nodes_trains_like_one_process(dp2_chain, single_process):
    assert_trains_like_one_process(dp2_chain, single_process)
    assert [(r.state, r.nodes) for r in chain.read_ledger(dp2_chain)] == [("COMPLETED", "node[1-2]")] * 2


def test_dp2_second_task_resumes_on_the_two_nodes(dp2_chain):
    log = dp2_chain.main_log.read_text()
    starts = [m for m in HEADER.finditer(log) if m.group(4) == "start"]
    assert len(starts) == 2 and {m.group(3) for m in starts} == {"node[1-2]"}, log[-3000:]
    first, second = log[starts[0].start():starts[1].start()], log[starts[1].start():]
    assert "[exiting program at iteration 5]" in first
    assert re.search(r"^0: \[default0\]:  successfully loaded checkpoint from .* at iteration 5$", second, re.M)
    resumed = [int(m.group(1)) for m in re.finditer(r"^1: \[default0\]: iteration +(\d+)/", second, re.M)]
    assert resumed == list(range(6, ITERATIONS + 1)), second[-3000:]


def test_dp2_main_log_labels_each_nodes_lines_in_node_order(dp2_chain):
    assert_ranks_in_node_order(dp2_chain, "node1", "node2")


def test_dp2_checkpoints_have_the_single_node_layout(dp2_chain):
    for step in ("global_step5", "global_step10"):
        info = describe_step(dp2_chain.checkpoints / step)
        assert info.complete and (info.tp, info.pp, info.dp) == (1, 1, 2), info.problems
        assert {p.name for p in info.files} == {
            "layer_01-model_00-model_states.pt", "layer_03-model_00-model_states.pt",
            "layer_04-model_00-model_states.pt", "layer_06-model_00-model_states.pt", "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
        report = check_step(dp2_chain.checkpoints / step)
        assert report.ok, json.dumps(report.as_json())[:3000]
    assert (dp2_chain.checkpoints / "latest").read_text() == "global_step10"


def test_pp2_across_two_nodes_trains_like_one_process_stage0_on_the_first_node(pp2_run, single_process):
    assert_trains_like_one_process(pp2_run, single_process)
    assert [(r.state, r.nodes) for r in chain.read_ledger(pp2_run)] == [("COMPLETED", "node[9-10]")]
    by_task = assert_ranks_in_node_order(pp2_run, "node9", "node10")
    # Rank 0 (node1) prints the partition: it is stage 0, with the embedding and the first block.
    assert "Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0, ProcessCoord(pipe=1, data=0, model=0): 1}" \
        in "\n".join(by_task["0"])
    info = describe_step(pp2_run.checkpoints / "global_step10")
    assert info.complete and (info.tp, info.pp, info.dp) == (1, 2, 1), info.problems
    assert check_step(info.path).ok
