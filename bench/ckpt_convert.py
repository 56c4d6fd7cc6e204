"""Conversion speed and peak memory: `opskit ckpt convert` against transformers 4.46.3's own BLOOM converter
(`convert_bloom_original_checkpoint_to_pytorch.py --shard_model`, its low-memory mode), on the same Megatron-DeepSpeed
BLOOM checkpoint, one after the other, files already in the page cache for both.

    python bench/ckpt_convert.py build /tmp/bench-ckpt   # ~6.9 GB: BLOOM h=4096, 12 layers, V=250880, TP=4, bf16
    python bench/ckpt_convert.py run /tmp/bench-ckpt --baseline-python /tmp/venv-tf446/bin/python

Peak RSS is the child's ``ru_maxrss`` (``os.wait4``); time is wall-clock. ``--out /dev/shm/...`` takes the output
disk out of the measurement (both converters write ~6.4 GB; a disk that writes 230 MB/s bounds both otherwise); it
needs room for both outputs. Every tensor of the two outputs is compared at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def build(root: Path, hidden: int, layers: int, heads: int, vocab: int, tp: int) -> Path:
    """A BLOOM checkpoint in Megatron-DeepSpeed layout, written one layer at a time (random bf16 weights)."""
    step = root / "global_step1000"
    step.mkdir(parents=True)

    def save(index: int, full: dict[str, torch.Tensor]) -> None:
        for rank in range(tp):
            shard = {}
            for key, tensor in full.items():
                if tensor.dim() == 1 and not key.endswith(("query_key_value.bias", "dense_h_to_4h.bias")):
                    shard[key] = tensor.clone()
                else:
                    dim = 1 if key.endswith(("dense.weight", "dense_4h_to_h.weight")) else 0
                    shard[key] = torch.chunk(tensor, tp, dim=dim)[rank].clone()
            torch.save(shard, step / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")

    def rand(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16).normal_(std=0.02)

    save(1, {"word_embeddings.weight": rand(vocab, hidden), "word_embeddings.norm.weight": torch.ones(hidden,
             dtype=torch.bfloat16), "word_embeddings.norm.bias": torch.zeros(hidden, dtype=torch.bfloat16)})
    for i in range(layers):
        save(3 + i, {
            "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16), "input_layernorm.bias": rand(hidden),
            "self_attention.query_key_value.weight": rand(3 * hidden, hidden),
            "self_attention.query_key_value.bias": rand(3 * hidden),
            "self_attention.dense.weight": rand(hidden, hidden), "self_attention.dense.bias": rand(hidden),
            "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "post_attention_layernorm.bias": rand(hidden),
            "mlp.dense_h_to_4h.weight": rand(4 * hidden, hidden), "mlp.dense_h_to_4h.bias": rand(4 * hidden),
            "mlp.dense_4h_to_h.weight": rand(hidden, 4 * hidden), "mlp.dense_4h_to_h.bias": rand(hidden),
        })
    save(layers + 4, {"weight": torch.ones(hidden, dtype=torch.bfloat16), "bias": rand(hidden)})
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads, seq_length=2048,
        max_position_embeddings=2048, position_embedding_type="alibi", embed_layernorm=True, padded_vocab_size=vocab,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, fp16=False, consumed_train_samples=0,
        tokenizer_name_or_path=str(root / "tokenizer"), data_path=["none"])
    for rank in range(tp):
        torch.save({"args": args, "iteration": 1000, "tokens": 0}, step / f"mp_rank_{rank:02d}_model_states.pt")
    (root / "latest").write_text(step.name)
    _tokenizer(root / "tokenizer")
    return step


def _tokenizer(folder: Path) -> None:
    """A small real BPE tokenizer (tokenizers library) so that the converted folder is complete."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["In the beginning God created the heaven and the earth."] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(folder)


def measure(command: list[str]) -> tuple[float, float, float]:
    """(wall seconds, wall seconds until the output is on disk, peak RSS in GB) of a child process: ``os.sync()``
    after it exits, timed too, so a converter that leaves dirty pages behind pays their writing like one that
    fsyncs (opskit fsyncs each shard before renaming the folder into place)."""
    os.sync()
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[:3]} failed with {os.waitstatus_to_exitcode(status)}")
    os.sync()
    return elapsed, time.perf_counter() - started, usage.ru_maxrss / 1024**2


