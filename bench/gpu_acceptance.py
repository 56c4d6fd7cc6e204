"""GPU acceptance: every trainer path a CPU cannot prove, run under NCCL on one host of 4 GPUs, one table of PASS/FAIL.

Rows (a tiny BLOOM: 4 layers, hidden 128, 4 heads, seq 128, the KJV with a 1000-token vocabulary, ALiBi, embedding
LayerNorm, clip 1.0, GBS 16 of MBS 2, 20 iterations saved at 10 and 20; each resume loads a copy of a run's
``global_step10`` and is compared with that run's iterations 11..20):

1. ``resume TP2xPP2 bf16 ZeRO-0``: tr11's choices; the same-layout resume must give the uninterrupted losses exactly,
   with dropout 0.1 (tr1-13B's and tr8's: the CUDA generators under NCCL, attention's dropout in the TP region).
   The same saved in the background (``--async-save``: pinned copies on the CUDA stream, writer threads): the run's
   losses are the synchronous run's, and its ``global_step10`` resumes exactly. The same with
   ``--sequence-parallel``: losses within ``LAYOUT_REL`` of the run without (dropout 0: the split draws other
   masks), and with dropout an exact resume of its own step. On 2 GPUs all use PP2 (sequence parallelism then splits
   nothing). Every other run trains without dropout: a layout change draws other masks.
2. every layout change README's "Changing the number of nodes" promises, each within ``LAYOUT_REL`` (the CPU tests'
   bf16 bound) of its uninterrupted run: TP2xPP2 -> DP4, TP2xPP2 -> TP2xDP2, DP4 -> TP2xPP2 (bf16 ZeRO-0),
   DP4 -> TP2xDP2 (bf16 ZeRO-1), DP4 -> DP2 (fp16 ZeRO-1), DP2 -> DP4 (8-bit Adam, fp32 ZeRO-0). A host of 2 GPUs
   checks PP2 -> DP2, TP2 -> PP2 (bf16 ZeRO-0) and DP2 -> TP2 (bf16 ZeRO-1) instead; rows 4 then run on DP2.
3. ``opskit ckpt check`` and ``opskit ckpt convert`` (the CLI, as users run it) of the TP2xPP2 run's
   ``global_step20``: check OK, and the converted transformers model's logits against the checkpoint's own forward
   (opskit.train.inference: the trainer's layers, TP and PP merged) on the same tokens.
4. one rank crashed (the test fault hook, local rank 1 after iteration 3): torchrun ends the job, and
   :func:`opskit.logs.crash.find_crashes` names local rank 1; one rank hung: every rank's faulthandler dump comes
   (``--stack-dump-after-mins``), and :func:`opskit.logs.stacks.stuck_ranks` names local rank 1.
5. smoke: the 1.3B GPT-2 of bench/trainer_throughput.py (eager, bf16 ZeRO-1, MBS 8 x 4 micro-batches) at DP 1 and
   4, weak scaling >= ``WEAK_SCALING_MIN``.

Runs of rows 1-4 share the GPUs (they are start-up bound; each has its own torchrun ``--standalone`` rendezvous);
row 5 runs alone after them. Each run is ``torchrun --max_restarts 0 --tee 3 -m opskit.train``, as the job script
starts it, so the log lines carry torchrun's ``[defaultN]:`` prefixes that the crash and stack readers parse.

Usage::

    python bench/gpu_acceptance.py --prepare data/gpu-acceptance       # here, once: KJV (Debian's bible-kjv)
    python bench/gpu_acceptance.py --data data/gpu-acceptance --out $OUT  # the GPU host (4 GPUs)
    python bench/gpu_acceptance.py --data data/gpu-acceptance --gpus 2    # what 2 GPUs allow (rows needing 4 skip)

On a machine without GPUs the same rows run on gloo (fp16 and the throughput row skip): a check that the script
runs, not of CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
ITERATIONS, SAVED, GBS, MBS = 20, 10, 16, 2
TINY = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--position-embedding-type", "alibi", "--embed-layernorm",
        "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-samples", str(GBS * ITERATIONS),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-samples", str(GBS * 2),
        "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
        "--log-interval", "1", "--save-interval", str(SAVED)]
PRECISIONS = {
    "bf16 ZeRO-0": ["--bf16", "--zero-stage", "0"],
    "bf16 ZeRO-1": ["--bf16", "--zero-stage", "1"],
    "fp16 ZeRO-1": ["--fp16", "--zero-stage", "1"],
    "8-bit Adam": ["--use-bnb-optimizer", "--zero-stage", "0"],
}
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # after TINY's 0: argparse keeps the last
# bf16 keeps 8 significant bits: a layout change reorders reductions, so losses agree to a quarter of bf16's
# relative step (2**-8), the bound of tests/test_reshape.py; the same-layout resume must be exact.
LAYOUT_REL = 1e-3
WEAK_SCALING_MIN = 0.95
RUN_TIMEOUT_S = 420
HANG_DUMP_MINUTES = 0.1  # faulthandler dumps a rank's stacks 6 s into an iteration that has not ended


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        parts = [f"TP{self.tp}" if self.tp > 1 else "", f"PP{self.pp}" if self.pp > 1 else "",
                 f"DP{self.dp}" if self.dp > 1 or self.gpus == 1 else ""]
        return "x".join(p for p in parts if p)

    def flags(self) -> list[str]:
        return ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]


TP2PP2, DP4, TP2DP2, DP2, PP2 = Layout(tp=2, pp=2), Layout(dp=4), Layout(tp=2, dp=2), Layout(dp=2), Layout(pp=2)
LAYOUT_CHANGES = [  # (saved on, resumed on, precision): README's promise, tr11's bf16 ZeRO-0 first
    (TP2PP2, DP4, "bf16 ZeRO-0"), (TP2PP2, TP2DP2, "bf16 ZeRO-0"), (DP4, TP2PP2, "bf16 ZeRO-0"),
    (DP4, TP2DP2, "bf16 ZeRO-1"), (DP4, DP2, "fp16 ZeRO-1"), (DP2, DP4, "8-bit Adam"),
]
TP2 = Layout(tp=2)
LAYOUT_CHANGES_ON_2 = [  # what a host of 2 GPUs can check of the same promise (the rows above then skip)
    (PP2, DP2, "bf16 ZeRO-0"), (TP2, PP2, "bf16 ZeRO-0"), (DP2, TP2, "bf16 ZeRO-1"),
]


@dataclass
class Row:
    name: str
    ok: bool | None  # None: skipped
    figure: str
    detail: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "SKIP" if self.ok is None else "PASS" if self.ok else "FAIL"


@dataclass
class Run:
    """One finished trainer run: its exit code, every output line with torchrun's prefix, and its checkpoints."""

    name: str
    returncode: int
    lines: list[str]
    save: Path
    seconds: float

    def text_lines(self) -> list[str]:
        from opskit.logs.crash import line_source

        return [line_source(line)[2] for line in self.lines]

    def records(self) -> dict[int, dict]:
        from opskit.logs.grammar import parse_iteration_line

        return {r["iteration"]: r for line in self.text_lines() if (r := parse_iteration_line(line))}


