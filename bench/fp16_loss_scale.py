"""fp16 with dynamic loss scaling on a GPU: the iteration line's ``loss scale`` and ``number of skipped iterations``.

DeepSpeed has no fp16 on our CPUs, so this is the end-to-end check the CPU tests cannot make. A small GPT-2 trains
for 30 iterations with ZeRO-1 and an initial loss scale of 2^24, far too large: the first steps overflow, DeepSpeed
skips them and halves the scale, and the log must show the scale falling and the skipped count rising, then lm loss
falling once steps go through.

Usage (GPU machine)::

    python bench/fp16_loss_scale.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import REPO, make_data  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, tokenizer = make_data(tmp, tokens=8 * 32 * 513 * 2)
        config = tmp / "ds_config.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
                                      "zero_optimization": {"stage": 1},
                                      "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 24,
                                               "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}}))
        args = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
                "--max-position-embeddings", "512", "--micro-batch-size", "8", "--global-batch-size", "8",
                "--train-samples", str(8 * 30), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-samples", "8",
                "--fp16", "--zero-stage", "1", "--log-interval", "1", "--data-path", str(data),
                "--tokenizer-name-or-path", str(tokenizer), "--seed", "1", "--deepspeed_config", str(config)]
        done = subprocess.run([sys.executable, "-m", "opskit.train", *args], capture_output=True, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        print("\n".join(line for line in done.stdout.splitlines() if " iteration " in line))
        if done.returncode != 0:
            sys.exit(done.stdout[-3000:] + done.stderr[-5000:])


if __name__ == "__main__":
    main()
