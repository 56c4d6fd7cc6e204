"""The trainer resumes a step saved on another TP x PP x DP layout: through DeepSpeed's universal checkpoint,
converted once beside the step, with the losses of a run that never changed layout.

Every run is the real trainer (under torchrun for more than one process), 20 iterations of GBS 8. To keep the file's
CPU time low the runs are chained in module-scoped fixtures: an original run (all of them trained one after the
other in one process, ``originals``) saves ``global_step10``; a run on another layout resumes from a copy of it, saves
``global_step15`` and ``global_step20``, and its own lines 16..20 are the uninterrupted reference for the runs that
resume its ``global_step15`` on a third layout:

- BLOOM (ALiBi, embedding LayerNorm), vocabulary padded to 2176 by ``--pad-vocab-size-to``: DP=1 -> DP=2 -> DP=1 and
  DP=4; PP=1 -> PP=2 -> PP=1;
- GPT-2 (absolute positions, no embedding LayerNorm), 2000 tokens unpadded (``--make-vocab-size-divisible-by 80``):
  TP=1 -> TP=2 (which pads to 2080 on a fresh start) -> TP=1;
- bf16 with ZeRO-1 and with ZeRO-0 on another DP; fp32 ZeRO-0 on another DP (no conversion) and its refused TP change.

The DP=2 -> DP=1 and TP=2 -> TP=1 runs save the step they loaded before training on (:data:`SAVE_AFTER_LOADING`): the
optimizer state a resume starts from, on disk, for the exact comparisons.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_trainer, run_trainer_cases, tiny_trainer_args
from test_convert import hf_logits, tokens  # noqa: F401  (tokens: test_convert's fixture, used here)
from test_train import one_line_error, records, succeeded

from opskit.ckpt.format.info import saved_files_digest
from opskit.ckpt.format.universal import Layout, ReshapeError, convert_to_universal, needs_conversion, universal_origin
from opskit.rules.model_size import padded_vocab_size

OPSKIT = str(Path(sys.executable).with_name("opskit"))
GBS, ITERATIONS = 8, 20
FP32_REL = 1e-5  # the bound for fp32 ZeRO-1
# bf16 keeps 8 significant bits (a relative rounding step of 2**-8 = 4e-3) in the activations and gradients: a DP
# change reorders the gradient reduction, so the losses need not agree to fp32's 1e-5; 10 iterations after the resume
# they differ by 2e-5 here, the bound is a quarter of bf16's step.
BF16_REL = 1e-3
TIED = "tied_modules.embed.word_embeddings.weight"
BLOOM = {"pad_vocab_size_to": 2176}
GPT2 = {"position_embedding_type": "absolute", "embed_layernorm": None, "make_vocab_size_divisible_by": 80}

# The trainer, saving the step it loaded (to its --save) before it trains on: what a resume starts from, on disk.
SAVE_AFTER_LOADING = """
import sys
from opskit.train import main, trainer
resume = trainer.Trainer._resume
def resume_then_save(self, model):
    resume(self, model)
    self._save()
trainer.Trainer._resume = resume_then_save
sys.exit(main.main(sys.argv[1:]))
"""

# convert_to_universal stopped by SIGKILL between DeepSpeed's two passes: the shards' fragments written, no parameter
# merged yet (DeepSpeed's own prints go to stderr: the signal to the test goes to the real stdout).
KILLED_CONVERSION = """
import os, sys, time
from deepspeed.checkpoint import ds_to_universal
from opskit.ckpt.format.universal import convert_to_universal
extract = ds_to_universal._extract_zero_shard_files
def extract_then_stall(*args):
    extract(*args)
    print("extracted", file=sys.__stdout__, flush=True)
    time.sleep(600)
ds_to_universal._extract_zero_shard_files = extract_then_stall
convert_to_universal(sys.argv[1])
"""


# ---------------------------------------------------------------------------------------------------------- helpers

def run_args(data, out: Path, load: Path | None = None, **flags) -> list[str]:
    """The tiny model's flags for a run to iteration 20, saving every 5 iterations to ``out/checkpoints``, from
    ``load``'s latest step if given."""
    save = out / "checkpoints"
    return tiny_trainer_args(data, out, train_samples=ITERATIONS * GBS, save_interval=5, micro_batch_size=2,
                             save=save, load=load or save, **flags)