class Bench:
    """The runs of one acceptance call: data, a scratch folder, where failed logs go, and the GPUs."""

    def __init__(self, data: Path, scratch: Path, out: Path | None, gpus: int, cuda: bool):
        self.data, self.scratch, self.out, self.gpus, self.cuda = data, scratch, out, gpus, cuda
        self.base = TP2PP2 if gpus >= TP2PP2.gpus else PP2  # rows 1 and 3
        self.all_dp = DP4 if gpus >= DP4.gpus else DP2  # rows 4
        self.failed_logs: list[str] = []
        self._lock = threading.Lock()

    def data_flags(self) -> list[str]:
        return ["--data-path", str(self.data / "kjv_text_document"), "--tokenizer-name-or-path",
                str(self.data / "tokenizer")]

    def command(self, layout: Layout, flags: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(layout.gpus),
                "--max_restarts", "0", "--tee", "3", "-m", "opskit.train", *TINY, *self.data_flags(),
                *layout.flags(), *flags]

    def start(self, name: str, layout: Layout, precision: str, load: Path | None = None, env: dict | None = None,
              extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
        out = self.scratch / name.replace(" ", "_")
        out.mkdir(parents=True)
        save = out / "checkpoints"
        flags = [*PRECISIONS[precision], "--save", str(save), "--load", str(load or save),
                 "--tensorboard-dir", str(out / "tensorboard"), *extra]
        process = subprocess.Popen(self.command(layout, flags), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=REPO, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return process, save

    def run(self, name: str, layout: Layout, precision: str, load: Path | None = None, extra: list[str] = (),
            again: bool = True) -> Run:
        """A whole run to iteration 20 (or from ``load``'s latest step). A run that fails in NCCL's set-up before its
        first iteration runs once more (as ``NAME again``): on one host of 4 x H100, 12 runs starting together made
        NCCL fail to allocate (docs/benchmarks.md#gpu-acceptance), which is the host's load, not what the row checks."""
        started = time.monotonic()
        process, save = self.start(name, layout, precision, load, extra=extra)
        try:
            output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_group(process)
            output, _ = process.communicate()
        run = Run(name, process.returncode, output.splitlines(), save, time.monotonic() - started)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {run.returncode} in {run.seconds:.0f} s", flush=True)
        if run.returncode != 0:
            self.keep_log(run)
            if again and not run.records() and any("NCCL error" in line for line in run.lines):
                return self.run(f"{name} again", layout, precision, load, extra, again=False)
        return run

    def keep_log(self, run: Run) -> None:
        self.keep_text(f"===== {run.name}: exit {run.returncode}\n" + "\n".join(run.lines[-400:]))

    def keep_text(self, text: str) -> None:
        """A failed run's log, kept for the table's end and, when there is an ``--out``, written at once (a call cut
        short by its time limit still brings it back)."""
        with self._lock:
            self.failed_logs.append(text)
            if self.out:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "failed_runs.log").write_text("\n\n".join(self.failed_logs))


def copy_of_step(run: Run, into: Path, step: int = SAVED) -> Path:
    """A checkpoint dir holding a copy of ``run``'s ``global_step{step}``, ``latest`` naming it."""
    into.mkdir(parents=True)
    shutil.copytree(run.save / f"global_step{step}", into / f"global_step{step}")
    (into / "latest").write_text(f"global_step{step}")
    return into


def compare(resumed: Run, straight: Run, exact: bool, first: int = SAVED + 1) -> tuple[bool, str, dict]:
    """Iterations ``first``..20 (default 11..20) of ``resumed`` against ``straight``: same LR and consumed samples,
    lm loss equal (``exact``) or within ``LAYOUT_REL``; (ok, figure, detail)."""
    if resumed.returncode != 0 or straight.returncode != 0:
        failed = resumed if resumed.returncode != 0 else straight
        return False, f"{failed.name}: exit {failed.returncode}", {}
    got, want = resumed.records(), straight.records()
    wanted = range(first, ITERATIONS + 1)
    if sorted(got) != list(wanted) or any(i not in want for i in wanted):
        return False, f"iterations {sorted(got)} after the resume", {}
    diffs = [abs(got[i]["lm_loss"] - want[i]["lm_loss"]) for i in wanted]
    rel = max(d / abs(want[i]["lm_loss"]) for d, i in zip(diffs, wanted, strict=True))
    same_schedule = all((got[i]["learning_rate"], got[i]["consumed_samples"]) ==
                        (want[i]["learning_rate"], want[i]["consumed_samples"]) for i in wanted)
    ok = same_schedule and (max(diffs) == 0.0 if exact else rel <= LAYOUT_REL)
    figure = f"max |dloss| {max(diffs):.3g} (rel {rel:.2g})" + ("" if same_schedule else "; LR/samples differ")
    layout_line = next((line.strip() for line in resumed.text_lines() if line.startswith(" checkpoint layout ")), "")
    return ok, figure, {"losses": {i: [want[i]["lm_loss"], got[i]["lm_loss"]] for i in wanted},
                        "layout_line": layout_line, "seconds": round(resumed.seconds, 1)}


# ------------------------------------------------------------------------------------------------------------ rows

def row_same_layout(bench: Bench, dropped: Run) -> Row:
    """A resume of ``dropped``'s (the base layout with dropout) ``global_step10`` gives its losses exactly."""
    resumed = bench.run(f"resume {bench.base} dropout", bench.base, "bf16 ZeRO-0",
                        copy_of_step(dropped, bench.scratch / "from-A"), extra=DROPOUT)
    ok, figure, detail = compare(resumed, dropped, exact=True)
    return Row(f"1. resume {bench.base} bf16 ZeRO-0 dropout 0.1 (same layout, exact)", ok, figure, detail)


def row_async_save(bench: Bench, dropped: Run) -> Row:
    """The base layout with dropout saved with ``--async-save``: its 20 iterations print ``dropped``'s losses, and a
    resume of its ``global_step10`` (also saving in the background) gives them exactly."""
    name = f"1. async saves {bench.base} bf16 ZeRO-0 dropout 0.1 (same losses, exact resume)"
    background = bench.run(f"async {bench.base} dropout", bench.base, "bf16 ZeRO-0", extra=["--async-save", *DROPOUT])
    if background.returncode != 0:
        return Row(name, False, f"{background.name}: exit {background.returncode}")
    same = {i: r["lm_loss"] for i, r in background.records().items()} == \
        {i: r["lm_loss"] for i, r in dropped.records().items()}
    resumed = bench.run(f"resume async {bench.base} dropout", bench.base, "bf16 ZeRO-0",
                        copy_of_step(background, bench.scratch / "from-async"), extra=["--async-save", *DROPOUT])
    ok, figure, detail = compare(resumed, dropped, exact=True)
    blocked = [line.split(": ")[1] for line in background.text_lines()
               if line.startswith("time (ms) | save-checkpoint: ")]
    return Row(name, ok and same, f"{'same' if same else 'DIFFERENT'} losses as saved synchronously; resume "
                                  f"{figure}; blocked ms per save {blocked}", {**detail, "blocked_ms": blocked})


def row_sequence_parallel(bench: Bench, straight: Run) -> Row:
    """The base layout with ``--sequence-parallel`` (tr11's choices): its losses within ``LAYOUT_REL`` of
    ``straight``, the run without (the same sums in another order, dropout 0), and with dropout a resume of its
    ``global_step10`` gives its own losses exactly."""
    name = f"1. sequence parallel {bench.base} bf16 ZeRO-0 (losses; dropout 0.1: exact resume)"
    split = bench.run(f"sp {bench.base}", bench.base, "bf16 ZeRO-0", extra=["--sequence-parallel"])
    dropped = bench.run(f"sp {bench.base} dropout", bench.base, "bf16 ZeRO-0", extra=["--sequence-parallel", *DROPOUT])
    if split.returncode != 0 or dropped.returncode != 0:
        failed = split if split.returncode != 0 else dropped
        return Row(name, False, f"{failed.name}: exit {failed.returncode}")
    ok_losses, against_plain, _ = compare(split, straight, exact=False, first=1)
    resumed = bench.run(f"resume sp {bench.base} dropout", bench.base, "bf16 ZeRO-0",
                        copy_of_step(dropped, bench.scratch / "from-sp"), extra=["--sequence-parallel", *DROPOUT])
    ok, figure, detail = compare(resumed, dropped, exact=True)
    return Row(name, ok and ok_losses, f"vs no split: {against_plain}; resume {figure}", detail)


def row_layout_change(bench: Bench, straight: Run, saved: Layout, target: Layout, precision: str) -> Row:
    name = f"{precision} {saved} -> {target}"
    resumed = bench.run(name, target, precision, copy_of_step(straight, bench.scratch / f"from {name}"))
    ok, figure, detail = compare(resumed, straight, exact=False)
    want = f" -> TP={target.tp} PP={target.pp} DP={target.dp}"
    if ok and want not in detail.get("layout_line", ""):
        ok, figure = False, f"no layout line ending '{want}': {detail.get('layout_line')!r}"
    return Row(f"2. {name}", ok, figure, detail)


def row_check_and_convert(bench: Bench, straight: Run) -> Row:
    """``opskit ckpt check --json`` and ``opskit ckpt convert --dtype fp32`` of the base layout run's last step."""
    if straight.returncode != 0:
        return Row(f"3. ckpt check + convert of {bench.base}", False, f"no checkpoint: {straight.name} failed")
    cli = [sys.executable, "-m", "opskit.cli.app", "ckpt"]
    step = straight.save / f"global_step{ITERATIONS}"
    check = subprocess.run([*cli, "check", str(step), "--json"], capture_output=True, text=True, cwd=REPO)
    hf = bench.scratch / "hf"
    convert = subprocess.run([*cli, "convert", str(step), "--out", str(hf), "--dtype", "fp32"], capture_output=True,
                             text=True, cwd=REPO)
    try:
        report = json.loads(check.stdout)
    except json.JSONDecodeError:
        report = {}
    verified = convert.stdout.split("verified: max abs logits diff ")[-1].split(")")[0].split()[0] \
        if "verified:" in convert.stdout else None
    ok = check.returncode == 0 and report.get("ok") is True and convert.returncode == 0 and verified is not None
    figure = (f"check {'OK' if report.get('ok') else 'FAILED'} (exit {check.returncode}); convert exit "
              f"{convert.returncode}, max |logit diff| {verified}")
    if not ok:
        bench.keep_text(f"===== ckpt check\n{check.stdout[-3000:]}{check.stderr[-3000:]}\n"
                                 f"===== ckpt convert\n{convert.stdout[-3000:]}{convert.stderr[-3000:]}")
    return Row(f"3. ckpt check + convert of {bench.base} step 20", ok, figure,
               {"check": report, "convert": convert.stdout.strip()[-500:]})


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run: torchrun's workers first (torchrun starts them in sessions of their own, so killing its
    process group alone left the hang row's workers spinning in NCCL on every GPU, measured: they slowed the next
    bench of the same call to half speed), then torchrun's process group."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def fault_env(kind: str) -> dict:
    return {"OPSKIT_TEST_FAULT": f"{kind}:{socket.gethostname()}:iteration=3:local_rank=1"}


