"""``opskit preflight``: check nodes before training trusts them (BigScience bisected a 5% slow node by hand with
spare nodes). Each node runs :mod:`opskit.allocation.node_check` (one ``srun`` step, a task per node); this module reads
their records and names the nodes to keep out:

- no record (the task died or never started), or fewer GPUs than ``parallel.gpus_per_node`` (when any node has
  GPUs: on a CPU cluster no node shows one);
- a GEMM below the fleet's median by more than ``margin`` (its slowest device against the median of every node's
  slowest device), twice: when one is slow, every node is measured again together, and only a node below the margin
  again, against the smaller of the two medians, is kept out, the verdict giving both figures (another process on its
  cores for a moment, or on every node's at the second measurement, is no fault of a node);
- less free disk at the checkpoint folder than one step (``opskit plan``'s ``checkpoint_gb``: the folder is
  shared, every node's writes land there), or GPU Xid lines in the kernel log;
- every all-reduce it took part in failed (one with each ring neighbour) while other pairs succeeded (when all
  failed, none is singled out: a note says so).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from opskit.errors import OpskitError
from opskit.fsutil import read_json
from opskit.logs.crash import expand_nodelist
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.spec.schema import Spec

TIMEOUT_S = 300


class PreflightError(OpskitError):
    """The check could not run (srun missing, no node to check): one line."""


@dataclass(frozen=True)
class NodeVerdict:
    """One node's figures and, when it must be kept out, why (``problems`` empty: fit)."""

    node: str
    gemm_tflops: float | None
    """Its slowest device's GEMM TFLOP/s (None without a record)."""
    free_gb: float | None
    allreduce_s: float | None
    """Its slowest successful pair all-reduce, in seconds (None: none succeeded)."""
    problems: list[str] = field(default_factory=list)
    gemm_again_tflops: float | None = None
    """Its slowest device's GEMM when measured again (every node is, when one was slow), None otherwise."""


@dataclass(frozen=True)
class Preflight:
    nodes: list[NodeVerdict]
    median_tflops: float | None
    notes: list[str]

    @property
    def excluded(self) -> list[NodeVerdict]:
        return [n for n in self.nodes if n.problems]

    def as_json(self) -> dict:
        return {"nodes": [asdict(n) for n in self.nodes], "median_tflops": self.median_tflops,
                "excluded": [n.node for n in self.excluded], "notes": self.notes}


def slowest_gemms(records: dict[str, dict | None]) -> dict[str, float]:
    """Node -> its slowest device's GEMM TFLOP/s, for the nodes whose record has one."""
    return {node: min(r["gemm_tflops"].values()) for node, r in records.items() if r and r.get("gemm_tflops")}


def slow_gemm_nodes(records: dict[str, dict | None], margin: float) -> list[str]:
    """The nodes whose slowest GEMM is below ``(1 - margin)`` x the median of the nodes' slowest: when there are any,
    every node is measured again before :func:`judge` keeps one out."""
    slowest = slowest_gemms(records)
    median = statistics.median(slowest.values()) if slowest else None
    return [node for node, tflops in slowest.items() if median and tflops < (1 - margin) * median]


def judge(records: dict[str, dict | None], expected_devices: int, margin: float, min_free_gb: float,
          again: dict[str, dict | None] | None = None) -> Preflight:
    """The verdicts on ``records`` (node -> its node_check record, None when it wrote none).

    Args:
        expected_devices: GPUs each node must show (0: not checked).
        margin: a node whose slowest GEMM is below ``(1 - margin) x`` the median of the nodes' slowest is excluded
            (when ``again`` holds it, only if its second figure is below ``(1 - margin) x`` the smaller of the two
            medians too: a node slow once and fine again stays in, with a note).
        min_free_gb: free GB needed at the checkpoint folder.
        again: the second records (GEMM only) of every node, measured together because :func:`slow_gemm_nodes`
            named one; None: not measured again. The smaller median is the bar: a slowdown that hit every node at
            the second measurement is not held against one, nor one that hit this node alone at the first (several
            local "nodes" sharing a machine's cores take turns).
    """
    slowest = slowest_gemms(records)
    median = statistics.median(slowest.values()) if slowest else None
    slowest_again = slowest_gemms(again or {})
    median_again = statistics.median(slowest_again.values()) if slowest_again else None
    # a node is cut off when every all-reduce it took part in failed while some pair elsewhere succeeded
    reduced = {node: bool(r) and (any(pair["ok"] for pair in r["allreduce"]) or not r["allreduce"])
               for node, r in records.items()}  # one node alone has no pair
    notes = []
    if reduced and not any(reduced.values()):
        notes.append(f"every all-reduce failed ({len(reduced)} nodes): the network or the rendezvous ports, not one "
                     "node")
    verdicts = []
    for node, record in records.items():
        problems = []
        if record is None:
            problems.append("no result (its check died or never started)")
        else:
            if expected_devices and record["devices"] < expected_devices:
                problems.append(f"{record['devices']} GPU(s), expected {expected_devices}")
            if median and slowest.get(node, 0) < (1 - margin) * median:
                gemm = _gemm_verdict(node, (slowest[node], median), margin, again,
                                     (slowest_again.get(node), median_again))
                problems += gemm[:1] if gemm[1] is None else []
                notes += [gemm[1]] if gemm[1] else []
            if record["free_gb"] < min_free_gb:
                problems.append(f"{record['free_gb']:.0f} GB free at the checkpoints, a step needs {min_free_gb:.0f}")
            if record.get("xid"):
                problems.append(f"{len(record['xid'])} GPU Xid line(s) in the kernel log: {record['xid'][-1]}")
            if not reduced[node] and any(reduced.values()):
                failed = record["allreduce"][0] if record["allreduce"] else {}
                problems.append(f"all-reduce failed: {failed.get('error', 'wrong sum')}")
        seconds = [pair["seconds"] for pair in record["allreduce"] if pair["ok"]] if record else []
        verdicts.append(NodeVerdict(node, slowest.get(node), record["free_gb"] if record else None,
                                    max(seconds) if seconds else None, problems, slowest_again.get(node)))
    return Preflight(verdicts, median, notes)


