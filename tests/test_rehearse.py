"""opskit rehearse: every bundled preset and variant, scaled down, green through the real local SLURM (two tasks: the
first stopped by the spec's own exit duration on the trainer's simulated clock, the second resuming and finishing;
their uninterrupted twin, whose losses the resumed ones equal as printed; then ckpt check, ckpt convert with
verification, status, logs show); a spec the trainer refuses at start is red with the trainer's reason and leaves
nothing queued. The scaling rules themselves are checked without SLURM."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import write_spec

from opskit.fsutil import OutputRefusedError, write_marker
from opskit.rehearse import (
    Rehearsal,
    Shape,
    Stage,
    _run_chain,
    claim_folder,
    compare_with_twin,
    fit_layout,
    minutes_per_iteration,
    plan_data,
    rehearsal_folder,
    rehearsal_spec,
    rehearse,
    scale_schedule,
    seal_folder,
)
from opskit.rules.schedule import BatchRampup
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.spec.load import load_spec

STAGES = ["spec scaled down", "data", "submit", "task 1: exit duration", "task 2: resume", "exact resume",
          "ckpt check", "ckpt convert", "status", "logs show"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One rehearsal root for the module: the demo data under .data/ is prepared once and shared."""
    return tmp_path_factory.mktemp("rehearsals")


def queued(job_id: str) -> list:
    return [e for e in client.squeue() if e.array_id == job_id]


def assert_green(result, converts: bool = True) -> None:
    """Every stage green; ``converts`` False: a model transformers has no class for, whose conversion is skipped
    with the converter's reason (absolute positions with an embedding LayerNorm)."""
    assert [s.name for s in result.stages] == STAGES
    expected = {"ckpt convert": "ok" if converts else "skipped"}
    assert result.ok and all(s.status == expected.get(s.name, "ok") for s in result.stages), [
        (s.name, s.status, s.reason) for s in result.stages]
    stages = {s.name: s.reason for s in result.stages}
    assert "checkpoint at iteration 21" in stages["task 1: exit duration"]
    assert stages["task 2: resume"].startswith("resumed at iteration 21; training finished at iteration 40")
    assert re.fullmatch(r"lm loss of iterations 22-40 and \d+ validation loss(es)? equal the uninterrupted twin's as "
                        r"printed \(iterations 1-21 too\); twin: job \d+ in twin/", stages["exact resume"]), stages[
        "exact resume"]
    assert ("logits verified" if converts else "no transformers model for it: position_embedding_type absolute "
            "with embedding LayerNorm True") in stages["ckpt convert"]
    assert stages["logs show"].startswith("iteration 40/40, lm loss")
    assert not queued(result.job_id) and not queued(result.twin_job_id)


# --------------------------------------------------------------------------- end to end on the local SLURM


def test_tiny_rehearses_green(slurm, root):
    result = rehearse(load_spec("tiny"), root=root)
    assert_green(result)
    said = result.substitutions
    assert "model.num_layers 4 -> 2" in said
    assert "batch.train_samples 8000 -> 160" in said  # 40 iterations of GBS 4
    assert any(s.startswith("exit duration 2 min (3 - 1 min) kept; simulated clock") for s in said)
    assert result.plan["parameters"] == 1_825_792  # the planner's numbers are the full-size spec's
    assert (result.folder / ".opskit").is_file() and (result.folder / "spec.yaml").is_file()


def test_tr11_rehearses_green_with_its_substitutions_said(slurm, root):
    result = rehearse(load_spec("tr11-176B-ml"), root=root)
    assert_green(result)
    said = result.substitutions
    for expected in (
        "parallel.tensor_model_parallel_size 4 -> 2 (TP*PP 48 > 4 ranks; the larger one reduced first)",
        "parallel.pipeline_model_parallel_size 12 -> 2 (TP*PP 48 > 4 ranks; the larger one reduced first)",
        "model.num_layers 70 -> 4",
        "model.pad_vocab_size_to 250,880 -> unset (the rehearsal vocabulary 1024 padded by the same rule, 128 x TP "
        "2: 1024)",
        "megatron_args.distributed_backend nccl -> gloo (NCCL needs GPUs)",
        "slurm.env.TRANSFORMERS_CACHE dropped ($six_ALL_CCFRWORK is not set here)",
        "batch.rampup_batch_size [192, 16, 9,765,625] -> [2, 2, 8]",
    ):
        assert expected in said, said
    assert any(s.startswith("exit duration 5990 min (100:00:00 - 10 min) kept; simulated clock: 1 iteration = "
                            "292.195 min") for s in said), said
    # BLOOM's bf16 with ZeRO-0 is rehearsed as it is, not substituted
    assert result.stages[0].reason.endswith("TP=2 PP=2 DP=1, bf16, ZeRO-0")
    assert not any(s.startswith("model.precision") for s in said)
    assert result.plan["layout"] == "48 nodes x 8 GPUs: TP=4 PP=12 DP=8"