def row_crash(bench: Bench) -> Row:
    """Local rank 1 of DP4 exits after iteration 3 as a GPU that broke does: torchrun must end the job (timed from the
    crash line to torchrun's exit), and the crash finder must name local rank 1 (from torchrun's prefix)."""
    from opskit.logs.crash import find_crashes

    process, _ = bench.start(f"crash {bench.all_dp}", bench.all_dp, "bf16 ZeRO-0", env=fault_env("crash"))
    lines, crashed_at = [], None
    limit = threading.Timer(240, kill_group, (process,))
    limit.start()
    for line in process.stdout:  # the job's output as it comes: the moment of the crash line
        lines.append(line.rstrip("\n"))
        if crashed_at is None and find_crashes([line]):
            crashed_at = time.monotonic()
    process.wait()
    limit.cancel()
    ended_after = time.monotonic() - crashed_at if crashed_at is not None else None
    crashes = find_crashes(lines, node=socket.gethostname())
    ranks = {c.local_rank for c in crashes if c.local_rank is not None}  # torchrun's own summary has no prefix
    ok = process.returncode != 0 and bool(crashes) and crashes[0].local_rank == 1 and ranks == {1}
    if not ok:
        bench.keep_text(f"===== crash {bench.all_dp}\n" + "\n".join(lines[-200:]))
    where = crashes[0].where if crashes else "nothing"
    ended = f"ended {ended_after:.0f} s after the crash line" if ended_after is not None else "no crash line"
    return Row(f"4. crash of local rank 1 ({bench.all_dp})", ok,
               f"exit {process.returncode}, {ended}; {len(crashes)} crash line(s), first: {where}",
               {"crashes": [c.line for c in crashes], "ended_after_s": ended_after})


