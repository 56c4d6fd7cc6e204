"""Throughput of opskit's trainer on one GPU, next to Hugging Face transformers in the same run.

Model: the 1.3B GPT-2 shape of the reference baselines (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304),
micro-batch 4, bf16, ZeRO-1, one process. Data: random tokens in a Megatron indexed dataset (speed only; nothing is
learned). The trainer runs as users run it (``python -m opskit.train``) and its own log lines give the seconds per
iteration; MFU = Megatron's model FLOPs without recompute / 989 TFLOP/s (H100 dense bf16).

Usage (on a GPU machine, DeepSpeed and megatron-core installed)::

    python bench/trainer_throughput.py [gpt] [bloom] [hf] [hf-bloom] --iters 30 --out results.json
    python bench/trainer_throughput.py gpt-compile --mbs 8 --gpus 1 2 4        # DP weak scaling
    python bench/trainer_throughput.py bare gpt-compile --mbs 4 --gas 16       # issue 19: vs the bare model
    python bench/trainer_throughput.py mcore bare gpt-compile --mbs 4 --gas 16 # and megatron-core's GPTModel
    python bench/trainer_throughput.py titan gpt-compile --mbs 4 --gas 16      # and torchtitan's Llama 3 1B
    python bench/trainer_throughput.py gpt digest                              # issue 48: the replica digests' cost
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from opskit.logs.grammar import parse_memory_line
from opskit.rules.model_size import padded_vocab_size

REPO = Path(__file__).resolve().parents[1]
L, H, HEADS, S, VOCAB = 24, 2048, 16, 2048, 50257
PADDED_VOCAB = padded_vocab_size(VOCAB, 128, 1)  # the trainer's: 50304 at TP=1, Megatron's default multiple
PEAK_FLOPS = float(os.environ.get("PEAK", "989e12"))
BLOOM = ["--position-embedding-type", "alibi", "--embed-layernorm"]
TRAINER_VARIANTS = {"gpt": [], "gpt-compile": ["--torch-compile"], "bloom": BLOOM,
                    "bloom-compile": [*BLOOM, "--torch-compile"]}


def model_flops(batch: int, padded_vocab: int = PADDED_VOCAB) -> float:
    """Megatron's FLOPs per iteration without recompute: 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    return 72 * batch * S * L * H * H * (1 + S / (6 * H) + padded_vocab / (12 * L * H))


def memory_lines(stdout: str) -> list[dict]:
    """The trainer's memory lines in ``stdout``, any rank (:func:`opskit.logs.grammar.parse_memory_line`; MiB)."""
    return [r for line in stdout.splitlines() if (r := parse_memory_line(line)) is not None]


def median_step_seconds(step, warm: int, steps: int):
    """Run ``step()`` ``warm + steps`` times, each between two device synchronizes; the median seconds of the last
    ``steps`` and the last step's return value (the bare and peer models of bench/bare_gpt.py, bench/mcore_gpt.py)."""
    import time

    import torch

    times, result = [], None
    for _ in range(warm + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[warm:])[len(times[warm:]) // 2], result


def step_result(name: str, mbs: int, gas: int, seconds: float, loss) -> dict:
    """The JSON line of a model timed by :func:`median_step_seconds`: tokens/s, MFU (``model_flops``), peak memory."""
    import torch

    return {"name": name, "mbs": mbs, "gas": gas, "s_per_iter": round(seconds, 4),
            "tokens_per_s": round(mbs * gas * S / seconds),
            "mfu": round(model_flops(mbs * gas) / seconds / PEAK_FLOPS, 4),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1), "loss": round(loss.item(), 3)}


