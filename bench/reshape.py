"""Time and peak memory of a checkpoint reshape: opskit's conversion against DeepSpeed's own ``ds_to_universal``, on
the same trainer checkpoint, side by side in the same run.

The checkpoint (setup, not timed; cached, so a rerun reuses it): a GPT-2-style model (absolute positions, no embedding
LayerNorm; default 20 layers, hidden 1024, 16 heads, vocabulary 2000 -> padded 2048, seq 128: 254M parameters, the
largest whose 8 ranks stay under ~12 GiB, docs/benchmarks.md#reshaping-a-checkpoint), bf16 with ZeRO-1, trained one
iteration by opskit's trainer at TP=2 x PP=2 x DP=2 (``torchrun`` with 8 processes, gloo, CPU; micro-batch 1, global
batch 2), saved as ``global_step1``. Data: the KJV corpus (``opskit.data.corpus.prepare_data``).

Measured, each as a child process from interpreter start to exit, checkpoint files in the page cache for both:

- opskit as users run it: ``opskit ckpt reshape STEP --tp 1 --pp 1 --dp 1 --out OUT`` when ``opskit ckpt reshape
  --help`` exists, else the library call under it, ``opskit.ckpt.format.universal.convert_to_universal(STEP, OUT,
  verify=True)``, through ``python -c``;
- DeepSpeed: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder STEP --output_folder OUT`` (its own
  defaults: 4 extraction and 2 merge processes), and with ``--num_extract_workers 1 --num_merge_workers 1`` (one
  process, as opskit runs it) unless ``--no-single``.

Peak memory: the process tree's summed RSS, sampled every 20 ms (psutil), and the largest single process's
``ru_maxrss`` (``os.wait4``: the child and its reaped descendants). Time: wall-clock until exit, and until an
``os.sync()`` after it has written the output too.

    nice -n 10 python bench/reshape.py [--rounds 3] [--layers 20 --hidden 1024 --heads 16] [--cache DIR]
    nice -n 10 python bench/reshape.py --resume      # also: one trainer start from the universal form (optional)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TP, PP, DP = 2, 2, 2
SEQ, VOCAB = 128, 2000
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "opskit-bench" / "reshape"


def trainer_flags(data, out: Path | None, layers: int, hidden: int, heads: int, **extra) -> list[str]:
    """The trainer's flags for the bench model (after tests/conftest.py's tiny_trainer_args, GPT-2 style); ``extra``
    replaces or adds flags (``True`` a switch, ``None`` removes one)."""
    flags = {
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": SEQ,
        "max_position_embeddings": SEQ, "position_embedding_type": "absolute", "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "micro_batch_size": 1, "global_batch_size": 2, "train_samples": 2, "lr": 3e-4,
        "min_lr": 3e-5, "lr_decay_style": "cosine", "lr_warmup_samples": 0, "seed": 1234, "log_interval": 1,
        "bf16": True, "zero_stage": 1, "tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP,
        "data_path": data.data_prefix, "tokenizer_name_or_path": data.tokenizer_dir, "save": out,
        "save_interval": 1, **extra,
    }
    args: list[str] = []
    for key, value in flags.items():
        if value is None:
            continue
        args.append("--" + key.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return args


def torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(29500 + os.getpid() % 1000), "-m", "opskit.train", *args]


def trainer_env(nproc: int) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else "2", PYTHONUNBUFFERED="1")


def build(cache: Path, layers: int, hidden: int, heads: int) -> Path:
    """The cached checkpoint's step folder, trained here if missing (the folder appears only complete)."""
    from opskit.data.corpus import prepare_data

    folder = cache / f"gpt-l{layers}-h{hidden}-a{heads}-tp{TP}pp{PP}dp{DP}-bf16-zero1"
    step = folder / "checkpoints" / "global_step1"
    if step.is_dir():
        return step
    data = prepare_data("kjv", cache / "kjv", vocab_size=VOCAB, name="kjv")
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"building {folder.name} (8 processes, not timed) ...", flush=True)
    log = staging / "train.log"
    with open(log, "w") as handle:
        took = measure(torchrun(TP * PP * DP, trainer_flags(data, staging / "checkpoints", layers, hidden, heads)),
                       stdout=handle, env=trainer_env(TP * PP * DP))
    if not (staging / "checkpoints" / "global_step1").is_dir():
        raise SystemExit(f"the trainer saved no global_step1; see {log}")
    (staging / "build.json").write_text(json.dumps(took))
    print(f"built in {took['wall_s']:.0f} s, peak RSS of the 8 ranks {took['tree_rss_gb']:.2f} GB", flush=True)
    os.replace(staging, folder)
    return step


def measure(command: list[str], stdout=subprocess.DEVNULL, env: dict | None = None) -> dict:
    """Wall seconds (until exit, and until an ``os.sync()`` after it), the process tree's peak summed RSS (GB, sampled
    every 20 ms) and the largest single process's ``ru_maxrss`` (GB) of a child."""
    import psutil

    os.sync()
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT if stdout is not subprocess.DEVNULL
                             else subprocess.DEVNULL, env=env, cwd=REPO)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(child.pid)
        while not done.is_set():
            total = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    with _gone_ok():
                        total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                return
            peak[0] = max(peak[0], total)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _pid, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed with {os.waitstatus_to_exitcode(status)}")
    os.sync()
    return {"wall_s": wall, "synced_s": time.perf_counter() - started, "tree_rss_gb": peak[0] / 1024**3,
            "max_rss_gb": usage.ru_maxrss / 1024**2, "cpu_s": usage.ru_utime + usage.ru_stime}


