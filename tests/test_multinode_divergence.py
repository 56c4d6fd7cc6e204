"""Divergence on the real 3-node SLURM (issue 48): 2-node chains of the tiny model with one spare node, the fault
hook (OPSKIT_TEST_FAULT) in the job's environment: bad data that a replay reproduces, a NaN on one node's rank once,
one flipped bit in one replica's parameters. Each run's losses after the incident are compared with an uninterrupted
run of the same flags and layout (torchrun on this host, the rendered trainer flags). Durations are printed."""

from __future__ import annotations

import random
import re
import shutil
import time

import pytest
from conftest import REPO, run_trainer, write_spec
from test_divergence import losses
from test_multinode_failures import MODEL, queue, wait_for

from opskit.run import chain
from opskit.run.incidents import read_incidents
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.submission.render import trainer_args
from opskit.submission.submit import submit

pytestmark = pytest.mark.slurm

DIVERGENCE = {"spike_window": 10, "divergence": {"patience": 3, "digest_interval": 5}}


def chain_run(cluster, tmp_path, kjv_data, fault: str, gpus_per_node: int = 1, zero_stage: int = 1,
              divergence: dict | None = None, iterations: int = 40):
    """A 2-node chain of 40 iterations (GBS 8) with one spare node, dropout on, a step every 5, the fault in the job's
    environment (as :func:`test_multinode_failures.node_spec`), no pre-flight (on a loaded host it can keep the fault's
    node out as slow: the likely cause of fresh-ci seed 131's run that finished with no NaN); submitted and waited for
    until it drained: (spec, run, seconds)."""
    dp = 2 * gpus_per_node
    path = write_spec(tmp_path / "spec.yaml", kjv_data, tmp_path / "run",
                      model={**MODEL, "hidden_dropout": 0.1, "attention_dropout": 0.1},
                      parallel={"nodes": 2, "gpus_per_node": gpus_per_node, "zero_stage": zero_stage},
                      batch={"micro_batch_size": 8 // dp, "global_batch_size": 8, "train_samples": iterations * 8},
                      optimizer={"lr_warmup_samples": 32}, checkpoint={"save_interval": 5, "log_interval": 1},
                      slurm={"job_name": f"mnd-{tmp_path.name[-12:]}", "cpus_per_task": 1, "array": 2,
                             "max_failures": 3, "time": "10", "master_port": random.randint(20000, 29000),
                             "spare_nodes": 1, "preflight": False,  # a loaded host's slow node2 would dodge its fault
                             "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OPSKIT_TEST_FAULT": fault}},
                      watchdog={**DIVERGENCE, "divergence": {**DIVERGENCE["divergence"], **(divergence or {})}})
    spec = load_spec(str(path))
    started = time.monotonic()
    sub = submit(spec)
    cluster.jobs.append(sub.job_id)
    wait_for(lambda: sub.run.finished_flag.exists() or sub.run.stopped_flag.exists(), 300, "the chain never ended",
             evidence=lambda: sub.run.main_log.read_text()[-3000:])
    wait_for(lambda: not queue(cluster, sub.job_id), 120, "the chain never drained")
    return spec, sub.run, time.monotonic() - started


def uninterrupted(spec, run: RunPaths, tmp_path, nproc: int) -> dict[int, str]:
    """The losses of ``run``'s flags and DeepSpeed config trained without a fault, ``nproc`` ranks under torchrun on
    this host."""
    other = RunPaths(tmp_path / "uninterrupted")
    other.slurm_dir.mkdir(parents=True)
    shutil.copy(run.ds_config, other.ds_config)
    done = run_trainer([str(a) for a in trainer_args(spec, other)], nproc=nproc)
    assert done.returncode == 0, done.stderr[-2000:]
    return losses(done.stdout)


def after_last_step(run: RunPaths) -> str:
    """main_log.txt from the last ``training step N`` line on."""
    text = run.main_log.read_text()
    return text[text.rindex("training step "):]