def make_data(folder: Path, tokens: int) -> tuple[Path, Path]:
    """Random tokens as one indexed dataset, and a word-level tokenizer.json with VOCAB entries."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    prefix = folder / "random_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(tokens // 8192):
        builder.add_item(torch.from_numpy(rng.integers(0, VOCAB, 8192, dtype=np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    tokenizer_dir = folder / "tokenizer"
    tokenizer_dir.mkdir()
    Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(tokenizer_dir / "tokenizer.json"))
    return prefix, tokenizer_dir


def plan_gib(mbs: int, gas: int, gpus: int, extra: list[str]) -> float:
    """``opskit plan``'s memory estimate (GiB per GPU) for the run: bench/specs/gpt2-1.3B.yaml (this file's shape) at
    this micro-batch, global batch and DP, with BLOOM's ALiBi and embedding LayerNorm and ``torch_compile`` when
    ``extra`` has them."""
    from opskit.spec.load import load_spec
    from opskit.spec.plan import make_plan

    overrides = {"batch": {"micro_batch_size": mbs, "global_batch_size": mbs * gas * gpus,
                           "train_samples": mbs * gas * gpus * 100},
                 "optimizer": {"lr_warmup_samples": mbs * gas * gpus}, "parallel": {"gpus_per_node": gpus}}
    if "alibi" in extra:
        overrides["model"] = {"position_embedding_type": "alibi", "embed_layernorm": True}
    if "--torch-compile" in extra:
        overrides["megatron_args"] = {"torch_compile": True}
    return make_plan(load_spec(str(REPO / "bench" / "specs" / "gpt2-1.3B.yaml"), overrides)).memory.total_gib_per_gpu


def trainer_flags(mbs: int, gbs: int, iters: int, data: Path, tokenizer: Path, extra: list[str],
                  log_interval: int = 5) -> list[str]:
    """``python -m opskit.train``'s flags for this file's 1.3B GPT-2: bf16, ZeRO-1, ``iters`` iterations of ``gbs``
    samples, ``extra`` appended."""
    return [
        "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length", str(S),
        "--max-position-embeddings", str(S), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
        "--train-samples", str(gbs * iters), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-samples", str(gbs),
        "--bf16", "--zero-stage", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--log-interval", str(log_interval), "--data-path", str(data), "--tokenizer-name-or-path", str(tokenizer),
        "--seed", "1", *extra,
    ]


def run_trainer(name: str, extra: list[str], data: Path, tokenizer: Path, iters: int, mbs: int, gpus: int = 1,
                gas: int = 1) -> dict:
    """One trainer run at data parallelism ``gpus`` (torchrun when > 1), global batch ``mbs * gas * gpus`` (``gas``
    micro-batches per GPU and iteration, so weak scaling). ``tokens_per_s`` counts all GPUs; ``mfu`` is per GPU."""
    gbs = mbs * gas * gpus
    args = trainer_flags(mbs, gbs, iters, data, tokenizer, extra)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)] if gpus > 1 else \
        [sys.executable]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([*launcher, "-m", "opskit.train", *args], capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
        return {"name": name, "gpus": gpus, "error": f"exit {done.returncode}"}
    # The log's TFLOPs (2 decimals) is more precise than its seconds; it is Megatron-DeepSpeed's estimate (a V/(16lh)
    # vocabulary term), so the seconds come back through that same rule, not through model_flops (V/(12lh)).
    from opskit.rules.model_size import megatron_flops_per_iteration

    tflops = [float(t) for t in re.findall(r"TFLOPs: ([\d.]+)", done.stdout)]
    steady_tflops = statistics.median(tflops[1:]) if len(tflops) > 1 else tflops[0]  # window 1 holds warm-up
    steady = megatron_flops_per_iteration(gbs, S, L, H, PADDED_VOCAB, False) / (steady_tflops * 1e12 * gpus)
    peak = [r["max_allocated_mib"] for r in memory_lines(done.stdout)]
    return {"name": name, "gpus": gpus, "mbs": mbs, "gas": gas, "s_per_iter": round(steady, 4),
            "tokens_per_s": round(gbs * S / steady),
            "mfu": round(model_flops(gbs) / gpus / steady / PEAK_FLOPS, 4), "log_tflops": steady_tflops,
            "peak_mem_gb": round(max(peak) / 1024, 1) if peak else None,
            "plan_mem_gb": round(plan_gib(mbs, gas, gpus, extra), 1)}


def run_digest(results: list[dict], interval: int = 100) -> dict:
    """The replica digest check's cost (issue 48, opskit.train.replica_digest): its per-parameter digests of this
    file's 1.3B GPT-2 parameters (bf16, the trainer's shapes) timed on the GPU, against the iteration time of the
    trainer run before it in ``results``, at the spec's default interval. The check's all-gather (one int64 per
    parameter tensor, ~300) is not timed: at DP 1 there is no one to gather from, and it is a few KB."""
    import torch

    from opskit.train.replica_digest import parameter_digests

    def bf16(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="cuda").normal_()

    layer = [bf16(H), bf16(H), bf16(3 * H, H), bf16(3 * H), bf16(H, H), bf16(H), bf16(H), bf16(H),
             bf16(4 * H, H), bf16(4 * H), bf16(H, 4 * H), bf16(H)]
    params = [bf16(PADDED_VOCAB, H), bf16(S, H), *(p.clone() for _ in range(L) for p in layer), bf16(H), bf16(H)]
    seconds, _ = median_step_seconds(lambda: parameter_digests(params), warm=3, steps=20)
    trained = next((r for r in reversed(results) if "s_per_iter" in r and r["name"].startswith("opskit")), None)
    result = {"name": "replica-digest", "parameters": sum(p.numel() for p in params), "tensors": len(params),
              "digest_ms": round(seconds * 1000, 3), "interval": interval}
    if trained is not None:
        result["cost_of_iteration_time"] = round(seconds / (interval * trained["s_per_iter"]), 6)
    return result


def run_hf(which: str, iters: int, mbs: int, gas: int = 1) -> dict:
    """The bare compiled model (``bare``, ``bare-bloom``: bench/bare_gpt.py) or a reference baseline run of
    ``$GPU_BASELINE`` (``hf``, ``hf-bloom``) under the same DeepSpeed config, or the megatron-core peer (``mcore``,
    ``mcore-sdpa``: bench/mcore_gpt.py, its own DDP and distributed optimizer) or torchtitan's Llama 3 1B
    (``titan``: bench/titan_llama.py, its own compile and one-GPU bf16 autocast)."""
    env = dict(os.environ, MBS=str(mbs), GAS=str(gas), STEPS=str(iters), PYTHONUNBUFFERED="1")
    if which == "titan":
        command = [sys.executable, str(REPO / "bench" / "titan_llama.py")]
    elif which.startswith("mcore"):
        env["ATTN"] = "sdpa" if which == "mcore-sdpa" else "local"
        command = [sys.executable, str(REPO / "bench" / "mcore_gpt.py")]
    elif which.startswith("bare"):
        env["ALIBI"] = "1" if which == "bare-bloom" else "0"
        command = [sys.executable, str(REPO / "bench" / "bare_gpt.py")]
    else:
        command = [sys.executable, os.environ.get("GPU_BASELINE", str(REPO / "bench" / "gpu_baseline.py")), which]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        return {"name": which, "error": f"exit {done.returncode}"}
    return lines[-1]


def report_weak_scaling(results: list[dict]) -> None:
    """Per variant: tokens/s at N GPUs over N x tokens/s at 1 GPU."""
    single = {r["name"]: r["tokens_per_s"] for r in results if r.get("gpus") == 1 and "tokens_per_s" in r}
    for r in results:
        if r.get("gpus", 1) > 1 and r["name"] in single and "tokens_per_s" in r:
            r["weak_scaling_efficiency"] = round(r["tokens_per_s"] / (r["gpus"] * single[r["name"]]), 4)
            print(f"WEAK SCALING {r['name']} 1 -> {r['gpus']} GPUs: {r['weak_scaling_efficiency']:.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("which", nargs="*", default=["gpt", "hf"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--gas", type=int, default=1, help="Micro-batches per optimizer step and GPU.")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1], help="DP sizes to run each trainer variant at.")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if opts.iters < 11 and any(which in TRAINER_VARIANTS for which in opts.which):
        # The trainer's speed is read from its 5-iteration log windows after the first (compilation, warm-up).
        parser.error("--iters must be at least 11 for a trainer variant "
                     "(a 5-iteration log window after the first, which holds compilation)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data, tokenizer = make_data(Path(tmp), tokens=(opts.iters + 5) * opts.mbs * opts.gas * max(opts.gpus)
                                    * (S + 1) * 2)
        for which in opts.which:
            if which in TRAINER_VARIANTS:
                for gpus in opts.gpus:
                    results.append(run_trainer(f"opskit-{which}", TRAINER_VARIANTS[which], data, tokenizer,
                                               opts.iters, opts.mbs, gpus, opts.gas))
                    print(json.dumps(results[-1]), flush=True)
            elif which == "digest":
                results.append(run_digest(results))
                print(json.dumps(results[-1]), flush=True)
            else:
                results.append(run_hf(which, opts.iters, opts.mbs, opts.gas))
                print(json.dumps(results[-1]), flush=True)
        report_weak_scaling(results)
    if opts.out:
        Path(opts.out).write_text(json.dumps(results, indent=2))
    print("SUMMARY", json.dumps(results))


if __name__ == "__main__":
    main()
