"""One copy of the optimizer state per checkpoint step, and ``opskit plan``'s bytes of a step (issue 46, section 2).

DeepSpeed 0.18.5-0.19.8 saved bf16 + ZeRO-0's optimizer states twice: in the ``bf16_zero_pp_rank_*`` shards and again
in each ``mp_rank_XX_model_states.pt`` (opskit.train.ds_compat.save_bf16_zero0_optimizer_once). The trainer now
writes Megatron-DeepSpeed's layout (BLOOM's checkpoints: model-states files without the optimizer); steps saved with
the extra copy still resume exactly and convert, and ``ckpt check`` reports the copy with its bytes.

Each precision setting trains the tiny preset (scaled to 4 iterations) from a spec through the rendered command line,
so that the plan and the trainer read the same model. fp16: DeepSpeed's CPU accelerator has no fp16 on these CPUs
and the trainer refuses it in one line (test_train.py::test_fp16_without_accelerator_support_is_a_one_line_error);
here a patch tells DeepSpeed's accelerator that it has fp16 (torch computes fp16 on any CPU, slowly), so that
DeepSpeed's fp16 optimizers write their real files. The one-process settings train one after the other in one
process (conftest's run_trainer_cases), patched first; torchrun cannot run it, so fp16 is tried in one process only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import plant_redundant_optimizer_copy, run_trainer, run_trainer_cases, write_spec
from test_train import printed, succeeded

from opskit.ckpt.check import check_step
from opskit.ckpt.convert import convert_step
from opskit.ckpt.format.info import describe_step
from opskit.ckpt.format.universal import convert_to_universal
from opskit.run.paths import RunPaths
from opskit.spec.load import load_spec
from opskit.spec.plan import make_plan
from opskit.submission.render import render_job, trainer_args

# The fp32 settings train as without it: DeepSpeed asks only to refuse fp16 (its engine; the trainer too) and for the
# dtypes its gradient all-reduce sorts gradients by (an fp16 bucket stays empty).
FP16_ON_CPU = """
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
CPU_Accelerator.is_fp16_supported = lambda self: True  # torch has fp16 on any CPU; DeepSpeed asks oneDNN
"""

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}  # tr1/tr8's: the resume must be exact with it on


def _spec(folder: Path, kjv_data, precision: str, zero_stage: int, pp: int = 1, dp: int = 1, async_save: bool = False):
    """The tiny preset at ``precision`` / ZeRO ``zero_stage`` on PP x DP processes: 4 iterations of 16 samples,
    a step saved every 2; its run folder is ``folder / "run"``."""
    path = write_spec(folder / "spec.yaml", kjv_data, folder / "run", model={"precision": precision, **DROPOUT},
                      parallel={"gpus_per_node": pp * dp, "pipeline_model_parallel_size": pp, "zero_stage": zero_stage},
                      batch={"train_samples": 64}, checkpoint={"save_interval": 2, "log_interval": 1,
                                                               "async_save": async_save},
                      slurm={"time": "30"})
    return load_spec(str(path))


def _trainer_args(spec) -> list[str]:
    """The spec's rendered trainer command line, its DeepSpeed config written where the line names it."""
    run = RunPaths.of(spec)
    run.ds_config.parent.mkdir(parents=True, exist_ok=True)
    run.ds_config.write_text(render_job(spec, run).ds_config)
    return trainer_args(spec, run)


def _train(spec, nproc: int):
    """Run the trainer with the spec's rendered command line and DeepSpeed config; the finished process."""
    return succeeded(run_trainer(_trainer_args(spec), nproc=nproc))


def _model_states(step: Path) -> list[dict]:
    return [torch.load(f, map_location="cpu", weights_only=False) for f in sorted(step.glob("mp_rank_*"))]


@pytest.fixture(scope="module")
def bf16_zero0(kjv_data, tmp_path_factory):
    """tr11's setting (bf16, ZeRO-0) at PP=2 with dropout: (spec, the finished process); steps 2 and 4."""
    spec = _spec(tmp_path_factory.mktemp("bf16-zero0"), kjv_data, "bf16", 0, pp=2)
    return spec, _train(spec, nproc=2)


def _resumed_from(step: Path, folder: Path, kjv_data, async_save: bool = False):
    """The bf16 ZeRO-0 PP=2 run of :func:`bf16_zero0` resumed from a copy of ``step`` until iteration 4: (its run
    paths, the finished process)."""
    spec = _spec(folder, kjv_data, "bf16", 0, pp=2, async_save=async_save)
    run = RunPaths.of(spec)
    shutil.copytree(step, run.checkpoints / step.name)
    (run.checkpoints / "latest").write_text(step.name)
    return run, _train(spec, nproc=2)


def _same_losses(resumed, straight) -> None:
    got, want = printed(resumed.stdout), printed(straight.stdout)
    assert sorted(got) == [3, 4], resumed.stdout[-3000:]
    assert all((f["loss"], f["lr"]) == (want[i]["loss"], want[i]["lr"]) for i, f in got.items()), (got, want)


# ------------------------------------------------------------------------------------------------ plan vs written

SETTINGS = {  # name -> (precision, ZeRO stage, DP)
    "bf16-zero1-dp2": ("bf16", 1, 2),  # BF16_Optimizer's shards, one per DP rank
    "fp32-zero1": ("fp32", 1, 1),  # ZeRO's fp32 copy of its partition, beside the fp32 weights of the layer files
    "fp32-zero0": ("fp32", 0, 1),  # Adam steps the weights themselves: no master copy
    "fp16-zero1": ("fp16", 1, 1),  # ZeRO-1 (tr1-13B, tr8-104B)
    "fp16-zero0": ("fp16", 0, 1),  # FP16_Optimizer: its fp32 copy and Adam's moments inside mp_rank_00
}