def _bnb_runs() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.parametrize("name", ["tr1-13B", "tr8-104B", "tr8b-104B", "tr8b-104B:cl", "tr8b-104B:emb-norm",
                                  "tr8b-104B:bnb", "tr11-176B-ml:24n"])
def test_every_preset_and_variant_rehearses_green(slurm, root, name):
    if name.endswith(":bnb") and not _bnb_runs():
        pytest.skip("bitsandbytes is not installed: the bnb variant cannot rehearse here")
    result = rehearse(load_spec(name), root=root)
    assert_green(result, converts=name not in ("tr8b-104B:cl", "tr8b-104B:emb-norm", "tr8b-104B:bnb"))
    if name.startswith("tr1-") or name.startswith("tr8"):
        assert any(s.startswith("model.precision fp16 -> bf16 (DeepSpeed's CPU accelerator has no fp16")
                   for s in result.substitutions)


def test_a_spec_the_trainer_refuses_is_red_with_its_reason_and_nothing_queued(slurm, root, tmp_path):
    # seed 0 passes the spec (any int) but Megatron's seeding refuses it at start, on every rank
    raw = yaml.safe_load(Path(load_spec("tiny").file).read_text())
    raw["checkpoint"]["seed"] = 0
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = rehearse(load_spec(str(path)), root=root)
    assert not result.ok
    stages = {s.name: (s.status, s.reason) for s in result.stages}
    assert stages["submit"][0] == "ok"
    assert stages["task 1: exit duration"] == ("failed", "--seed 0: expected a positive integer below 4294967296 "
                                                         "(stage s is seeded with seed + 100 * s)")
    assert all(stages[name][0] == "skipped" for name in STAGES[4:])
    assert stages["exact resume"] == ("skipped", "task 1: exit duration failed") and result.twin_job_id is None
    assert not queued(result.job_id)


