"""The bytes of one checkpoint step as the trainer writes it, against ``opskit plan``'s (``checkpoint_bytes``).

Each setting trains the tiny preset reshaped (default: bloom-560m's 24 x 1024, 16 heads, vocabulary padded to
250,880, sequence 2048) for one iteration on its layout and saves ``global_step1``; the step's files
(:func:`opskit.ckpt.format.info.describe_step`) are summed and set beside the plan of the same spec. A bf16 ZeRO-0
step wrote 20.7 GB at TP2 x PP2 under DeepSpeed 0.19.8 before opskit kept its optimizer state to one copy (issue 46).

Usage (the GPU host: 4 GPUs; the data of ``bench/gpu_acceptance.py --prepare``)::

    python bench/ckpt_bytes.py --data data/gpu-acceptance --out $OUT
    python bench/ckpt_bytes.py --data data/gpu-acceptance --settings "bf16 ZeRO-0 TP2xPP2" --layers 4  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (precision, ZeRO stage, TP, PP, DP)
    "bf16 ZeRO-0 TP2xPP2": ("bf16", 0, 2, 2, 1),  # tr11's
    "bf16 ZeRO-1 TP2xDP2": ("bf16", 1, 2, 1, 2),
    "fp16 ZeRO-1 DP4": ("fp16", 1, 1, 1, 4),  # tr1-13B's and tr8's precision
    "fp32 ZeRO-1 PP2xDP2": ("fp32", 1, 1, 2, 2),
}


def spec_file(folder: Path, data: Path, setting: str, layers: int, hidden: int, heads: int, vocab: int,
              seq: int) -> Path:
    """The tiny preset with the shape and the setting's layout and precision: one iteration of one micro-batch per
    DP rank, saved at iteration 1, into ``folder``."""
    precision, zero, tp, pp, dp = SETTINGS[setting]
    raw = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
    raw.pop("variants")
    raw["model"].update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                        max_position_embeddings=seq, precision=precision, pad_vocab_size_to=vocab)
    raw["parallel"].update(gpus_per_node=tp * pp * dp, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp, zero_stage=zero)
    raw["batch"].update(micro_batch_size=1, global_batch_size=dp, train_samples=dp)
    raw["optimizer"]["lr_warmup_samples"] = 0
    raw["data"].update(dir=str(data), name="kjv", vocab_size=1000)
    raw["checkpoint"].update(save_interval=1, log_interval=1)
    raw["slurm"].update(time="30", env={"OMP_NUM_THREADS": "4"})
    raw["paths"]["output"] = str(folder / "run")
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def measure(setting: str, data: Path, scratch: Path, **shape) -> dict:
    """Train the setting's spec one iteration and compare its ``global_step1`` with the plan."""
    from opskit.ckpt.format.info import describe_step
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec
    from opskit.spec.plan import make_plan
    from opskit.submission.render import render_job, trainer_args

    folder = scratch / setting.replace(" ", "_")
    folder.mkdir()
    spec = load_spec(str(spec_file(folder, data, setting, **shape)))
    run = RunPaths.of(spec)
    run.ds_config.parent.mkdir(parents=True, exist_ok=True)
    run.ds_config.write_text(render_job(spec, run).ds_config)
    gpus = spec.parallel.gpus_per_node
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(gpus), "-m", "opskit.train", *trainer_args(spec, run)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result = {"setting": setting, "gpus": gpus, "seconds": round(time.monotonic() - started, 1),
              "planned_bytes": make_plan(spec).memory.checkpoint_bytes}
    if done.returncode != 0:
        return {**result, "error": (done.stdout + done.stderr)[-3000:]}
    step = describe_step(run.checkpoints / "global_step1")
    return {**result, "written_bytes": step.size_bytes, "complete": step.complete,
            "ratio": round(step.size_bytes / result["planned_bytes"], 4),
            "files": len(list((run.checkpoints / "global_step1").iterdir()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "gpu-acceptance")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=250_880)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="Folder for ckpt_bytes.json.")
    opts = parser.parse_args()
    shape = dict(layers=opts.layers, hidden=opts.hidden, heads=opts.heads, vocab=opts.vocab, seq=opts.seq)
    results = []
    for setting in opts.settings:
        with tempfile.TemporaryDirectory(prefix="ckpt-bytes-") as scratch:  # each step deleted before the next
            results.append(measure(setting, opts.data.resolve(), Path(scratch), **shape))
        r = results[-1]
        figure = (f"written {r['written_bytes'] / 1e9:.3f} GB, plan {r['planned_bytes'] / 1e9:.3f} GB, ratio "
                  f"{r['ratio']:.3f}, complete {r['complete']}" if "error" not in r else f"FAILED: {r['error'][-300:]}")
        print(f"{setting:<22} {r['seconds']:>6.1f} s  {figure}", flush=True)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "ckpt_bytes.json").write_text(json.dumps({"shape": shape, "results": results}, indent=1))
    return 0 if all("error" not in r and abs(r["ratio"] - 1) <= 0.05 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
