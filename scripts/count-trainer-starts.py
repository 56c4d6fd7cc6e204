#!/usr/bin/env python3
"""Count trainer start-ups on this machine while a command runs (the CI budget of docs/design.md's testing section).

    scripts/count-trainer-starts.py [--interval S] [--list FILE] [--by-test FILE] -- COMMAND ...

Runs COMMAND and, meanwhile, samples /proc every ``--interval`` seconds (0.05) for trainer processes: an argv that runs
``-m opskit.train``, ``opskit train``, or a ``-c`` wrapper that calls the trainer's ``main``. A start-up is one launch:
a trainer process of rank 0 (its environment's ``RANK`` is 0 or unset), so a 4-rank torchrun counts once and a 2-node
SLURM task once. A trainer lives for seconds (it imports torch), far longer than the interval. Needs root to read other
users' environments (SLURM jobs). Prints the count at the end; exits with COMMAND's exit code.

Only COMMAND's own trainers count, whatever else runs on the machine: COMMAND runs with ``OPSKIT_COUNT_TAG`` set to a
value of its own, which its trainers inherit (a subprocess's environment, and a SLURM job's: sbatch exports the
submitter's), and a trainer without it is not counted. ``PYTEST_CURRENT_TEST``, inherited the same way, names the test
that started it (``--by-test``: the count per test, largest first).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

TAG = "OPSKIT_COUNT_TAG"


def is_trainer(argv: list[str]) -> bool:
    """Whether ``argv`` (a process's command line) is a Python process running the trainer: ``-m opskit.train``,
    ``opskit train``, or a test's ``-c`` wrapper that calls the trainer's ``main`` (not the job script's module check,
    nor the bash and torchrun processes around a trainer)."""
    if not argv or not Path(argv[0]).name.startswith("python"):
        return False
    if argv[1:2] == ["-u"]:
        argv = argv[:1] + argv[2:]
    if argv[1:3] == ["-m", "opskit.train"]:
        return True
    if Path(argv[1] if len(argv) > 1 else "").name == "opskit" and argv[2:3] == ["train"]:
        return True
    code = argv[2] if argv[1:2] == ["-c"] and len(argv) > 2 else ""
    return "opskit.train" in code and ("main(" in code or "run_module" in code)


def environment(pid: str) -> dict[str, str] | None:
    """The process's environment, or None when it cannot be read (gone, or another user's without root)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def sample(seen: dict, stop: threading.Event, interval: float, tag: str) -> None:
    """Add each new rank-0 trainer process carrying ``tag`` to ``seen`` (``pid:start time`` -> (test, command line))
    until ``stop``."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in seen:
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            except OSError:
                continue
            if not is_trainer(argv):
                continue
            env = environment(pid)
            if env is not None and env.get(TAG) == tag and env.get("RANK", "0") == "0":
                test = env.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(no test)"
                seen[pid + ":" + start] = (test, " ".join(argv).replace("\n", " ")[:300])
        stop.wait(interval)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--list", type=Path, help="write each start-up's test and command line here")
    parser.add_argument("--by-test", type=Path, help="write the count per test here, largest first")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a COMMAND to run is needed")
    seen: dict[str, str] = {}
    stop = threading.Event()
    tag = f"{os.getpid()}-{time.time_ns()}"
    thread = threading.Thread(target=sample, args=(seen, stop, args.interval, tag), daemon=True)
    thread.start()
    try:
        code = subprocess.call(command, env={**os.environ, TAG: tag})
    finally:
        stop.set()
        thread.join()
    if args.list:
        args.list.write_text("".join(f"{test}\t{cmd}\n" for test, cmd in seen.values()))
    if args.by_test:
        per_test = Counter(test for test, _ in seen.values())
        args.by_test.write_text("".join(f"{n}\t{test}\n" for test, n in per_test.most_common()))
    print(f"count-trainer-starts: {len(seen)} trainer start-ups (rank 0 processes) during: {' '.join(command)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