def same_tensors(ours: Path, theirs: Path) -> int:
    """Compare every tensor of transformers' shards (``BloomModel`` keys) with ours (``transformer.``-prefixed);
    returns how many; raises on the first difference."""
    import json

    from safetensors import safe_open

    weight_map = json.loads((ours / "model.safetensors.index.json").read_text())["weight_map"]
    compared = 0
    for shard in sorted(theirs.glob("pytorch_model_*.bin")):
        for key, tensor in torch.load(shard, map_location="cpu", weights_only=True).items():
            with safe_open(ours / weight_map[f"transformer.{key}"], "pt") as f:
                if not torch.equal(f.get_tensor(f"transformer.{key}"), tensor.to(torch.bfloat16)):
                    raise SystemExit(f"{key} differs between the two conversions")
            compared += 1
    return compared


def run(root: Path, baseline_python: str, out: Path, tp: int, workers: int | None = None,
        baseline_first: bool = False) -> None:
    step = root / "global_step1000"
    size = sum(f.stat().st_size for f in step.iterdir()) / 1024**3
    largest = max(f.stat().st_size for f in step.glob("layer_*")) / 1024**3
    for f in step.iterdir():  # page cache warm for both converters
        with open(f, "rb") as handle:
            while handle.read(64 << 20):
                pass
    shutil.rmtree(out, ignore_errors=True)
    (out / "transformers").mkdir(parents=True)  # its --shard_model mode does not create the folder
    def ours_run():
        return measure([sys.executable, "-m", "opskit.cli.app", "ckpt", "convert", str(step), "--out",
                        str(out / "opskit"), "--dtype", "bf16", "--no-verify",
                        *(["--workers", str(workers)] if workers else [])])

    def theirs_run():
        return measure([baseline_python, "-m",
                        "transformers.models.bloom.convert_bloom_original_checkpoint_to_pytorch",
                        "--bloom_checkpoint_path", str(step), "--pytorch_dump_folder_path", str(out / "transformers"),
                        "--shard_model", "--pretraining_tp", str(tp)])

    if baseline_first:  # on a VM that hands freed memory back, the first converter pays for faulting it in again
        theirs, ours = theirs_run(), ours_run()
    else:
        ours, theirs = ours_run(), theirs_run()
    print(f"opskit ckpt convert: {ours[0]:.1f} s", flush=True)
    compared = same_tensors(out / "opskit", out / "transformers")
    shutil.rmtree(out)
    print(f"checkpoint {size:.2f} GB, largest layer file {largest:.2f} GB, bound 2x+1 GB = {2 * largest + 1:.2f} GB")
    print("                      wall s   GB/s  wall+sync s   GB/s  peak RSS GB")
    for name, (wall, durable, rss) in (("opskit ckpt convert", ours), ("transformers 4.46.3", theirs)):
        print(f"{name:20s} {wall:7.1f} {size / wall:6.2f} {durable:12.1f} {size / durable:6.2f} {rss:12.2f}")
    print(f"outputs: {compared} tensors compared, all equal")
    print(f"speed-up {theirs[0] / ours[0]:.2f}x (wall), {theirs[1] / ours[1]:.2f}x (wall+sync); "
          f"peak memory ratio {ours[2] / theirs[2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["build", "run"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=250880)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--baseline-python", default="/tmp/venv-tf446/bin/python")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-ckpt-out"))
    parser.add_argument("--workers", type=int, help="opskit's --workers (writer threads; default its own, 2)")
    parser.add_argument("--baseline-first", action="store_true", help="run transformers' converter first")
    options = parser.parse_args()
    if options.what == "build":
        build(options.root, options.hidden, options.layers, options.heads, options.vocab, options.tp)
    else:
        run(options.root, options.baseline_python, options.out, options.tp, options.workers, options.baseline_first)


if __name__ == "__main__":
    main()