class _gone_ok:
    """Ignore a process that exited between listing and reading it."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        import psutil

        return kind is not None and issubclass(kind, psutil.NoSuchProcess)


def opskit_command(step: Path, out: Path) -> tuple[str, list[str]]:
    """opskit's conversion as users run it: the CLI once it exists, the library call under it until then."""
    cli = [sys.executable, "-m", "opskit.cli.app", "ckpt", "reshape"]
    has_cli = subprocess.run([*cli, "--help"], capture_output=True, cwd=REPO).returncode == 0
    if has_cli:
        return "opskit ckpt reshape", [*cli, str(step), "--tp", "1", "--pp", "1", "--dp", "1", "--out", str(out)]
    code = ("from pathlib import Path; from opskit.ckpt.format.universal import convert_to_universal; "
            f"convert_to_universal(Path({str(step)!r}), Path({str(out)!r}), verify=True)")
    return "convert_to_universal(verify=True)", [sys.executable, "-c", code]


def ds_command(step: Path, out: Path, single: bool) -> list[str]:
    workers = ["--num_extract_workers", "1", "--num_merge_workers", "1"] if single else []
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step),
            "--output_folder", str(out), *workers]


def warm(step: Path) -> None:
    """Read every file of the step once, so that both converters find it in the page cache."""
    for f in step.iterdir():
        with open(f, "rb") as handle:
            while handle.read(64 << 20):
                pass


def size_gb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1024**3


def resume_start(step: Path, cache: Path, layers: int, hidden: int, heads: int, nproc: int, tp: int, pp: int) -> dict:
    """One trainer start that loads ``step``'s run at TP=tp PP=pp DP=nproc/(tp*pp) and trains one more iteration
    (no ``--save``): the cost of a resume there, conversion excluded when the universal form is already beside it."""
    from opskit.data.corpus import prepare_data

    data = prepare_data("kjv", cache / "kjv", vocab_size=VOCAB, name="kjv")
    dp = nproc // (tp * pp)
    flags = trainer_flags(data, None, layers, hidden, heads, load=step.parent, train_samples=4,
                          global_batch_size=max(2, dp), save_interval=None, tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp, use_checkpoint_lr_scheduler=True)
    launcher = torchrun(nproc, flags) if nproc > 1 else [sys.executable, "-m", "opskit.train", *flags]
    log = cache / f"resume-tp{tp}pp{pp}dp{dp}.log"
    with open(log, "w") as handle:
        result = measure(launcher, stdout=handle, env=trainer_env(nproc))
    result["layout_line"] = next((line.strip() for line in log.read_text().splitlines()
                                  if "checkpoint layout" in line), "")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"checkpoint cache (default {DEFAULT_CACHE})")
    parser.add_argument("--out", type=Path, help="where the conversions are written (default CACHE/out; removed)")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the order rotated each round")
    parser.add_argument("--no-single", action="store_true", help="skip ds_to_universal with 1 worker")
    parser.add_argument("--resume", action="store_true", help="also time a trainer start from the universal form")
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args()

    step = build(opts.cache, opts.layers, opts.hidden, opts.heads)
    out = opts.out or opts.cache / "out"
    name, ours = opskit_command(step, out / "opskit")
    runs = {name: ours, "ds_to_universal": ds_command(step, out / "ds", single=False)}
    if not opts.no_single:
        runs["ds_to_universal, 1 worker"] = ds_command(step, out / "ds1", single=True)
    print(f"checkpoint {step} ({size_gb(step):.2f} GiB, {len(list(step.iterdir()))} files)", flush=True)
    results: dict[str, list[dict]] = {label: [] for label in runs}
    labels = list(runs)
    for round_ in range(opts.rounds):
        order = labels[round_ % len(labels):] + labels[:round_ % len(labels)]
        for label in order:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            warm(step)
            result = measure(runs[label])
            result["output_gib"] = size_gb(out)
            results[label].append(result)
            print(f"round {round_ + 1} {label:34s} {result['wall_s']:7.1f} s (+sync {result['synced_s']:6.1f} s) "
                  f"CPU {result['cpu_s']:6.1f} s  tree RSS {result['tree_rss_gb']:5.2f} GB  largest process "
                  f"{result['max_rss_gb']:5.2f} GB  output {result['output_gib']:.2f} GiB", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    theirs = results["ds_to_universal"]
    for label in labels:
        if label != "ds_to_universal":
            ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(results[label], theirs, strict=True)]
            print(f"{label} / ds_to_universal (wall): " + ", ".join(f"{r:.2f}x" for r in ratios))
    report = {"step": str(step), "step_gib": size_gb(step), "command": runs, "results": results}
    if opts.resume:
        from opskit.ckpt.format.universal import convert_to_universal

        convert_to_universal(step)  # beside the step, where the trainer looks; reused when there
        report["resume"] = {
            "universal, TP=1 PP=1 DP=1": resume_start(step, opts.cache, opts.layers, opts.hidden, opts.heads, 1, 1, 1),
            "same layout, TP=2 PP=2 DP=2": resume_start(step, opts.cache, opts.layers, opts.hidden, opts.heads,
                                                        TP * PP * DP, TP, PP),
        }
        for label, result in report["resume"].items():
            print(f"resume, {label}: {result['wall_s']:.1f} s, tree RSS {result['tree_rss_gb']:.2f} GB "
                  f"({result['layout_line'] or 'no layout line'})")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
