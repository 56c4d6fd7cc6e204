#!/usr/bin/env python3
"""Count trainer start-ups on this machine while a command runs (the CI budget of docs/design.md's testing section).

    scripts/count-trainer-starts.py [--interval S] [--list FILE] -- COMMAND ...

Runs COMMAND and, meanwhile, samples /proc every ``--interval`` seconds (0.05) for trainer processes: an argv that runs
``-m opskit.train``, ``opskit train``, or a ``-c`` wrapper that calls the trainer's ``main``. A start-up is one launch:
a trainer process of rank 0 (its environment's ``RANK`` is 0 or unset), so a 4-rank torchrun counts once and a 2-node
SLURM task once. A trainer lives for seconds (it imports torch), far longer than the interval. Needs root to read other
users' environments (SLURM jobs). Prints the count at the end; exits with COMMAND's exit code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path


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


def rank_of(pid: str) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e[5:].decode() for e in environ if e.startswith(b"RANK=")]
    return ranks[0] if ranks else ""


def sample(seen: dict, stop: threading.Event, interval: float) -> None:
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in seen:
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            except OSError:
                continue
            if is_trainer(argv):
                rank = rank_of(pid)
                if rank in ("", "0"):
                    seen[pid + ":" + start] = " ".join(argv)[:300]
        stop.wait(interval)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--list", type=Path, help="write each start-up's command line here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a COMMAND to run is needed")
    seen: dict[str, str] = {}
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(seen, stop, args.interval), daemon=True)
    thread.start()
    try:
        code = subprocess.call(command)
    finally:
        stop.set()
        thread.join()
    if args.list:
        args.list.write_text("".join(f"{cmd}\n" for cmd in seen.values()))
    print(f"count-trainer-starts: {len(seen)} trainer start-ups (rank 0 processes) during: {' '.join(command)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
