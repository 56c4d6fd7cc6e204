"""A TP x PP run on GPUs whose checkpoint ``opskit ckpt convert`` turns into a transformers model with the same logits.

Trains a small BLOOM-style model (ALiBi, embed LayerNorm; bf16, ZeRO-1) for a few iterations under
``torchrun --nproc_per_node TP*PP``, saves it, converts the checkpoint with the CLI (fp32), and compares
``BloomForCausalLM``'s logits with the checkpoint's own layers (``opskit.train.inference``, TP and PP merged) on the
same tokens: both compute in fp32 from the same bf16 weights, so they must agree to fp32 rounding.

Usage (GPU machine with TP*PP GPUs)::

    python bench/tp_pp_convert.py --tp 2 --pp 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import BLOOM, REPO, make_data  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ = 8, 1024, 16, 512


def train(out: Path, data: Path, tokenizer: Path, tp: int, pp: int) -> str:
    args = [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "4",
        "--global-batch-size", "16", "--train-samples", str(16 * 20), "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-warmup-samples", "32", "--bf16", "--zero-stage", "1", "--log-interval", "5",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--data-path", str(data), "--tokenizer-name-or-path", str(tokenizer), "--seed", "1",
        "--save", str(out), "--save-interval", "20", *BLOOM,
    ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp)]
    done = subprocess.run([*launcher, "-m", "opskit.train", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        sys.exit(done.stdout[-3000:] + done.stderr[-5000:])
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    opts = parser.parse_args()

    import torch
    from transformers import BloomForCausalLM

    from opskit.train.inference import GPTModel

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, tokenizer = make_data(tmp, tokens=16 * 22 * (SEQ + 1) * 2)
        log = train(tmp / "checkpoints", data, tokenizer, opts.tp, opts.pp)
        print("\n".join(line for line in log.splitlines() if " iteration " in line))
        files = sorted(p.name for p in (tmp / "checkpoints" / "global_step20").iterdir())
        hf_dir = tmp / "hf"
        convert = subprocess.run([sys.executable, "-m", "opskit.cli.app", "ckpt", "convert", str(tmp / "checkpoints"),
                                  "--out", str(hf_dir), "--dtype", "fp32", "--tokenizer", str(tokenizer)],
                                 capture_output=True, text=True, cwd=REPO)
        if convert.returncode != 0:
            sys.exit(convert.stdout + convert.stderr)
        tokens = torch.randint(0, 50257, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = GPTModel.from_checkpoint(tmp / "checkpoints").float()(tokens)
            theirs = BloomForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()(tokens).logits
        vocab = theirs.shape[-1]
        diff = (ours[..., :vocab] - theirs).abs().max().item()
        result = {"tp": opts.tp, "pp": opts.pp, "checkpoint_files": files, "max_abs_logit_diff": diff,
                  "logit_scale": ours.abs().max().item()}
        print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
