"""What every-field log parsing cannot go below in CPython: the cost of each unavoidable step, measured alone on the
log bench/log_parse.py writes, side by side with the per-line parser (issue 6's 500_000 lines/s target = 2 CPU s for
its 1,000,000 lines).

Steps (each the cheapest form found; CPU seconds, best of ``--repeat``, the per-line parser measured first and last;
this is why large reads go through polars, opskit/logs/bulk.py):
  lines   8 MiB blocks (already in memory) decoded, ``split("\\n")``, the two-substring prefilter loop (what every
          line-based parser pays);
  match   one ``finditer`` per block with a pattern matching the whole common iteration line (anchored, ``[^|\\n]*``
          value groups, no lazy ``.*?``), matches only counted: the regex engine's walk over the text;
  regex   the same plus ``groups()`` of each match: extraction by the regex engine;
  split   the same value strings by a line loop, ``"|".join`` of the lines' ends, two ``replace`` and one ``split``:
          extraction by str methods (names and separators become strings too; checking them is extra);
  convert ``int``/``float`` of the 14 value strings of every record in ONE ``map`` over a flat list (no Python
          bytecode per value);
  dicts   the records from the converted values: ``template.copy()`` + ``update(zip(keys, row))``.

    PYTHONPATH=. python bench/log_parse_floor.py [--repeat 3] [--file /tmp/opskit-bench.log]
"""

from __future__ import annotations

import argparse
import operator
import re
import time
from itertools import cycle
from pathlib import Path

from log_parse import generate, per_line  # bench/ is sys.path[0] when run as a script

from opskit.logs.grammar import FIELDS
from opskit.logs.parse import _BLOCK


def blocks(path: Path) -> list[bytes]:
    """The file as the per-line parser reads it: 8 MiB blocks of complete lines."""
    data, out, start = path.read_bytes(), [], 0
    while start < len(data):
        end = data.rfind(b"\n", start, start + _BLOCK) + 1 or len(data)
        out.append(data[start:end])
        start = end
    return out


def layout(path: Path) -> tuple[list[str], list]:
    """Names (leading space kept) and converters of the first iteration line's fields."""
    first = next(line for line in path.open() if "| consumed samples" in line)
    names = [part.partition(":")[0] for part in first.rstrip("\n").split("|")[1:-1]]
    return names, [int, int, *(FIELDS[name][1] for name in names)]  # iteration, train_iters, then the fields


def cpu(repeat: int, run) -> tuple[float, object]:
    """(best CPU seconds over ``repeat`` runs, the last run's result)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        result = run()
        best = min(best, time.process_time() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--file", type=Path, default=Path("/tmp/opskit-bench.log"))
    args = parser.parse_args()
    if not args.file.exists():
        generate(args.file, 1_000_000)
    raw = blocks(args.file)
    texts = [block.decode("utf-8", errors="replace") for block in raw]
    lines_total = sum(text.count("\n") for text in texts)
    names, converters = layout(args.file)
    pattern = re.compile(r"^[^|\n]*iteration ([^/|\n]*)/([^|\n]*)\|"
                         + "".join(re.escape(name) + r":([^|\n]*)\|" for name in names) + r"$", re.M)

    def lines():
        kept = 0
        for block in raw:
            for line in block.decode("utf-8", errors="replace").split("\n"):
                if "iteration " in line or " loss at " in line:
                    kept += 1
        return kept

    def match():
        return sum(1 for text in texts for _ in pattern.finditer(text))

    def regex():
        return [m.groups() for text in texts for m in pattern.finditer(text)]

    def split():
        ends = [line.partition("iteration ")[2] for text in texts for line in text.split("\n")
                if line.endswith("|") and "| consumed samples" in line]
        return "|".join(ends).replace(":", ":|").replace("/", "|/|").split("|")[0::2]

    steps = {"per-line parser, every field": lambda: per_line(args.file), "lines": lines, "match": match,
             "regex": regex, "split": split}
    results = {label: cpu(args.repeat, run) for label, run in steps.items()}
    records = results["regex"][1]
    flat = [value for groups in records for value in groups]
    results["convert"] = converted = cpu(args.repeat, lambda: list(map(operator.call, cycle(converters), flat)))
    keys = ("iteration", "train_iters", *(FIELDS[name][0] for name in names))
    template = dict.fromkeys(("kind", *keys), None) | {"kind": "iteration"}

    def dicts():
        out, rows = [], zip(*[iter(converted[1])] * len(keys), strict=True)
        for row in rows:
            record = template.copy()
            record.update(zip(keys, row, strict=True))
            out.append(record)
        return out

    results["dicts"] = cpu(args.repeat, dicts)
    results["per-line parser, every field, again"] = cpu(args.repeat, lambda: per_line(args.file))
    print(f"{lines_total:,} lines, {len(records):,} whole iteration lines x {len(keys)} values; CPU s, best of "
          f"{args.repeat}")
    for label, (seconds, _) in results.items():
        print(f"{label:40s} {seconds:7.3f} {lines_total / seconds:12,.0f} lines/s if it were all")
    floor = sum(results[step][0] for step in ("lines", "convert", "dicts"))
    print(f"{'lines + convert + dicts (no extraction)':40s} {floor:7.3f} {lines_total / floor:12,.0f}")


if __name__ == "__main__":
    main()
