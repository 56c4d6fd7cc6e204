"""The formats of Megatron-DeepSpeed's structured flag values (``--split``, ``--data-path`` blends, the weighted split
paths files, ``--skip-train-iteration-range``): each parser is the one definition that the trainer reads its flags with
and that the spec's validation checks ``megatron_args`` / ``data`` values with."""

from __future__ import annotations


def parse_split(split: str) -> list[float]:
    """``--split`` weights (``969,30,1`` or ``969/30/1``; missing ones are 0) normalised to sum 1.

    Raises:
        ValueError: when a weight is not a number, is negative, or all are 0.
    """
    bad = ValueError(f"{split!r} is not up to three non-negative weights with a positive sum, e.g. 969,30,1")
    try:
        weights = [float(part) for part in (split.split(",") if "," in split else split.split("/"))]
    except ValueError:
        raise bad from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise bad
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def parse_data_path(values: list[str]) -> list[tuple[float, str]]:
    """``--data-path`` as ``[(weight, prefix)]``: one prefix (weight 1), or Megatron's blend ``W1 P1 W2 P2 ...`` with
    the weights normalised to sum 1.

    Raises:
        ValueError: for an odd number of values, a weight that is not a non-negative number, or weights summing to 0.
    """
    if len(values) == 1:
        return [(1.0, values[0])]
    bad = ValueError(f"{' '.join(values)!r} is not one prefix or WEIGHT PREFIX pairs with non-negative weights "
                     "summing above 0, e.g. 0.3 prefixA 0.7 prefixB")
    if len(values) % 2:
        raise bad
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise bad from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise bad
    return [(w / sum(weights), prefix) for w, prefix in zip(weights, values[1::2], strict=True)]


def parse_weighted_split_paths(text: str) -> list[tuple[str, list[tuple[float, float, float, str]]]]:
    """The contents of a ``--{train,valid}-weighted-split-paths-path`` file (Megatron-DeepSpeed's ParseDataPaths):
    one line of double-quoted groups ``"NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX" "NAME2: ..."``.

    Returns:
        ``[(name, [(weight, start, end, prefix), ...]), ...]``; weights as written, START/END fractions in [0, 1].

    Raises:
        ValueError: for anything else, quoting the part that is wrong.
    """
    line = text.strip()
    if not (line.startswith('"') and line.endswith('"')) or "\n" in line:
        raise ValueError('expected one line of double-quoted groups, e.g. "train: 0.3 0:0.95 /data/a, 0.7 0:0.95 '
                         '/data/b"')
    groups = []
    for group in line[1:-1].split('" "'):
        name, sep, body = group.partition(":")
        if not sep or not name.strip() or " " in name.strip():
            raise ValueError(f"{group[:60]!r}: a group starts with 'NAME:'")
        entries = []
        for entry in body.split(","):
            parts = entry.split()
            bad = ValueError(f"{entry.strip()!r} in group {name.strip()!r} is not 'WEIGHT START:END PREFIX' with "
                             "WEIGHT >= 0 and 0 <= START < END <= 1")
            try:
                weight, (start, end), prefix = float(parts[0]), (float(x) for x in parts[1].split(":")), parts[2]
            except (IndexError, ValueError):
                raise bad from None
            if len(parts) != 3 or weight < 0 or not 0 <= start < end <= 1:
                raise bad
            entries.append((weight, start, end, prefix))
        if sum(w for w, *_ in entries) <= 0:
            raise ValueError(f"group {name.strip()!r}: the weights sum to 0")
        groups.append((name.strip(), entries))
    return groups


def parse_skip_ranges(ranges: list[str]) -> list[list[int]]:
    """``--skip-train-iteration-range`` values (``START-END``, 1-based iterations, both included) as Megatron parses
    them: sorted, overlapping ranges merged (``1-5 2-6`` -> ``[[1, 6]]``).

    Raises:
        ValueError: for a value that is not ``START-END`` with ``1 <= START <= END``.
    """
    parsed = []
    for value in ranges:
        parts = value.split("-")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"{value!r} is not START-END, e.g. 101-200")
        start, end = int(parts[0]), int(parts[1])
        if not 1 <= start <= end:
            raise ValueError(f"{value!r}: the end of a skip range cannot be smaller than its start (both >= 1)")
        parsed.append([start, end])
    merged: list[list[int]] = []
    for start, end in sorted(parsed):
        if merged and merged[-1][1] >= start:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