def row_hang(bench: Bench) -> Row:
    """Local rank 1 of DP4 sleeps inside iteration 4; the others wait for it in NCCL. Every rank dumps its stacks
    after ``HANG_DUMP_MINUTES``; the job is then killed and :func:`opskit.logs.stacks.stuck_ranks` must name local
    rank 1. What the waiting ranks' innermost frames are under NCCL (asynchronous collectives) is recorded."""
    from opskit.logs.crash import line_source
    from opskit.logs.stacks import rank_stacks, stuck_ranks

    process, _ = bench.start(f"hang {bench.all_dp}", bench.all_dp, "bf16 ZeRO-0", env=fault_env("hang"),
                             extra=["--stack-dump-after-mins", str(HANG_DUMP_MINUTES)])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    deadline, stacks, hang_at, found_at = time.monotonic() + 240, [], None, 0.0
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(1)
        if hang_at is None:
            hang_at = next((i for i, line in enumerate(list(lines)) if "OPSKIT_TEST_FAULT: hanging" in line), None)
            found_at = time.monotonic()
        if hang_at is not None:
            stacks = rank_stacks(list(lines)[hang_at:], nodes=[socket.gethostname()])
            if len(stacks) == bench.all_dp.gpus:
                time.sleep(2)  # the last dump's remaining lines
                stacks = rank_stacks(list(lines)[hang_at:], nodes=[socket.gethostname()])
                break
    dumped_after = time.monotonic() - found_at if hang_at is not None else None
    kill_group(process)
    process.wait()
    reader.join(timeout=10)
    stuck = stuck_ranks(stacks)
    ok = [s.local_rank for s in stuck] == [1]
    if not ok:
        bench.keep_text(f"===== hang {bench.all_dp}\n" + "\n".join(line_source(x)[2] for x in lines[-300:]))
    others = sorted({s.innermost for s in stacks if s.local_rank != 1})
    figure = (f"{len(stacks)} rank(s) dumped {dumped_after:.0f} s after the hang; stuck: "
              f"{', '.join(s.where for s in stuck) or 'none named'}" if hang_at is not None
              else "the fault hook's hang line never came")
    return Row(f"4. hang of local rank 1 ({bench.all_dp})", ok, figure,
               {"stuck": [f"{s.where}: {s.innermost}" for s in stuck], "waiting_ranks_innermost": others})