@pytest.fixture(scope="module")
def one_process_settings(kjv_data, tmp_path_factory) -> dict:
    """The :data:`SETTINGS` of one process (DP=1) trained one after the other in one process under
    :data:`FP16_ON_CPU`: name -> (its spec, the finished run)."""
    root = tmp_path_factory.mktemp("one-process")
    specs = {name: _spec(root / name, kjv_data, precision, zero_stage)
             for name, (precision, zero_stage, dp) in SETTINGS.items() if dp == 1}
    done = run_trainer_cases({name: _trainer_args(spec) for name, spec in specs.items()}, root / "cases",
                             prelude=FP16_ON_CPU)
    return {name: (spec, done[name]) for name, spec in specs.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_plan_states_the_bytes_of_a_saved_step(kjv_data, tmp_path, request, setting):
    precision, zero_stage, dp = SETTINGS[setting]
    if dp == 1:
        spec, done = request.getfixturevalue("one_process_settings")[setting]
        succeeded(done)
    else:
        spec = _spec(tmp_path, kjv_data, precision, zero_stage, dp=dp)
        _train(spec, nproc=dp)
    _plan_matches(spec)


def test_bf16_zero0_step_holds_the_optimizer_once_and_the_plan_its_bytes(bf16_zero0):
    """tr11's setting: the model-states files hold no optimizer (the shards do) but DeepSpeed's ``param_shapes``, as
    BLOOM's checkpoints; the step's bytes are the plan's (14 per parameter, the tied embedding's optimizer part on both
    stages), where DeepSpeed 0.19.8 alone wrote 26 per parameter at DP=1."""
    spec, _ = bf16_zero0
    step = RunPaths.of(spec).checkpoints / "global_step2"
    states = _model_states(step)
    assert len(states) == 2 and all(s["optimizer"] is None and s["param_shapes"] for s in states)
    assert len(list(step.glob("bf16_zero_pp_rank_*_optim_states.pt"))) == 2
    report = check_step(step)
    assert report.ok and report.redundant == [] and report.as_json()["redundant_bytes"] == 0
    _plan_matches(spec)
    # ds_to_universal reads the saved param_shapes (a layout change's path); the fp32 weights are the step's
    assert convert_to_universal(step, step.parent / "universal", verify=True).is_dir()


def _plan_matches(spec) -> None:
    """The plan's bytes of a step against the trainer's global_step2 (every file of it), within 5%."""
    planned = make_plan(spec).memory.checkpoint_bytes
    step = describe_step(RunPaths.of(spec).checkpoints / "global_step2")
    assert step.complete, step.problems
    assert abs(step.size_bytes / planned - 1) <= 0.05, (step.size_bytes, planned)


# ------------------------------------------------------------------------------------------------ resume and convert

def test_bf16_zero0_resume_from_the_one_copy_is_exact_also_saving_in_the_background(bf16_zero0, kjv_data, tmp_path):
    """Resumed from global_step2 (dropout on), iterations 3 and 4 print the uninterrupted run's losses; saved with
    ``--async-save``, step 4 has the same layout and fits the host arena sized by the same rule."""
    spec, straight = bf16_zero0
    run, resumed = _resumed_from(RunPaths.of(spec).checkpoints / "global_step2", tmp_path, kjv_data, async_save=True)
    _same_losses(resumed, straight)
    assert "save-checkpoint-background" in resumed.stdout
    assert "did not fit its host arena" not in resumed.stdout
    assert all(s["optimizer"] is None for s in _model_states(run.checkpoints / "global_step4"))
    assert describe_step(run.checkpoints / "global_step4").complete


def test_a_step_saved_with_the_redundant_copy_resumes_exactly_converts_and_is_reported(bf16_zero0, kjv_data,
                                                                                        tmp_path):
    """A step as DeepSpeed 0.19.8 wrote it before the fix (DP rank 0's shard as each model-states file's
    ``optimizer``, no ``param_shapes``): complete; ``ckpt check`` says how many bytes the copy is (a finding, the
    step OK); it resumes with the uninterrupted run's losses, converts to HF (verified) and to its universal form."""
    spec, straight = bf16_zero0
    new = RunPaths.of(spec).checkpoints / "global_step2"
    old = tmp_path / "old" / "global_step2"
    shutil.copytree(new, old)
    copied = sum(t.untyped_storage().nbytes() for planted in plant_redundant_optimizer_copy(old)
                 for t in _tensors(planted))
    assert describe_step(old).complete

    report = check_step(old)
    assert report.ok and [r["file"] for r in report.redundant] == ["mp_rank_00_model_states.pt",
                                                                   "mp_rank_01_model_states.pt"]
    assert report.redundant_bytes == copied
    extra = describe_step(old).size_bytes - describe_step(new).size_bytes
    assert 0 <= extra - copied <= 64 << 10  # the rest: the zip records' headers

    _, resumed = _resumed_from(old, tmp_path / "resumed", kjv_data)
    _same_losses(resumed, straight)
    assert convert_step(old, tmp_path / "hf").max_abs_diff is not None  # verified: a failure raises
    universal = convert_to_universal(old, tmp_path / "universal", verify=True)
    assert (universal / "zero" / "tied_modules.embed.word_embeddings.weight" / "exp_avg.pt").is_file()


def _tensors(item) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples, each storage once."""
    found, seen, pending = [], set(), [item]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor) and item.untyped_storage().data_ptr() not in seen:
            seen.add(item.untyped_storage().data_ptr())
            found.append(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return found
