"""opskit.train.ds_compat's changes to DeepSpeed's step for speed and memory: the fused inf/NaN check gives
DeepSpeed's own answer; the last pipeline stage's logits are released after their backward."""

from __future__ import annotations

import math
import re
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from conftest import run_trainer_cases, tiny_trainer_args  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: E402

from opskit.logs.grammar import parse_iteration_line  # noqa: E402
from opskit.train.ds_compat import fuse_zero_overflow_check  # noqa: E402

# The trainer under two wrappers: DeepSpeed's train_batch prints, after each iteration, whether the pipeline engine
# still holds a micro-batch's output (the last stage's logits) in its buffers; the trainer's main starts each run with
# dynamo's caches emptied (as a fresh process) and prints at its end how many graphs torch.compile made in it
# (dynamo's count of distinct frames it compiled, a counter of the whole process).
PRINTING_WRAPPERS = """
import torch._dynamo
import opskit.train.main
from deepspeed.runtime.pipe.engine import PipelineEngine
inner = PipelineEngine.train_batch
def train_batch(self, *args, **kwargs):
    loss = inner(self, *args, **kwargs)
    held = sum(output is not None for output in self.pipe_buffers["outputs"])
    print(f"outputs held after train_batch: {held}", flush=True)
    return loss
PipelineEngine.train_batch = train_batch
trainer_main = opskit.train.main.main
def main(argv):
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        return trainer_main(argv)
    finally:
        print(f"unique graphs: {torch._dynamo.utils.counters['stats']['unique_graphs'] - before}", flush=True)
opskit.train.main.main = main
"""

LAYOUTS = {"alibi": {"position_embedding_type": "alibi"},
           "absolute": {"position_embedding_type": "absolute", "embed_layernorm": None}}


def _optimizer(groups: list[list]) -> types.SimpleNamespace:
    """What both checks read of a DeepSpeedZeroOptimizer: its groups and their partitioned gradients."""
    return types.SimpleNamespace(bit16_groups=[object()] * len(groups), averaged_gradients=dict(enumerate(groups)),
                                 device="cpu", _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan,
                                 has_overflow_partitioned_grads_serial=None)


def _tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


CASES = {
    "finite": [[_tensor(1.0, -2.0), torch.full((70_000,), 3e38)], [_tensor(0.0)]],
    "nan in the second group": [[_tensor(1.0)], [_tensor(2.0, math.nan)]],
    "+inf": [[_tensor(math.inf, 1.0)]],
    "-inf among many": [[torch.ones(100) for _ in range(300)] + [_tensor(-math.inf)]],
    "None and empty gradients": [[None, torch.empty(0), _tensor(5.0)]],
    "nothing": [[None]],
    "a group without gradients (ZeRO releases them)": [None, [_tensor(math.nan)]],
}


@pytest.mark.parametrize("name", CASES)
def test_fused_check_equals_deepspeeds(name):
    groups = CASES[name]
    reference = _optimizer([g or [] for g in groups])
    expected = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(reference)
    fused = _optimizer(groups)
    assert fuse_zero_overflow_check(fused)
    got = fused.has_overflow_partitioned_grads_serial()
    assert got.shape == expected.shape == (1,)
    assert got.dtype == torch.bool and bool(got) == bool(expected)


def test_other_optimizers_are_left_alone():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not fuse_zero_overflow_check(optimizer)
    assert not hasattr(optimizer, "has_overflow_partitioned_grads_serial")


@pytest.fixture(scope="module")
def wrapped_runs(kjv_data, tmp_path_factory) -> dict:
    """The runs of this file's trainer tests, one after the other in one process under :data:`PRINTING_WRAPPERS`
    (none resumes): name -> the finished run. ``last-stage``: 3 iterations of 4 micro-batches; ``eager-LAYOUT`` and
    ``compiled-LAYOUT``: 3 iterations of a 3-layer model of each of :data:`LAYOUTS`, without and with
    --torch-compile."""
    root = tmp_path_factory.mktemp("wrapped")
    cases = {"last-stage": tiny_trainer_args(kjv_data, root / "last-stage", train_samples=24, micro_batch_size=2,
                                             global_batch_size=8, log_interval=1)}
    for layout, flags in LAYOUTS.items():
        for mode, extra in (("eager", {}), ("compiled", {"torch_compile": True})):
            cases[f"{mode}-{layout}"] = tiny_trainer_args(kjv_data, root / f"{mode}-{layout}", train_samples=24,
                                                          num_layers=3, **flags, **extra)
    return run_trainer_cases(cases, root / "cases", prelude=PRINTING_WRAPPERS)


def test_last_stage_releases_its_logits_after_the_backward(wrapped_runs):
    """DeepSpeed 0.19.8 keeps the last stage's logits until the next forward replaces them (at that forward's memory
    peak); the trainer's engine drops them once their backward has run, and trains as before."""
    done = wrapped_runs["last-stage"]
    assert done.returncode == 0, done.stderr[-3000:]
    held = [line for line in done.stdout.splitlines() if line.startswith("outputs held after train_batch")]
    assert held == ["outputs held after train_batch: 0"] * 3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_stage_is_one_graph_with_eager_losses(wrapped_runs, layout):
    """--torch-compile at TP = PP = 1 compiles the stage (embedding to LM head) as one graph and the loss as another,
    not one per transformer layer, and trains to the eager losses (fp32 on CPU), BLOOM and GPT-2 alike."""
    losses = {}
    for mode in ("eager", "compiled"):
        done = wrapped_runs[f"{mode}-{layout}"]
        assert done.returncode == 0, done.stderr[-3000:]
        losses[mode] = [r["lm_loss"] for line in done.stdout.splitlines() if (r := parse_iteration_line(line))]
        graphs = re.search(r"unique graphs: (\d+)", done.stdout).group(1)
        assert int(graphs) == (2 if mode == "compiled" else 0), done.stdout[-2000:]
    assert len(losses["eager"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