def _gemm_verdict(node: str, first: tuple[float, float], margin: float, again: dict[str, dict | None] | None,
                  second: tuple[float | None, float | None]) -> tuple[str, str | None]:
    """(the problem of a node slow at first, the note when it was fine measured again: then it stays in).
    ``first`` and ``second``: (the node's slowest GEMM, the median of every node's) of each measurement."""
    (tflops, median), (tflops_again, median_again) = first, second
    problem = f"GEMM {tflops:.3g} TFLOP/s, {tflops / median:.0%} of the median {median:.3g}"
    if again is None:
        return problem, None
    if tflops_again is None or not median_again:
        return f"{problem}; measured again: no result", None
    again_said = f"{tflops_again:.3g} TFLOP/s, {tflops_again / median_again:.0%} of that median {median_again:.3g}"
    if tflops_again < (1 - margin) * min(median, median_again):
        return f"{problem}; measured again with every node: {again_said}", None
    return problem, (f"{node}: GEMM {tflops:.3g} TFLOP/s ({tflops / median:.0%} of the median {median:.3g}) at "
                     f"first, {again_said} measured again with every node: kept in (the cores were busy for a "
                     "moment)")


def run_preflight(spec: Spec, nodes: str, margin: float, exclude: bool, run: RunPaths | None = None) -> Preflight:
    """Check ``nodes`` (SLURM's node-list syntax) with one ``srun`` step of a task per node (their records kept in
    ``<run>/preflight/<time>-<pid>/<node>.json``), when a node's GEMM was slow every node's GEMM a second time together
    (in ``again/``), judge them (:func:`judge`: this spec's GPUs per node and step size), and with ``exclude`` put the
    failing ones on the run's bad-node list (the next submission excludes them). ``run``: the run directory, when
    not the spec's own (the job script's copy of the spec lives inside it).

    Raises:
        PreflightError: not a node list (or one of more nodes than any cluster: :data:`opskit.logs.crash.MAX_NODES`),
            or no node reported (srun could not start the step).
        OutputRefusedError: the run directory holds files opskit did not write.
    """
    try:
        names = expand_nodelist(nodes)
    except ValueError as e:
        raise PreflightError(f"--nodes {e}; expected a SLURM node list of this cluster (e.g. node[1-3],gpu7)") \
            from None
    if not names:
        raise PreflightError(f"--nodes {nodes!r}: no node to check")
    run = run or RunPaths.of(spec)
    chain.claim_run_dir(run, "preflight")  # the node records go into it
    out = run.root / "preflight" / f"{datetime.now():%Y-%m-%dT%H-%M-%S}-{os.getpid()}"
    records, command, step = _check_nodes(spec, run, names, out)
    if not any(records.values()):
        said = (step.stderr.strip().splitlines() or [f"exit {step.returncode}"])[-1]
        raise PreflightError(f"no node reported ({' '.join(command[:6])} ...: {said[:300]})")
    slow = slow_gemm_nodes(records, margin)
    reported = [name for name, record in records.items() if record]
    again = _check_nodes(spec, run, reported, out / "again", gemm_only=True)[0] if slow else None
    from opskit.spec.plan import make_plan

    gpus = spec.parallel.gpus_per_node if any(r and r["devices"] for r in records.values()) else 0
    verdict = judge(records, gpus, margin, make_plan(spec).memory.checkpoint_gb, again)
    if exclude and verdict.excluded:
        chain.add_bad_nodes(run, {n.node: "preflight: " + "; ".join(n.problems) for n in verdict.excluded})
    return verdict


def _check_nodes(spec: Spec, run: RunPaths, names: list[str], out: Path, gemm_only: bool = False
                 ) -> tuple[dict[str, dict | None], list[str], subprocess.CompletedProcess]:
    """One ``srun`` step of :mod:`opskit.allocation.node_check` on ``names`` (``gemm_only``: the timed GEMM alone, for a
    second measurement): (node -> its record in ``out``, None without one; the command; the finished step).

    Raises:
        PreflightError: srun is missing or ran past :data:`TIMEOUT_S`.
    """
    s = spec.slurm
    command = ["srun", f"--nodes={len(names)}", f"--ntasks={len(names)}", "--ntasks-per-node=1",
               f"--nodelist={','.join(names)}", "--time=10", f"--job-name={spec.job_name}-preflight",
               *([f"--partition={s.partition}"] if s.partition else []),
               *([f"--account={s.account}"] if s.account else []),
               sys.executable, "-m", "opskit.allocation.node_check", str(out), str(run.checkpoints), str(s.master_port +
               1), *(["--gemm-only"] if gemm_only else [])]
    try:
        step = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"srun: {e}") from None
    return {name: _read_record(out / f"{name}.json") for name in names}, command, step


def _read_record(path: Path) -> dict | None:
    """A node's record (:func:`opskit.allocation.node_check.check`), None when it wrote none or one that is not a JSON
    object (bounded read: :func:`opskit.fsutil.read_json`)."""
    try:
        record = read_json(path)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