def test_bad_data_on_a_2_node_chain_is_replayed_rolled_back_and_skipped(cluster, kjv_data, tmp_path):
    spec, run, seconds = chain_run(cluster, tmp_path, kjv_data, "poison:*:iteration=25:count=4")
    assert run.finished_flag.exists(), run.main_log.read_text()[-3000:]
    (incident,) = read_incidents(run)
    assert (incident["verdict"], incident["first"], incident["rollback_step"], incident["skip_range"]) == (
        "reproduced", 25, 20, [21, 28]), incident
    assert incident["replay_value"] == incident["value"]  # the replay on two nodes is exact too
    assert chain.read_bad_nodes(run) == {}
    assert [(r.state, r.nodes) for r in chain.read_ledger(run)][:1] == [("COMPLETED", "node[1-3]")]
    print(f"\nbad data: detected, replayed, skipped and finished in {seconds:.0f} s")


def test_a_nan_on_one_node_once_is_transient_that_node_is_struck_and_nothing_is_skipped(cluster, kjv_data, tmp_path):
    spec, run, seconds = chain_run(cluster, tmp_path, kjv_data, "nan:node2:iteration=25:task=1")
    assert run.finished_flag.exists(), run.main_log.read_text()[-3000:]
    (incident,) = read_incidents(run)
    assert (incident["verdict"], incident["struck"], incident["skip_range"]) == ("transient", ["node2"], None)
    assert "strike: transient" in chain.read_bad_nodes(run)["node2"]
    final = losses(after_last_step(run))
    assert final == {i: v for i, v in uninterrupted(spec, run, tmp_path, 2).items() if i in final} and 40 in final
    print(f"\nNaN on node2: replayed, judged transient, finished in {seconds:.0f} s")


def test_a_flipped_bit_in_one_replica_names_its_node_and_the_run_resumes_on_the_spare(cluster, kjv_data, tmp_path):
    # DP=4 over 2 nodes: node2's local rank 1 flips a bit after iteration 12; the digests of 15 name it
    spec, run, seconds = chain_run(cluster, tmp_path, kjv_data, "flip:node2:iteration=12:local_rank=1:task=1",
                                   gpus_per_node=2, zero_stage=0)
    assert run.finished_flag.exists(), run.main_log.read_text()[-3000:]
    (incident,) = read_incidents(run)
    assert (incident["verdict"], incident["kind"], incident["first"], incident["struck"],
            incident["rollback_step"]) == ("corrupted", "digest", 15, ["node2"], 10), incident
    text = run.main_log.read_text()
    assert re.search(r"parameters differ after iteration 15 \(replica\(s\) [0-9] of 4\)", text)
    assert "training step 1 on nodes node1,node3" in text and list(chain.read_bad_nodes(run)) == ["node2"]
    final = losses(after_last_step(run))
    assert final == {i: v for i, v in uninterrupted(spec, run, tmp_path, 4).items() if i in final} and 11 in final
    print(f"\nbit flip on node2: named, kept out, resumed on node3, finished in {seconds:.0f} s")


def test_bad_data_that_comes_back_after_each_rollback_holds_the_chain_with_one_alert(cluster, kjv_data, tmp_path):
    # all data from iteration 61 on is bad: the first incident is rolled back and skipped, the second one is past the
    # bound of one rollback
    spec, run, seconds = chain_run(cluster, tmp_path, kjv_data, "poison:*:iteration=61:count=100",
                                   divergence={"max_rollbacks": 1}, iterations=80)
    assert run.stopped_flag.exists() and not run.finished_flag.exists()
    assert [i["verdict"] for i in read_incidents(run)] == ["reproduced", "held"]
    flag = run.stopped_flag.read_text()
    assert "[divergence.held]" in flag and flag.count("***ALERT") == 1
    rows = chain.read_ledger(run)
    assert [r.state for r in rows] == ["ALERT", "FAILED", "SKIPPED"], rows  # the chain's second task did not train
    print(f"\nbad data that comes back: held after one rollback, in {seconds:.0f} s")
