"""What ``--recompute-granularity selective`` keeps of a layer's activations, and what it costs (issue 50): a stack of
the trainer's transformer layers (``opskit.train.model``, plain torch at TP = 1, bf16, eager) on one GPU, the bytes
allocated after the forward pass of one micro-batch (what autograd keeps for the backward) and the median time of a
forward and backward, with everything kept and with selective recompute, side by side in one process.

    python bench/selective_recompute.py [--layers 7] [--hidden 4096] [--heads 32] [--seq 2048] [--mbs 2] [--alibi]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(selective: bool, args) -> dict:

    import torch

    from opskit.train.model import GPTConfig, ParallelTransformerLayerPipe

    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    ffn_hidden_size=4 * args.hidden, seq_length=args.seq, max_position_embeddings=args.seq,
                    padded_vocab_size=128, position_embedding_type="alibi" if args.alibi else "absolute",
                    hidden_dropout=0.0, attention_dropout=0.0, selective_recompute=selective)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(ParallelTransformerLayerPipe(cfg) for _ in range(args.layers))).cuda().bfloat16()
    x = torch.randn(args.mbs, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times = []
    for _ in range(args.warm + args.steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        out = layers(x)
        kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        layers.zero_grad(set_to_none=True)
        x.grad = None
    sbh = args.seq * args.mbs * args.hidden
    return {"selective": selective, "kept_mib_per_layer": round(kept / args.layers / 2**20, 1),
            "kept_bytes_per_sbh": round(kept / args.layers / sbh, 2),
            "fwd_bwd_s": round(statistics.median(times[args.warm:]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 7), ("hidden", 4096), ("heads", 32), ("seq", 2048), ("mbs", 2), ("warm", 3),
                          ("steps", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--alibi", action="store_true", help="BLOOM's ALiBi (FlexAttention) instead of SDPA causal")
    args = parser.parse_args()
    rows = [measure(selective, args) for selective in (False, True, False, True)]  # interleaved, twice
    print(json.dumps({"shape": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