def row_weak_scaling(gpus: int) -> Row:
    """The 1.3B GPT-2 (bench/trainer_throughput.py, eager) at DP 1 and ``gpus``, MBS 8 x 4 micro-batches."""
    from trainer_throughput import S, make_data, report_weak_scaling, run_trainer

    iters, mbs, gas = 11, 8, 4
    with tempfile.TemporaryDirectory() as tmp:
        data, tokenizer = make_data(Path(tmp), tokens=(iters + 5) * mbs * gas * gpus * (S + 1) * 2)
        results = [run_trainer("opskit-gpt", [], data, tokenizer, iters, mbs, n, gas) for n in (1, gpus)]
    report_weak_scaling(results)
    scaled = results[-1].get("weak_scaling_efficiency")
    if scaled is None:
        return Row(f"5. weak scaling 1.3B GPT-2 1 -> {gpus} GPUs", False, f"runs: {results}", {"runs": results})
    return Row(f"5. weak scaling 1.3B GPT-2 1 -> {gpus} GPUs", scaled >= WEAK_SCALING_MIN,
               f"{scaled:.1%} ({results[0]['tokens_per_s']:,} -> {results[1]['tokens_per_s']:,} tok/s, "
               f"MFU {results[0]['mfu']:.1%} / {results[1]['mfu']:.1%})", {"runs": results})


