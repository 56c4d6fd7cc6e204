"""Issue 19 goal 4: bitsandbytes' 8-bit Adam (tr8b-104B's ``bnb`` variant) against fp32 Adam in opskit's trainer.

Two runs of the same model on the same real text from the same seed: (a) ``fp32-adam``, torch's AdamW (the trainer's
default client optimizer; fp32 moments inside DeepSpeed's ZeRO optimizer), (b) ``bnb-8bit-adam``,
``--use-bnb-optimizer``. Each is one process running ``opskit.train``'s ``main`` (what ``python -m opskit.train``
runs) with DeepSpeed's ``train_batch`` wrapped only to keep the engine, whose innermost optimizer's state is summed
after training (every tensor once: torch's exp_avg/exp_avg_sq/step; bitsandbytes' state1/state2, absmax, qmap).

The model takes from the preset (opskit/spec/presets/tr8b-104B.yaml, variant ``bnb``) what defines it: absolute
positions, no ``--embed-layernorm`` (``--use-bnb-optimizer`` makes the word embedding bitsandbytes' StableEmbedding: a
LayerNorm after it, xavier init), fp16 with DeepSpeed's dynamic loss scale, ZeRO-1 with
``zero_allow_untested_optimizer``, Adam betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0, cosine decay, init std
sqrt(0.4 / h) (the 104B's rule, 0.006 at h 11600). Run (a) adds ``--embed-layernorm`` so both have the same
architecture; the flag also brings xavier init for the (tied) word embedding, the one model difference, inside the loss
difference measured here. Scaled down: 24 layers x 1024 (GPT-2 medium, ~310M parameters with the 8192 vocab), seq 2048,
MBS 4, GBS 8 (16K tokens per iteration: 200 iterations are ~3.5 epochs of the KJV), lr 3e-4 (GPT-3's for 350M) with 20
iterations of warmup, no activation checkpointing. Under ZeRO-1 the optimizer steps flat fp32 partitions, so every state
is 8-bit (as in BigScience's BNB runs) but for a partition below bitsandbytes' min_8bit_size (4096 values; only the
tiny's).

Text: the KJV Bible (the demo's corpus), byte-level BPE of 8192 trained on it, ~0.94M tokens (``opskit.data.corpus``);
prepared into ``--data`` (default data/bnb-adam) on a machine with Debian's ``bible`` (e.g. by a CPU run of this
script); the GPU machine, offline, rebuilds the tokenizer and dataset from the kjv.jsonl carried in that folder.

Pass: 8-bit Adam's mean lm loss over the last 20 iterations within 2% (relative) of fp32 Adam's. Why 2%: 8-bit
Adam is meant to track 32-bit Adam within run-to-run noise (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"); ``--control`` adds a fp32 run with another seed (other init and data order) to measure that noise.

Usage::

    python bench/bnb_adam.py                              # GPU (carry data/bnb-adam): 200 iterations each
    python bench/bnb_adam.py --control                    # + a fp32 run with seed 2: the seed-to-seed spread
    python bench/bnb_adam.py --device cpu --tiny --iters 10   # CPU smoke (fp32 weights, a tiny model)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from trainer_throughput import PEAK_FLOPS, REPO  # noqa: E402

VOCAB = 8192
SHAPES = {"gpu": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048, micro_batch_size=4,
                      global_batch_size=8, lr=3e-4, min_lr=3e-5),
          "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=4,
                       global_batch_size=8, lr=3e-3, min_lr=3e-4)}
RUNS = {"fp32-adam": ["--embed-layernorm"], "bnb-8bit-adam": ["--use-bnb-optimizer"]}
STATE_LINE = "OPTIMIZER_STATE "
TOLERANCE = 0.02


def trainer_args(shape: dict, data, iters: int, half: bool, deepspeed_config: Path, seed: int) -> list[str]:
    """The trainer's flags shared by both runs (module docstring); ``data`` is a ``PreparedData``."""
    gbs = shape["global_batch_size"]
    flags = {**shape, "max_position_embeddings": shape["seq_length"], "position_embedding_type": "absolute",
             "init_method_std": round(math.sqrt(0.4 / shape["hidden_size"]), 4), "hidden_dropout": 0,
             "attention_dropout": 0, "train_samples": iters * gbs, "lr_decay_style": "cosine",
             "lr_warmup_samples": min(20, iters // 4) * gbs, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8,
             "weight_decay": 0.1, "clip_grad": 1.0, "zero_stage": 1, "deepspeed_config": deepspeed_config,
             "log_interval": 1, "seed": seed, "data_path": data.data_prefix,
             "tokenizer_name_or_path": data.tokenizer_dir}
    args = [f"--{key if key == 'deepspeed_config' else key.replace('_', '-')}={value}" for key, value in flags.items()]
    return [*args, "--fp16"] if half else args


def optimizer_state_bytes(optimizer) -> dict:
    """Bytes of every tensor in the state of the torch optimizer inside DeepSpeed's wrappers (ZeRO, FP16/BF16
    optimizers keep theirs as ``.optimizer``), each storage counted once (bitsandbytes shares its qmaps), by state key;
    with the parameters the optimizer steps (ZeRO's flat fp32 partitions)."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    seen, by_key = set(), {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                by_key[key] = by_key.get(key, 0) + value.nbytes
    params = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return {"optimizer": type(optimizer).__name__, "bytes": sum(by_key.values()), "by_key": by_key,
            "params": params, "bytes_per_param": round(sum(by_key.values()) / params, 4)}


def child(argv: list[str]) -> int:
    """One trainer run in this process; prints the optimizer's state after training (:data:`STATE_LINE`)."""
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from opskit.train.main import main as train_main

    engines = []
    inner_train_batch = PipelineEngine.train_batch

    def train_batch(self, *args, **kwargs):
        engines[:] = [self]
        return inner_train_batch(self, *args, **kwargs)

    PipelineEngine.train_batch = train_batch
    code = train_main(argv)
    state = optimizer_state_bytes(engines[0].optimizer)
    if torch.cuda.is_available():
        state["max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(STATE_LINE + json.dumps(state), flush=True)
    return code


def run(name: str, argv: list[str], cpu: bool, iters: int, tokens_per_iter: int, flops_per_iteration: float
        ) -> dict:
    """One run in its own process (a fresh GPU for its peak memory); its log read back with opskit's log grammar.
    ``flops_per_iteration``: Megatron-DeepSpeed's estimate, from which the log's TFLOPs were computed."""
    from opskit.logs.grammar import parse_iteration_line

    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}))
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
        return {"name": name, "error": f"exit {done.returncode}"}
    lines = done.stdout.splitlines()
    records = {r["iteration"]: r for r in map(parse_iteration_line, lines) if r}
    losses = [records[i]["lm_loss"] for i in range(1, iters + 1) if "lm_loss" in records.get(i, {})]
    window = range(max(2, min(11, iters // 2)), iters + 1)  # after warm-up: compilation, allocator, first step
    tflops = statistics.median(records[i]["tflops"] for i in window)
    # The log's TFLOPs (2 decimals) is more precise than its seconds (10 ms): back to seconds by its own rule.
    steady = flops_per_iteration / (tflops * 1e12)
    peak = [line.split("max allocated: ")[1].split()[0] for line in lines if "max allocated: " in line]
    state = json.loads(next(line for line in lines if line.startswith(STATE_LINE))[len(STATE_LINE):])
    return {"name": name, "iterations_with_loss": len(losses), "skipped_iterations": sum(
                records[i].get("skipped_iterations", 0) for i in records),
            "tokens_per_s": round(tokens_per_iter / steady), "s_per_iter": round(steady, 4),
            "mfu": round(tflops * 1e12 / PEAK_FLOPS, 4) if not cpu else None,
            "lm_loss_at": {i: records[i]["lm_loss"] for i in (iters // 4, iters // 2, 3 * iters // 4, iters)},
            "lm_loss_last20": round(statistics.fmean(losses[-20:]), 4),
            "peak_mem_mb": float(peak[0]) if peak else None, "peak_mem_mb_at_end": state.pop("max_allocated_mb", None),
            "optimizer_state": state}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--tiny", action="store_true", help="The 2 x 64 model (CPU smoke).")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "bnb-adam")
    parser.add_argument("--control", action="store_true", help="Also fp32 Adam with seed 2 (the seed noise).")
    opts = parser.parse_args()

    from opskit.data.corpus import prepare_data
    from opskit.errors import OpskitError
    from opskit.rules.model_size import megatron_flops_per_iteration

    try:  # rebuilt from the folder's kjv.jsonl where its path moved (its manifest has absolute paths)
        data = prepare_data("kjv", opts.data, vocab_size=VOCAB, name="kjv", force=True)
    except OpskitError as err:
        sys.exit(f"{err} (prepare {opts.data} where `bible` runs: python bench/bnb_adam.py --device cpu --tiny "
                 "--iters 4, then carry it)")
    shape = SHAPES["tiny" if opts.tiny else "gpu"]
    tokens_per_iter = shape["global_batch_size"] * shape["seq_length"]
    flops_per_iteration = megatron_flops_per_iteration(shape["global_batch_size"], shape["seq_length"],
                                                       shape["num_layers"], shape["hidden_size"], VOCAB, False)
    runs = [(name, extra, 1) for name, extra in RUNS.items()]
    runs += [("fp32-adam-seed2", RUNS["fp32-adam"], 2)] if opts.control else []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ds_config = Path(tmp) / "ds.json"
        ds_config.write_text('{"zero_allow_untested_optimizer": true}')  # tr8b-104B-bnb.slurm's JSON
        for name, extra, seed in runs:
            argv = [*trainer_args(shape, data, opts.iters, opts.device == "gpu", ds_config, seed), *extra]
            results.append(run(name, argv, opts.device == "cpu", opts.iters, tokens_per_iter, flops_per_iteration))
            print(json.dumps(results[-1]), flush=True)
    if any("error" in r for r in results):
        sys.exit(1)
    fp32, bnb = results[0], results[1]
    relative = (bnb["lm_loss_last20"] - fp32["lm_loss_last20"]) / fp32["lm_loss_last20"]
    summary = {"state_bytes_ratio_fp32_over_8bit": round(fp32["optimizer_state"]["bytes"]
                                                         / bnb["optimizer_state"]["bytes"], 3),
               "loss_last20_relative_difference": round(relative, 4), "tolerance": TOLERANCE,
               "loss_within_tolerance": abs(relative) <= TOLERANCE,
               "tokens_per_s_ratio_8bit_over_fp32": round(bnb["tokens_per_s"] / fp32["tokens_per_s"], 3)}
    if opts.control:
        summary["seed_noise_relative"] = round(results[2]["lm_loss_last20"] / fp32["lm_loss_last20"] - 1, 4)
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
