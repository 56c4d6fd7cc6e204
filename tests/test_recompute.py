"""``--recompute-granularity selective`` (issue 50): the LayerNorms' outputs and the MLP's activation are made again in
the backward pass, not kept; the training is bitwise the same (dropout on, TP = 1; TP = 2 through megatron-core's
linears), the flags and the spec refuse what cannot run, and ``opskit plan`` counts it and advises the least recompute
that fits. Its memory is measured on a GPU (bench/pipeline_layout.py --recompute selective)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import TP2_RUN, write_spec

from opskit.spec.files import SpecError
from opskit.spec.load import load_spec
from opskit.spec.plan import make_plan

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
LINE = re.compile(r" iteration\s+(\d+)/.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")


def logged(stdout: str) -> list[tuple[str, ...]]:
    """(iteration, lm loss, grad norm) of each iteration line, as printed."""
    return LINE.findall(stdout)


@pytest.mark.parametrize("nproc, flags", [(1, {"train_samples": 160, **DROPOUT}), (2, TP2_RUN)], ids=["tp1", "tp2"])
def test_selective_recompute_trains_bitwise_as_keeping_everything(trained, nproc, flags):
    kept = trained(nproc, **flags)
    recomputed = trained(nproc, **flags, recompute_granularity="selective")
    assert len(logged(kept.stdout)) == 20 and logged(recomputed.stdout) == logged(kept.stdout)


def test_the_layer_frees_its_layernorm_and_activation_outputs_after_the_forward():
    """What selective recompute drops is really freed (a closure that held it would keep it: the bytes measured on a
    GPU by bench/selective_recompute.py), and the backward gives the same gradients."""
    import dataclasses
    import weakref

    import torch

    from opskit.train.model import GPTConfig, ParallelTransformerLayerPipe

    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                    max_position_embeddings=32, padded_vocab_size=128, **DROPOUT)
    x = torch.randn(2, 32, 64, requires_grad=True)
    found = {}
    for selective in (False, True):
        torch.manual_seed(0)
        layer = ParallelTransformerLayerPipe(dataclasses.replace(cfg, selective_recompute=selective))
        kept: list = []  # weak references to LN1's output, LN2's output, the activation (4h->h's input)
        for module in (layer.input_layernorm, layer.post_attention_layernorm):
            module.register_forward_hook(lambda m, args, out, kept=kept: kept.append(weakref.ref(out)))
        layer.mlp.dense_4h_to_h.register_forward_pre_hook(lambda m, args, kept=kept: kept.append(weakref.ref(args[0])))
        torch.manual_seed(1)
        out = layer(x)
        alive = [ref() is not None for ref in kept]
        (gradient,) = torch.autograd.grad(out.square().sum(), x)
        found[selective] = alive, gradient
    assert found[False][0] == [True] * 3 and found[True][0] == [False] * 3
    assert torch.equal(found[False][1], found[True][1])


@pytest.mark.parametrize("flags, expected", [
    (["--checkpoint-activations", "--recompute-granularity", "selective"], "exclude each other"),
    (["--recompute-granularity", "selective", "--torch-compile"], "for the eager model"),
    (["--recompute-granularity", "partial"], "invalid choice: 'partial'"),
])
def test_flags_that_cannot_run_are_refused_in_one_line(kjv_data, tmp_path, flags, expected):
    from conftest import tiny_trainer_args

    done = subprocess.run([sys.executable, "-m", "opskit.train", *tiny_trainer_args(kjv_data, tmp_path), *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_spec_refuses_both_recompute_modes(kjv_data, tmp_path):
    spec = write_spec(tmp_path / "both.yaml", kjv_data, tmp_path / "run",
                      model={"checkpoint_activations": True, "recompute_granularity": "selective"})
    with pytest.raises(SpecError, match="model.checkpoint_activations .* exclude each other"):
        load_spec(str(spec))


def test_plan_counts_selective_recompute_and_advises_the_least_that_fits(kjv_data, tmp_path):
    def plan(recompute: dict, gpu_memory_gb: float | None = None):
        model = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
                 "max_position_embeddings": 2048, "precision": "bf16", **recompute}
        spec = write_spec(tmp_path / "p.yaml", kjv_data, tmp_path / "run", model=model,
                          batch={"micro_batch_size": 8, "global_batch_size": 64, "train_samples": 64_000},
                          parallel={"gpu_memory_gb": gpu_memory_gb})
        return make_plan(load_spec(str(spec)))

    none, selective = plan({}).memory, plan({"recompute_granularity": "selective"}).memory
    full = plan({"checkpoint_activations": True}).memory
    assert full.total_gib_per_gpu < selective.total_gib_per_gpu < none.total_gib_per_gpu
    # 12 of the 34 bytes per s*b*h a layer keeps (two LayerNorm outputs, the activation's 4h): 24 layers, MBS 8
    dropped = 24 * 12 * 2048 * 8 * 2048 / 2**30
    assert none.activation_gib_per_gpu_no_recompute - selective.activation_gib_per_gpu_selective == \
        pytest.approx(dropped) and selective.recompute == "selective" and not selective.activation_checkpointing
    between = (selective.total_gib_per_gpu + none.total_gib_per_gpu) / 2 / 0.85  # fits selective, not none
    assert [plan({"checkpoint_activations": True}, gb).memory.advised_recompute
            for gb in (None, none.total_gib_per_gpu / 0.8, between, full.total_gib_per_gpu)] == [
        None, "none", "selective", "full"]
    # a spec without recompute on a GPU it does not fit is told the least recompute that would
    tight = selective.total_gib_per_gpu / 0.85 + 0.01
    assert tight < none.total_gib_per_gpu
    assert [w for w in plan({}, tight).warnings if w.startswith("with ")] == [
        f"with selective activation recompute the heaviest GPU would fit (~{selective.total_gib_per_gpu:.1f} GiB)"]