def finished(done: subprocess.CompletedProcess, out: Path) -> argparse.Namespace:
    """A succeeded run in ``out``: its stdout, iteration records and checkpoint dir."""
    done = succeeded(done)
    return argparse.Namespace(stdout=done.stdout, records=records(done.stdout), save=out / "checkpoints")


def train(data, out: Path, nproc: int = 1, load: Path | None = None, save_after_loading: bool = False,
          **flags) -> argparse.Namespace:
    """A run of :func:`run_args` under ``nproc`` processes (:func:`finished`)."""
    entry = ("-c", SAVE_AFTER_LOADING) if save_after_loading else ("-m", "opskit.train")
    return finished(run_trainer(run_args(data, out, load, **flags), nproc=nproc, entry=entry), out)


def copy_of(step: Path, checkpoints: Path) -> Path:
    """A checkpoint dir holding a copy of ``step``, ``latest`` naming it."""
    checkpoints.mkdir(parents=True)
    shutil.copytree(step, checkpoints / step.name)
    (checkpoints / "latest").write_text(step.name)
    return checkpoints


def assert_same_losses(got: dict[int, dict], want: dict[int, dict], first: int, rel: float = FP32_REL) -> None:
    """Iterations ``first``..20 printed, each lm loss within ``rel`` of ``want``'s, the same LR and samples."""
    assert sorted(got) == list(range(first, ITERATIONS + 1))
    for iteration, record in got.items():
        expected = want[iteration]
        assert abs(record["lm_loss"] - expected["lm_loss"]) <= rel * abs(expected["lm_loss"]), (iteration, record,
                                                                                                 expected)
        assert (record["learning_rate"], record["consumed_samples"]) == (expected["learning_rate"],
                                                                         expected["consumed_samples"]), iteration


def layout_line(stdout: str) -> str:
    [line] = [line for line in stdout.splitlines() if line.startswith(" checkpoint layout ")]
    return line


def hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def optimizer_tensors(step: Path, mp_rank: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """The fp32 ZeRO-1 optimizer state of one (PP, TP) rank's parameters, by engine name (``3.mlp...``): fp32 master
    weight, Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``, each the DP ranks' fragments joined in rank order
    (DeepSpeed's ``param_slice_mappings`` locate them in the flat partitions)."""
    shards = sorted(step.glob(f"zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"),
                    key=lambda p: int(p.name.split("_")[3]))
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    for shard in shards:
        state = load(shard)["optimizer_state_dict"]
        for group, mapping in enumerate(state["param_slice_mappings"]):
            adam = state["base_optimizer_state"]["state"][group]
            flat = {"fp32": state["single_partition_of_fp32_groups"][group], "exp_avg": adam["exp_avg"],
                    "exp_avg_sq": adam["exp_avg_sq"]}
            for name, fragment in mapping.items():
                joined = pieces.setdefault(name, {kind: [] for kind in (*flat, "step")})
                for kind, tensor in flat.items():
                    joined[kind].append(tensor.narrow(0, fragment.start, fragment.numel))
                joined["step"].append(adam["step"].reshape(1))
    return {name: {kind: torch.cat(parts) if kind != "step" else parts[0] for kind, parts in kinds.items()}
            for name, kinds in pieces.items()}


# ---------------------------------------------------------------------------------------------------------- runs

# The runs every layout change starts from (TP=1 PP=1 DP=1), by name: their flags.
ORIGINALS = {"bloom": BLOOM, "gpt2": GPT2, "bf16-zero1": dict(bf16=True, zero_stage=1, **BLOOM),
             "bf16-zero0": dict(bf16=True, zero_stage=0, **BLOOM), "fp32-zero0": dict(zero_stage=0, **BLOOM)}


@pytest.fixture(scope="module")
def originals(kjv_data, tmp_path_factory) -> dict[str, argparse.Namespace]:
    """:data:`ORIGINALS` trained one after the other in one process (conftest's ``run_trainer_cases``): name ->
    :func:`finished`. Each is resumed on another layout in a process of its own."""
    folder = tmp_path_factory.mktemp("originals")
    done = run_trainer_cases({name: run_args(kjv_data, folder / name, **flags) for name, flags in ORIGINALS.items()},
                             folder / "cases")
    return {name: finished(done[name], folder / name) for name in ORIGINALS}


@pytest.fixture(scope="module")
def bloom(originals):
    """The original BLOOM run: TP=1 PP=1 DP=1."""
    return originals["bloom"]


@pytest.fixture(scope="module")
def dp2(kjv_data, bloom, tmp_path_factory):
    """The BLOOM run's global_step10 resumed at DP=2."""
    out = tmp_path_factory.mktemp("dp2")
    return train(kjv_data, out, nproc=2, load=copy_of(bloom.save / "global_step10", out / "from"), **BLOOM)


@pytest.fixture(scope="module")
def dp_changes(kjv_data, dp2, tmp_path_factory):
    """The DP=2 run's global_step15, from one checkpoint dir, resumed at DP=1 (saving the loaded step) and then at
    DP=4; the step's files and the universal folder's marker before and after."""
    out = tmp_path_factory.mktemp("dp-changes")
    checkpoints = copy_of(dp2.save / "global_step15", out / "from")
    step, universal = checkpoints / "global_step15", checkpoints / "global_step15_universal"
    before = hashes(step)
    dp1 = train(kjv_data, out / "dp1", load=checkpoints, save_after_loading=True, **BLOOM)
    marker = (universal / ".opskit").stat().st_mtime_ns
    dp4 = train(kjv_data, out / "dp4", nproc=4, load=checkpoints, **BLOOM)
    return argparse.Namespace(dp1=dp1, dp4=dp4, checkpoints=checkpoints, step=step, universal=universal,
                              hashes=(before, hashes(step)),
                              marker=(marker, (universal / ".opskit").stat().st_mtime_ns))


@pytest.fixture(scope="module")
def pp_changes(kjv_data, bloom, tmp_path_factory):
    """The BLOOM run's global_step10 resumed at PP=2, and that run's global_step15 at PP=1."""
    out = tmp_path_factory.mktemp("pp-changes")
    pp2 = train(kjv_data, out / "pp2", nproc=2, load=copy_of(bloom.save / "global_step10", out / "from10"),
                pipeline_model_parallel_size=2, **BLOOM)
    pp1 = train(kjv_data, out / "pp1", load=copy_of(pp2.save / "global_step15", out / "from15"), **BLOOM)
    return argparse.Namespace(pp2=pp2, pp1=pp1)


@pytest.fixture(scope="module")
def tp_changes(kjv_data, originals, tmp_path_factory):
    """The original GPT-2 run (TP=1) and its global_step10 resumed at TP=2, and that run's global_step15 at TP=1
    (saving the loaded step)."""
    out = tmp_path_factory.mktemp("tp-changes")
    tp1 = originals["gpt2"]
    tp2 = train(kjv_data, out / "tp2", nproc=2, load=copy_of(tp1.save / "global_step10", out / "from10"),
                tensor_model_parallel_size=2, **GPT2)
    back = train(kjv_data, out / "back", load=copy_of(tp2.save / "global_step15", out / "from15"),
                 save_after_loading=True, **GPT2)
    return argparse.Namespace(tp1=tp1, tp2=tp2, back=back, from15=out / "from15")


# ---------------------------------------------------------------------------------------------------------- DP

def test_dp1_to_dp2(bloom, dp2):
    assert layout_line(dp2.stdout) == (" checkpoint layout TP=1 PP=1 DP=1 -> TP=1 PP=1 DP=2 "
                                       "(universal checkpoint global_step10_universal)")
    assert_same_losses(dp2.records, bloom.records, 11)
    assert load(dp2.save / "global_step15" / "mp_rank_00_model_states.pt")["dp_world_size"] == 2


def test_dp2_to_dp1_and_dp4(dp2, dp_changes):
    """Against the DP=2 run that went on from the same step: fp32 losses within 1e-5, the same LR and samples."""
    dp1, dp4 = dp_changes.dp1, dp_changes.dp4
    assert f" converting {dp_changes.step} to a universal checkpoint for TP=1 PP=1 DP=1" in dp1.stdout.splitlines()
    assert layout_line(dp1.stdout) == (" checkpoint layout TP=1 PP=1 DP=2 -> TP=1 PP=1 DP=1 "
                                       "(universal checkpoint global_step15_universal)")
    assert layout_line(dp4.stdout) == (" checkpoint layout TP=1 PP=1 DP=2 -> TP=1 PP=1 DP=4 "
                                       "(universal checkpoint global_step15_universal)")
    assert_same_losses(dp1.records, dp2.records, 16)
    assert_same_losses(dp4.records, dp2.records, 16)
    assert load(dp4.save / "global_step20" / "mp_rank_00_model_states.pt")["dp_world_size"] == 4


def test_adam_moments_after_loading_are_the_saved_ones_repartitioned(dp2, dp_changes):
    """The DP=1 run's optimizer state right after loading (saved before its first iteration) is, parameter by
    parameter and bit for bit, the DP=2 step's two ZeRO-1 partitions joined: master weights, both moments, step."""
    saved = optimizer_tensors(dp2.save / "global_step15")
    loaded = optimizer_tensors(dp_changes.dp1.save / "global_step15")
    assert len(list((dp_changes.dp1.save / "global_step15").glob("zero_pp_rank_*"))) == 1
    assert sorted(loaded) == sorted(saved) and TIED in saved
    for name, kinds in saved.items():
        for kind, tensor in kinds.items():
            assert torch.equal(loaded[name][kind], tensor), (name, kind)


def test_conversion_is_written_once_beside_the_untouched_step(dp_changes):
    """The step the two runs resumed from is byte for byte as copied; the DP=4 run read the DP=1 run's conversion
    (universal, so good for any layout) without converting again; nothing else was left in the checkpoint dir."""
    before, after = dp_changes.hashes
    assert after == before
    assert " converting " not in dp_changes.dp4.stdout
    assert dp_changes.marker[1] == dp_changes.marker[0]
    assert universal_origin(dp_changes.universal) == {"step": "global_step15", "layout": "TP=1 PP=1 DP=2",
                                                      "iteration": 15, "files": saved_files_digest(dp_changes.step)}
    assert sorted(p.name for p in dp_changes.checkpoints.iterdir()) == ["global_step15", "global_step15_universal",
                                                                        "latest"]
    assert (dp_changes.checkpoints / "latest").read_text() == "global_step15"


def test_a_step_saved_again_is_not_read_through_its_old_conversion(dp_changes, tmp_path):
    """A universal folder serves only the save it was made from. Here global_step15 is saved again under its name (as
    by a run restarted from scratch in the same checkpoint dir): the DP=1 run's step 15 replaces the DP=2 one; the
    old conversion beside it is refused in one line, not loaded as if it were the new step's."""
    step = tmp_path / "global_step15"
    shutil.copytree(dp_changes.step, step)
    shutil.copytree(dp_changes.universal, tmp_path / "global_step15_universal")
    assert convert_to_universal(step) == tmp_path / "global_step15_universal"  # the same save (copied): reused
    shutil.rmtree(step)
    shutil.copytree(dp_changes.dp1.save / "global_step15", step)
    with pytest.raises(ReshapeError, match=r"global_step15_universal: converted from another save \(global_step15 at "
                                           r"TP=1 PP=1 DP=2\) than .*global_step15 as saved now; remove it"):
        convert_to_universal(step)


def test_a_killed_conversion_leaves_the_step_untouched_and_the_next_one_completes(dp_changes, tmp_path):
    """SIGKILL mid-conversion leaves only a hidden staging folder beside the unchanged step; the next conversion
    removes it (its process is gone) and writes the same universal checkpoint as an uninterrupted one."""
    step = tmp_path / "global_step15"
    shutil.copytree(dp_changes.step, step)
    before = hashes(step)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CONVERSION, str(step)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert "extracted\n" in iter(proc.stdout.readline, "")  # DeepSpeed's accelerator line comes first
    finally:
        proc.kill()
        proc.wait()
    [hidden] = [p.name for p in tmp_path.iterdir() if p.name != "global_step15"]
    fragments = [p for p in (tmp_path / hidden).rglob("fp32.*") if p.is_file()]  # <param>/<tp>/fp32.<dp rank>
    assert hidden == f".global_step15_universal.tmp-{proc.pid}" and fragments
    assert hashes(step) == before

    universal = convert_to_universal(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step15", "global_step15_universal"]
    assert universal_origin(universal)["step"] == "global_step15" and hashes(step) == before
    for name in ("3.mlp.dense_h_to_4h.weight", TIED):
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(load(universal / "zero" / name / f"{kind}.pt")["param"],
                               load(dp_changes.universal / "zero" / name / f"{kind}.pt")["param"]), (name, kind)


@pytest.mark.parametrize("damage", ["parameter folder deleted", "fp32.pt truncated"])
def test_a_damaged_universal_folder_is_not_reused(dp_changes, kjv_data, tmp_path, damage):
    """A reused universal folder is checked as a step is (its files and their sizes as written, each
    torch file's headers); before, `ckpt reshape` called such a folder "reused ... verified" and the resume died
    with a FileNotFoundError or PytorchStreamReader traceback on every rank. The trainer's resume says one line."""
    checkpoints = copy_of(dp_changes.step, tmp_path / "checkpoints")
    step = checkpoints / "global_step15"
    universal = convert_to_universal(step)
    victim = universal / "zero" / "3.mlp.dense_h_to_4h.weight"
    if damage == "parameter folder deleted":
        shutil.rmtree(victim)
    else:
        with open(victim / "fp32.pt", "r+b") as f:
            f.truncate(100)
    with pytest.raises(ReshapeError, match=r"damaged \(zero/3\.mlp\.dense_h_to_4h\.weight/"):
        convert_to_universal(step)
    if damage == "fp32.pt truncated":  # the trainer's resume at DP=1 (the step was saved at DP=2): one line
        done = run_trainer(tiny_trainer_args(kjv_data, tmp_path / "run", train_samples=ITERATIONS * GBS,
                                             micro_batch_size=2, load=checkpoints, **BLOOM))
        one_line_error(done, "global_step15_universal: damaged (zero/3.mlp.dense_h_to_4h.weight/fp32.pt")


def test_conversion_leftovers_without_opskits_marker_are_left_alone(dp_changes, tmp_path):
    """A `.global_stepN_universal.tmp-<pid>` folder of a process that is gone is removed only when
    opskit's marker says it made it; a folder of that name the user made stays."""
    step = copy_of(dp_changes.step, tmp_path / "checkpoints") / "global_step15"
    theirs = step.with_name(".global_step15_universal.tmp-999999999")
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    convert_to_universal(step)
    assert (theirs / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------------- PP

def test_pp1_to_pp2_and_back(bloom, pp_changes):
    pp2, pp1 = pp_changes.pp2, pp_changes.pp1
    assert layout_line(pp2.stdout) == (" checkpoint layout TP=1 PP=1 DP=1 -> TP=1 PP=2 DP=1 "
                                       "(universal checkpoint global_step10_universal)")
    assert layout_line(pp1.stdout) == (" checkpoint layout TP=1 PP=2 DP=1 -> TP=1 PP=1 DP=1 "
                                       "(universal checkpoint global_step15_universal)")
    assert_same_losses(pp2.records, bloom.records, 11)
    assert_same_losses(pp1.records, pp2.records, 16)
    for run in (pp2, pp1):
        assert load(run.save / "global_step20" / "mp_rank_00_model_states.pt")["args"].padded_vocab_size == 2176


@pytest.mark.parametrize("iteration", [15, 20])
def test_embeddings_stay_tied_after_pp1_to_pp2(pp_changes, iteration):
    """At PP=2 the last stage holds its own copy of the word embedding for the LM head: in the steps saved after the
    resume from PP=1, its fp32 weight and Adam moments equal the first stage's, which equal the saved weight."""
    step = pp_changes.pp2.save / f"global_step{iteration}"
    first, last = optimizer_tensors(step, mp_rank=0)[TIED], optimizer_tensors(step, mp_rank=1)[TIED]
    for kind in first:
        assert torch.equal(first[kind], last[kind]), kind
    weight = load(step / "layer_01-model_00-model_states.pt")["word_embeddings.weight"]
    assert torch.equal(first["fp32"], weight.flatten())


# ---------------------------------------------------------------------------------------------------------- TP

def test_tp1_to_tp2_keeps_the_saved_vocabulary_padding(tp_changes):
    """2000 tokens, a multiple of 80 (TP=1: no padding); a fresh TP=2 run would pad to 2080 (a multiple of 80 * 2),
    but the resume keeps the checkpoint's 2000 rows (TP=2 divides it), so it continues exactly."""
    tp1, tp2 = tp_changes.tp1, tp_changes.tp2
    assert padded_vocab_size(2000, 80, 1) == 2000 and padded_vocab_size(2000, 80, 2) == 2080
    assert layout_line(tp2.stdout) == (" checkpoint layout TP=1 PP=1 DP=1 -> TP=2 PP=1 DP=1 "
                                       "(universal checkpoint global_step10_universal)")
    assert " > padded vocab of global_step10 kept (new size: 2000; 2080 on a fresh start)" in tp2.stdout.splitlines()
    assert " > padded vocab of " not in tp_changes.back.stdout  # TP=1 pads 2000 to 2000 on a fresh start too
    assert_same_losses(tp2.records, tp1.records, 11)
    for iteration in (15, 20):
        step = tp2.save / f"global_step{iteration}"
        assert load(step / "mp_rank_00_model_states.pt")["args"].padded_vocab_size == 2000
        assert load(step / "layer_01-model_01-model_states.pt")["word_embeddings.weight"].shape == (1000, 64)


def test_tp2_to_tp1(tp_changes):
    assert layout_line(tp_changes.back.stdout) == (" checkpoint layout TP=2 PP=1 DP=1 -> TP=1 PP=1 DP=1 "
                                                   "(universal checkpoint global_step15_universal)")
    assert_same_losses(tp_changes.back.records, tp_changes.tp2.records, 16)
    assert_same_losses(tp_changes.back.records, tp_changes.tp1.records, 16)


def test_adam_moments_survive_tp2_to_tp1(tp_changes, tmp_path):
    """The TP=1 run's optimizer state right after loading, made universal again, is the TP=2 step's universal form
    bit for bit: every parameter's TP slices merged and cut back without a change."""
    ours = tmp_path / "global_step15"
    shutil.copytree(tp_changes.back.save / "global_step15", ours)
    again = convert_to_universal(ours)
    original = tp_changes.from15 / "global_step15_universal"
    names = sorted(p.name for p in (original / "zero").iterdir() if p.is_dir())
    assert names == sorted(p.name for p in (again / "zero").iterdir() if p.is_dir()) and len(names) == 28
    for name in names:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            want, got = (load(u / "zero" / name / f"{kind}.pt")["param"] for u in (original, again))
            assert torch.equal(got, want), (name, kind)


def test_a_reshaped_step_converts_to_hugging_face_with_the_original_logits(tp_changes, tokens, tmp_path):  # noqa: F811
    """`opskit ckpt convert` of the TP=2 step and of the same step loaded at TP=1 (saved before any training):
    the same GPT-2 logits from transformers."""
    logits = []
    for name, step in (("original", tp_changes.tp2.save / "global_step15"),
                       ("reshaped", tp_changes.back.save / "global_step15")):
        done = subprocess.run([OPSKIT, "ckpt", "convert", str(step), "--out", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        logits.append(hf_logits(tmp_path / name, tokens))
    assert logits[0].shape == (2, 32, 2000)
    assert torch.equal(logits[1], logits[0])


# ---------------------------------------------------------------------------------------------------------- bf16

@pytest.mark.parametrize("zero_stage", [1, 0])
def test_bf16_resumes_on_another_dp(kjv_data, originals, tmp_path, zero_stage):
    """bf16 with ZeRO-1, and with ZeRO-0 as tr11 (BF16_Optimizer partitions over DP at stage 0 too; the trainer loads
    it itself on DeepSpeed 0.18.5-0.19.8, opskit.train.ds_compat), from DP=1 to DP=2: the losses within BF16_REL."""
    name = f"bf16-zero{zero_stage}"
    straight = originals[name]
    resumed = train(kjv_data, tmp_path / "dp2", nproc=2,
                    load=copy_of(straight.save / "global_step10", tmp_path / "from"), **ORIGINALS[name])
    assert layout_line(resumed.stdout) == (" checkpoint layout TP=1 PP=1 DP=1 -> TP=1 PP=1 DP=2 "
                                           "(universal checkpoint global_step10_universal)")
    assert_same_losses(resumed.records, straight.records, 11, rel=BF16_REL)
    assert {p.name for p in (resumed.save / "global_step20").glob("bf16_zero_*")} == {
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}


# ---------------------------------------------------------------------------------------------------------- ZeRO-0

def test_zero0_fp32_changes_dp_without_conversion_and_refuses_a_tp_change(kjv_data, originals, tmp_path):
    """ZeRO-0 keeps the fp32 optimizer whole in the mp_rank files: DP=1 -> DP=2 loads the step itself (no universal
    folder); TP=1 -> TP=2 would need the states re-cut, which DeepSpeed only does for ZeRO-1: one line, exit 2."""
    straight = originals["fp32-zero0"]
    checkpoints = copy_of(straight.save / "global_step10", tmp_path / "from")
    resumed = train(kjv_data, tmp_path / "dp2", nproc=2, load=checkpoints, zero_stage=0, **BLOOM)
    assert layout_line(resumed.stdout) == " checkpoint layout TP=1 PP=1 DP=1 -> TP=1 PP=1 DP=2"
    assert " converting " not in resumed.stdout
    assert_same_losses(resumed.records, straight.records, 11)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step10", "latest"]

    args = tiny_trainer_args(kjv_data, tmp_path / "tp2", train_samples=ITERATIONS * GBS, micro_batch_size=2,
                             load=checkpoints, zero_stage=0, tensor_model_parallel_size=2, **BLOOM)
    done = run_trainer(args, nproc=2)
    # each rank stops with the same one line and exit 2; then torchrun reports (with its ChildFailedError's traceback)
    trainer, _, launcher = done.stderr.partition("torch/distributed/elastic/multiprocessing/api.py")
    errors = [line for line in trainer.splitlines() if "error:" in line]
    assert errors == [f"error: {checkpoints / 'global_step10'}: layout TP=1 PP=1 DP=1 -> TP=2 PP=1 DP=1: a ZeRO "
                      "stage 0 step keeps its optimizer unpartitioned; it resumes on another DP size, but a TP or PP "
                      "change needs ZeRO stage 1"] * 2, done.stderr[-4000:]
    assert "Traceback" not in trainer and "exitcode  : 2 " in launcher
    assert records(done.stdout) == {}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step10", "latest"]


def test_which_layout_changes_need_conversion_or_are_refused():
    """ZeRO-1 (any precision) and bf16 ZeRO-0 (partitioned by BF16_Optimizer): every change goes through the
    universal form. ZeRO-0 fp32/fp16: a DP change loads the step itself, TP/PP are refused."""
    dp2, dp1, tp2, pp2 = Layout(1, 1, 2), Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1)
    for precision in ("fp32", "fp16", "bf16"):
        assert needs_conversion(dp2, dp2, 1, precision) is False
        assert all(needs_conversion(dp2, target, 1, precision) for target in (dp1, tp2, pp2))
    for precision in ("fp32", "fp16"):
        assert needs_conversion(dp2, dp1, 0, precision) is False
        for target in (tp2, pp2):
            with pytest.raises(ReshapeError, match="needs ZeRO stage 1$"):
                needs_conversion(dp2, target, 0, precision)
    assert needs_conversion(dp2, dp2, 0, "bf16") is False
    assert all(needs_conversion(dp2, target, 0, "bf16") for target in (dp1, tp2, pp2))


# ---------------------------------------------------------------------------------------------------------- placement

def _placement(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.device, torch.dtype]]:
    return [(key, value.device, value.dtype) for group in optimizer.param_groups for p in group["params"]
            for key, value in optimizer.state[p].items() if torch.is_tensor(value)]


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_states_after_a_load_are_placed_as_a_fresh_step_places_them(fused):
    """DeepSpeed's universal load writes ``step`` and the Adam moments as ``torch.load`` returned them (on the CPU,
    in the saved dtype), bypassing torch's placement rule; fused AdamW on a GPU then refused its first step. Here the
    states are put in the wrong dtype (the part of the rule a CPU can show) and ``place_optimizer_states`` restores
    what a fresh step makes; the step then gives the same parameters as an optimizer that was never disturbed. The
    device part is checked on GPUs by bench/gpu_acceptance.py's layout-change rows."""
    from opskit.train.checkpointing import place_optimizer_states

    def stepped() -> tuple[list[torch.Tensor], torch.optim.AdamW]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        optimizer = torch.optim.AdamW(params, lr=0.1, fused=fused)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return params, optimizer

    params, optimizer = stepped()
    fresh = _placement(optimizer)
    assert fresh and all(device == torch.device("cpu") for _, device, _ in fresh)
    for p in params:  # as a loader that bypassed torch's rule may leave them
        state = optimizer.state[p]
        state["step"] = state["step"].to(torch.float64)
        state["exp_avg"] = state["exp_avg"].to(torch.float64)
    moved = place_optimizer_states(optimizer)
    want_step_dtype = torch.float32 if fused else torch.float64  # torch leaves a non-fused step as it was loaded
    assert moved == (4 if fused else 2)
    assert _placement(optimizer) == [(key, device, want_step_dtype if key == "step" else dtype)
                                     for key, device, dtype in fresh]
    assert place_optimizer_states(optimizer) == 0
    optimizer.step()
    reference_params, reference = stepped()
    reference.step()
    for got, want in zip(params, reference_params, strict=True):
        assert torch.equal(got, want)