# ------------------------------------------------------------------------------------------------------------ main

def guarded(row, *args) -> Row:
    """``row(*args)``, or a FAIL row naming the exception (e.g. a run that failed left no step to resume)."""
    try:
        return row(*args)
    except Exception as error:  # noqa: BLE001 - one row's failure must not hide the others'
        return Row(f"{row.__name__}{tuple(str(a) for a in args[2:])}", False, f"{type(error).__name__}: {error}")


def acceptance_rows(bench: Bench, jobs: int) -> list[Row]:
    """Rows 1-4: the uninterrupted runs first (in parallel), then every resume, check, crash and hang."""
    changes = LAYOUT_CHANGES + (LAYOUT_CHANGES_ON_2 if bench.gpus < DP4.gpus else [])
    fits = [(saved, target, precision) for saved, target, precision in changes
            if max(saved.gpus, target.gpus) <= bench.gpus and (bench.cuda or precision != "fp16 ZeRO-1")]
    skipped = [Row(f"2. {precision} {saved} -> {target}", None,
                   "needs 4 GPUs" if max(saved.gpus, target.gpus) > bench.gpus else "fp16 needs a GPU")
               for saved, target, precision in changes if (saved, target, precision) not in fits]
    sources = {(bench.base, "bf16 ZeRO-0")} | {(saved, precision) for saved, _, precision in fits}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        dropped = pool.submit(bench.run, f"bf16 ZeRO-0 {bench.base} dropout", bench.base, "bf16 ZeRO-0",
                              extra=DROPOUT)
        straight = dict(zip(sources, pool.map(lambda s: bench.run(f"{s[1]} {s[0]}", s[0], s[1]), sources), strict=True))
        base = straight[(bench.base, "bf16 ZeRO-0")]
        futures = [pool.submit(guarded, row, bench, dropped.result()) for row in (row_same_layout, row_async_save)]
        futures += [pool.submit(guarded, row, bench, base) for row in (row_sequence_parallel, row_check_and_convert)]
        futures += [pool.submit(guarded, row_layout_change, bench, straight[(saved, precision)], saved, target,
                                precision) for saved, target, precision in fits]
        futures += [pool.submit(guarded, row_crash, bench), pool.submit(guarded, row_hang, bench)]
        rows = [f.result() for f in futures]
    return rows + skipped