def test_cli_exit_codes_and_refusals(root, tmp_path):
    opskit = str(Path(sys.executable).with_name("opskit"))
    done = subprocess.run([opskit, "rehearse", "no-such-spec"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: no spec named 'no-such-spec'")
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "mine.txt").write_text("the user's")
    done = subprocess.run([opskit, "rehearse", "tiny", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "was written by someone else, not `opskit rehearse`" in done.stderr
    assert (folder / "mine.txt").read_text() == "the user's"


def test_a_job_that_can_never_start_is_red_at_once_with_the_reason_and_cancelled(tmp_path, monkeypatch):
    # A fake queue: the job pends on PartitionConfig (it asks more CPUs than the node has), which never clears.
    fake_data = SimpleNamespace(data_prefix=tmp_path / "data" / "kjv_text_document")
    spec = load_spec(str(write_spec(tmp_path / "pf.yaml", fake_data, tmp_path / "run",
                                    slurm={"job_name": "rehearse-pf"})))
    queue = [client.QueueEntry("77_[1-2%1]", "debug", "rehearse-pf", "PENDING", "0:00", "1", "N/A",
                               "(PartitionConfig)")]
    cancelled = []
    monkeypatch.setattr("opskit.rehearse.submit", lambda *a, **k: SimpleNamespace(job_id="77", run=RunPaths.of(spec)))
    monkeypatch.setattr("opskit.slurm.client.squeue", lambda *a, **k: list(queue))
    monkeypatch.setattr("opskit.slurm.client.scancel", lambda ids: (cancelled.extend(ids), queue.clear()))
    monkeypatch.setattr("opskit.slurm.pending.GRACE_S", 1.0)
    result = Rehearsal(spec.name, tmp_path)
    started = time.monotonic()
    _run_chain(spec, spec, result, lambda *stage: result.stages.append(Stage(*stage)), 40, wait_s=900)
    assert time.monotonic() - started < 15  # not the 900 s wait
    stages = {s.name: (s.status, s.reason) for s in result.stages}
    status, reason = stages["task 1: exit duration"]
    assert status == "failed" and reason.startswith("job 77_[1-2%1] never starts: PartitionConfig: the job asks "
                                                    "more than its partition allows or its nodes have")
    assert reason.endswith("or pick another slurm.partition, then rehearse again (cancelled)"), reason
    assert stages["task 2: resume"] == ("skipped", "task 1 failed") and cancelled == ["77"]
    assert all(stages[name][0] == "skipped" for name in STAGES[5:])


# --------------------------------------------------------------------------- the exact-resume comparison


def _iteration(n: int, loss: str) -> str:
    return (f"0: [default3]: iteration {n:8d}/      40 | consumed samples: {8 * n:12d} | lm loss: {loss} | "
            "grad norm: 0.595 |")


def _validation(where: str, loss: str, name: str = "valid") -> str:
    return f"0: [default3]: {name} loss at {where} | lm loss value: {loss} | lm loss PPL: 1.019606E+03 | "


def _log(losses: dict[int, str], validations: dict[str, str] | None = None) -> str:
    lines = [_iteration(n, loss) for n, loss in losses.items()]
    lines += [_validation(where, loss) for where, loss in (validations or {}).items()]
    return "\n".join(lines) + "\n"


LOSSES = {n: f"{7 - n / 100:.6E}" for n in range(1, 41)}


def test_exact_resume_is_green_only_when_every_printed_loss_after_the_resume_equals_the_twins():
    first = _log({n: v for n, v in LOSSES.items() if n <= 21}, {"iteration 13": "6.927172E+00"})
    second = _log({n: v for n, v in LOSSES.items() if n > 21}, {"iteration 26": "6.926248E+00",
                                                               "the end of training for val data": "6.925E+00"})
    twin = _log(LOSSES, {"iteration 13": "6.927172E+00", "iteration 26": "6.926248E+00",
                         "the end of training for val data": "6.925E+00"})
    assert compare_with_twin(first, second, twin, 21) == (
        "ok", "lm loss of iterations 22-40 and 2 validation losses equal the uninterrupted twin's as printed "
              "(iterations 1-21 too)")
    # the first iteration where they part, with both values as printed
    parted = twin.replace(_iteration(27, LOSSES[27]), _iteration(27, "4.512344E+00")).replace(
        _iteration(30, LOSSES[30]), _iteration(30, "1.0E+00"))
    resumed = second.replace(_iteration(27, LOSSES[27]), _iteration(27, "4.512345E+00"))
    assert compare_with_twin(first, resumed, parted, 21) == (
        "failed", "losses part at iteration 27: 4.512345E+00 resumed, 4.512344E+00 uninterrupted")
    # a validation loss (the training losses equal), and one printed by one side only
    assert compare_with_twin(first, second, twin.replace("6.926248E+00", "6.926249E+00"), 21) == (
        "failed", "valid losses part at iteration 26: 6.926248E+00 resumed, 6.926249E+00 uninterrupted")
    assert compare_with_twin(first, second, twin.replace(_iteration(40, LOSSES[40]) + "\n", ""), 21) == (
        "failed", f"losses part at iteration 40: {LOSSES[40]} resumed, not printed uninterrupted")
    # parting before the resume: the training itself does not repeat
    status, reason = compare_with_twin(first.replace(LOSSES[3], "1.0E+00"), second, twin, 21)
    assert status == "failed" and reason.startswith("losses part at iteration 3, before the resume at iteration 21: "
                                                    "1.000000E+00 task 1, ")
    assert compare_with_twin(first, "", twin, 21) == (
        "failed", "task 2 printed no iteration line after the resume at iteration 21")


# --------------------------------------------------------------------------- the scaling rules


def test_fit_layout_reduces_the_larger_first_and_keeps_what_fits():
    assert fit_layout(4, 12, 4) == (2, 2)  # BLOOM-176B: both TP and PP still exercised
    assert fit_layout(2, 4, 4) == (2, 2)
    assert fit_layout(1, 1, 4) == (1, 1)
    assert fit_layout(2, 2, 8) == (2, 2)
    assert fit_layout(8, 1, 4) == (4, 1)


@pytest.mark.parametrize("name", ["tr11-176B-ml", "tr1-13B", "tr8b-104B:cl", "tiny"])
def test_the_schedule_is_k_iterations_by_the_ramp_up_walk(name, tmp_path):
    spec = load_spec(name)
    small, _ = rehearsal_spec(spec, tmp_path / "r", plan_data(spec, tmp_path / ".data"), iterations=40)
    b = small.batch
    ramp = BatchRampup(b.global_batch_size, b.rampup_batch_size)
    assert ramp.train_iters(b.train_samples) == 40
    if spec.batch.rampup_batch_size:
        assert len({size for size, _ in ramp.rampup_steps()}) >= 2  # the ramp-up keeps stages
    assert b.global_batch_size // (b.micro_batch_size * small.parallel.data_parallel_size) >= 2


def test_skip_ranges_keep_their_places_and_stay_apart(tmp_path):
    spec = load_spec("tr8b-104B:emb-norm")
    shape = Shape(1, 4, 2, 2, 40, 64, 1024)
    overrides, said = scale_schedule(spec, shape)
    assert overrides["megatron_args"]["skip_train_iteration_range"] == ["3-4", "6-6"]


def test_simulated_clock_stops_task_1_after_half_and_lets_task_2_finish():
    step = minutes_per_iteration(5990, 40)
    assert 20 * step <= 5990 < 21 * step  # task 1: the minutes pass the exit duration at its 21st iteration
    assert 19 * step <= 5990  # task 2 trains the 19 left


def test_trainer_reads_the_simulated_clock():
    from opskit.train import REHEARSAL_CLOCK_ENV
    from opskit.train.config import TrainerError, rehearsal_minutes_per_iteration
    from opskit.train.exit import minutes_since_start

    per_iteration = rehearsal_minutes_per_iteration({REHEARSAL_CLOCK_ENV: "292.5"})
    assert minutes_since_start(0.0, 21, per_iteration) == 21 * 292.5
    with pytest.raises(TrainerError, match="expected a positive number of minutes"):
        rehearsal_minutes_per_iteration({REHEARSAL_CLOCK_ENV: "soon"})
    assert rehearsal_minutes_per_iteration({}) is None
    assert 0 < minutes_since_start(time.time() - 60, 1000, None) < 2  # wall time again


def test_folder_is_claimed_only_when_the_rehearsal_wrote_it(tmp_path):
    spec = load_spec("tiny")
    folder = rehearsal_folder(spec, tmp_path)
    assert folder == tmp_path.absolute() / "tiny"
    claim_folder(spec, folder, force=False)
    (folder / "run" / "logs").mkdir(parents=True)
    (folder / "run" / "logs" / "main_log.txt").write_text("x")
    with pytest.raises(OutputRefusedError, match="killed before it listed its files"):
        claim_folder(spec, folder, force=True)  # a killed rehearsal: its files cannot be told from the user's
    seal_folder(folder)
    with pytest.raises(OutputRefusedError, match="an earlier rehearsal; --force replaces it"):
        claim_folder(spec, folder, force=False)
    # The user's notes beside an ended rehearsal: --force refuses, naming them, and deletes nothing.
    (folder / "NOTES.md").write_text("mine")
    (folder / "analysis").mkdir()
    (folder / "analysis" / "a.txt").write_text("mine")
    (folder / "run" / "mine.txt").write_text("mine")
    with pytest.raises(OutputRefusedError, match=r"did not write \(NOTES.md, analysis, run/mine.txt\); --force "
                                                 "would delete them"):
        claim_folder(spec, folder, force=True)
    assert (folder / "NOTES.md").read_text() == (folder / "run" / "mine.txt").read_text() == "mine"
    for mine in ("NOTES.md", "analysis/a.txt", "run/mine.txt"):
        (folder / mine).unlink()
    (folder / "analysis").rmdir()
    claim_folder(spec, folder, force=True)
    assert not (folder / "run").exists()
    write_marker(folder, "submit")
    (folder / "x").write_text("x")
    with pytest.raises(OutputRefusedError, match="written by `opskit submit`, not `opskit rehearse`"):
        claim_folder(spec, folder, force=True)