def prepare(folder: Path) -> None:
    """The KJV as a 1000-token byte-level BPE tokenizer and Megatron indexed dataset (needs Debian's bible-kjv)."""
    from opskit.data.corpus import prepare_data

    prepared = prepare_data("kjv", folder, vocab_size=1000, name="kjv")
    print(f"prepared {prepared.num_tokens:,} tokens in {prepared.data_prefix} (vocab {prepared.vocab_size})")


def print_table(rows: list[Row], header: str) -> None:
    width = max(len(r.name) for r in rows)
    print(f"\n{header}")
    for row in rows:
        print(f"{row.name:<{width}}  {row.verdict}  {row.figure}")
    counts = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prepare", type=Path, help="Prepare the KJV data into this folder and exit.")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "gpu-acceptance")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs (processes) to use; default: all visible, else 4.")
    parser.add_argument("--jobs", type=int, default=None, help="Runs at once (default 12 on GPUs, 1 on CPUs).")
    parser.add_argument("--no-throughput", action="store_true", help="Skip row 5.")
    parser.add_argument("--out", type=Path, help="Folder for gpu_acceptance.json and the logs of failed runs.")
    opts = parser.parse_args()
    if opts.prepare:
        prepare(opts.prepare)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    gpus = opts.gpus or (torch.cuda.device_count() if cuda else 4)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as scratch:
        bench = Bench(opts.data.resolve(), Path(scratch), opts.out, gpus, cuda)
        rows = acceptance_rows(bench, opts.jobs or (12 if cuda else 1))
    if opts.no_throughput or not cuda or gpus < 2:
        why = "--no-throughput" if opts.no_throughput else "needs 2+ GPUs" if cuda else "needs GPUs"
        rows.append(Row("5. weak scaling 1.3B GPT-2", None, why))
    else:
        rows.append(row_weak_scaling(gpus))
    device = torch.cuda.get_device_name(0) if cuda else "CPU (gloo)"
    # OPSKIT_COMMIT first: the device machine's copy of the tree may carry a .git of an older commit
    commit = os.environ.get("OPSKIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                               capture_output=True, text=True,
                                                               cwd=REPO).stdout.strip() or "unknown"
    header = (f"GPU acceptance, {time.strftime('%Y-%m-%d', time.gmtime(started))}, {gpus} x {device}, torch "
              f"{torch.__version__}, commit {commit}, {time.time() - started:.0f} s")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "gpu_acceptance.json").write_text(json.dumps(
            {"header": header, "rows": [{"name": r.name, "verdict": r.verdict, "figure": r.figure, **r.detail}
                                        for r in rows]}, indent=1, default=str))
    print_table(rows, header)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
