"""The grammar of Megatron-family log lines (reference section 2.3) and the per-line parser that applies it.

An iteration line gives ``{"kind": "iteration", "iteration", "train_iters", "consumed_samples", "consumed_tokens",
"elapsed_time_per_iteration_s", "learning_rate", "global_batch_size", "lm_loss", "loss_scale", "grad_norm",
"num_zeros", "skipped_iterations", "nan_iterations", "samples_per_second", "tflops"}`` with the fields the line has
(snake_case of the log's own names; times always in seconds), unknown ``key: value |`` fields under ``"extra"``. A
validation line gives ``{"kind": "validation", "iteration" (None at the end of training), "dataset", "where",
"validation_lm_loss", "validation_ppl"}``. A line with srun ``--label``'s task id (``3: ...``: a multi-node job's
main_log.txt) has it as ``"rank"`` right after ``"kind"``; an unlabelled line has no ``rank`` key.

Accepted: the 2021 ``(ms)`` format, the 2022 ``(s)`` format, ``[defaultN]:`` prefixes of ``torchrun --tee``,
timestamps and logger prefixes (anything before ``iteration``). An iteration or validation line that was wrapped, cut
mid-way or garbled by another rank's output is ``CUT``: skipped and counted, never guessed at.

The one home of these rules: :mod:`opskit.logs.parse` reads files with them, :mod:`opskit.logs.bulk` builds the
common lines column-wise from the same ``FIELDS`` and sends every other line to :func:`parse_record`. Speed: str
methods only, no regex (bench/log_parse.py).
"""

from __future__ import annotations

from collections.abc import Iterable

LABEL_DIGITS = 9
"""Most digits an srun label has here (SLURM's task ids are far shorter; a longer run of digits is no label)."""
ITERATION_WORD = "iteration "
"""What an iteration line's header starts with (after any prefix)."""
VALIDATION_WORDS = " loss at "
"""What a validation line has before its first ``|`` (`` validation loss at iteration 1000 |``)."""
CUT = object()
""":func:`parse_record`'s result for a record line that is not whole."""


def seconds(milliseconds: float) -> float:
    """Milliseconds as seconds, rounded so that ``31074.1`` gives 31.0741, not 31.074099999999998."""
    return round(milliseconds / 1000, 9)


def milliseconds(text: str) -> float:
    """The 2021 format's ``elapsed time per iteration (ms)`` value, in seconds."""
    return seconds(float(text))


FIELDS = {
    " consumed samples": ("consumed_samples", int),
    " consumed tokens": ("consumed_tokens", int),
    " elapsed time per iteration (s)": ("elapsed_time_per_iteration_s", float),
    " elapsed time per iteration (ms)": ("elapsed_time_per_iteration_s", milliseconds),
    " learning rate": ("learning_rate", float),
    " global batch size": ("global_batch_size", int),
    " lm loss": ("lm_loss", float),
    " loss scale": ("loss_scale", float),
    " grad norm": ("grad_norm", float),
    " num zeros": ("num_zeros", float),
    " params norm": ("params_norm", float),
    " curriculum seqlen": ("curriculum_seqlen", int),
    " number of skipped iterations": ("skipped_iterations", int),
    " number of nan iterations": ("nan_iterations", int),
    " samples per second": ("samples_per_second", float),
    " TFLOPs": ("tflops", float),
    " lm loss value": ("validation_lm_loss", float),
    " lm loss PPL": ("validation_ppl", float),
}
"""The log's own field names, as split out of `` name: value |`` (leading space kept: no strip on the fast path) ->
(record key, converter). Integer fields printed with a decimal point fall back to ``int(float(text))``."""


def snake_case(name: str) -> str:
    """``"elapsed time per iteration (s)"`` -> ``"elapsed_time_per_iteration_s"``."""
    out = "".join(c if c.isalnum() else "_" for c in name.lower())
    return "_".join(part for part in out.split("_") if part)


def iteration_fields() -> set[str]:
    """Record keys an iteration line can have outside ``extra`` (what ``fields=`` accepts)."""
    return {"iteration", "train_iters", *(key for key, _ in FIELDS.values() if not key.startswith("validation_"))}


def keep_only(record, keep: frozenset[str] | None):
    """An iteration record cut down to the ``keep`` keys (order kept; None keeps all); anything else unchanged."""
    if keep is None or not isinstance(record, dict) or record["kind"] != "iteration":
        return record
    return {key: value for key, value in record.items() if key in keep}


def _fields(record: dict, rest: str):
    """Fill ``record`` from `` key: value | key: value |`` and return it; ``CUT`` when the text is not whole."""
    parts = rest.split("|")
    if parts[-1] and not parts[-1].isspace():  # a whole line ends with "|": text after it means it was cut
        return CUT
    del parts[-1]
    known = FIELDS
    for part in parts:
        name, sep, value = part.partition(":")
        spec = known.get(name)
        if spec is not None:
            try:
                record[spec[0]] = spec[1](value)
                continue
            except ValueError:
                pass  # "0.0" for an integer field, or garbage: _other tells which
        if not sep:
            return CUT
        try:
            _other(record, name, value)
        except ValueError:
            return CUT
    return record


def _count(text: str) -> int:
    """An integer field printed with a decimal point (``2048.0``).

    Raises:
        ValueError: not a finite number (``inf`` as well as ``nan`` or garbage).
    """
    try:
        return int(float(text))
    except OverflowError as e:
        raise ValueError(f"{text!r} is not a count") from e


def _other(record: dict, name: str, value: str) -> None:
    """A field off the fast path: odd spacing, an integer printed as ``0.0``, or an unknown name (kept under
    ``extra``: a number when it reads as one, else its text).

    Raises:
        ValueError: a known field whose value is not a number, or a name with no letters (garbage).
    """
    spec = FIELDS.get(" " + name.strip())
    if spec is not None:
        key, convert = spec
        record[key] = _count(value) if convert is int else convert(value)
        return
    key = snake_case(name)
    if not key:
        raise ValueError(name)
    try:
        number = float(value)
    except ValueError:
        number = value.strip()
    record.setdefault("extra", {})[key] = number


def srun_label(line: str) -> int | None:
    """srun ``--label``'s task id at the start of ``line`` (``"12: "``; spaces before it pad ids to the widest one's
    width: ``" 3: "``), None when the line has none. With one task per node, as opskit's job script runs torchrun,
    the task id is the node's rank (``--node_rank $SLURM_PROCID``)."""
    start = len(line) - len(line.lstrip(" ")) if line[:1] == " " else 0
    end = line.find(": ", start, start + LABEL_DIGITS + 2)
    digits = line[start:end] if end > start else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _kind(kind: str, rank: int | None) -> dict:
    """A record's first keys: ``kind``, then ``rank`` for a labelled line."""
    return {"kind": kind} if rank is None else {"kind": kind, "rank": rank}


def _iteration(line: str, at: int, bar: int):
    """Record of the line whose ``iteration `` word starts at ``at`` (``bar``: its first ``|``); None when it is not an
    iteration line at all (``saving checkpoint at iteration 100 to ...``), ``CUT`` when it is one but not whole."""
    done, slash, total = line[at + len(ITERATION_WORD):bar if bar >= 0 else len(line)].partition("/")
    if bar < 0:  # cut inside the header ("iteration    127") or another line ("saving checkpoint at iteration 100 to",
        # "successfully loaded checkpoint from /ckpt at iteration 346": a header is never preceded by "at")
        cut = (done + total).strip().replace(" ", "").isdigit() and not line[:at].endswith("at ")
        return CUT if cut else None
    try:
        numbers = int(done), int(total)
    except ValueError:
        return None
    record = _kind("iteration", srun_label(line))
    record["iteration"], record["train_iters"] = numbers
    return _fields(record, line[bar + 1:])


def _validation(line: str, head: str, at: int):
    """`` {name} loss at {where} | lm loss value: X | lm loss PPL: Y | ``; ``at`` indexes `` loss at `` in ``head``."""
    words = head[:at].rsplit("]:", 1)[-1].split()
    where = head[at + len(VALIDATION_WORDS):].strip()
    iteration = None
    if where.startswith(ITERATION_WORD):
        try:
            iteration = int(where[len(ITERATION_WORD):])
        except ValueError:
            return CUT
    record = _kind("validation", srun_label(line))
    record.update(iteration=iteration, dataset=words[-1] if words else "", where=where)
    record = _fields(record, line[len(head) + 1:])
    if record is CUT or "validation_lm_loss" not in record:
        return CUT
    record.setdefault("validation_ppl", None)
    return record


def parse_record(line: str):
    """One line -> its record, None (not a record line) or ``CUT`` (a record line that is not whole)."""
    bar = line.find("|")
    head = line if bar < 0 else line[:bar]
    loss_at = head.find(VALIDATION_WORDS)
    if loss_at >= 0:
        return CUT if bar < 0 else _validation(line, head, loss_at)
    at = head.find(ITERATION_WORD)
    if at < 0:
        return None
    return _iteration(line, at, bar)


def parse_line(line: str) -> dict | None:
    """One log line -> its iteration or validation record; None for any other line and for cut or garbled ones."""
    record = parse_record(line)
    return None if record is CUT else record


def parse_iteration_line(line: str) -> dict | None:
    """One iteration line -> ``{"kind": "iteration", "iteration": int, "train_iters": int, "lm_loss": float, ...}``;
    None for any other line (validation lines included) and for cut or garbled ones."""
    record = parse_line(line)
    return record if record is not None and record["kind"] == "iteration" else None


def scan_lines(lines: Iterable[str], records: list, keep: frozenset[str] | None) -> int:
    """Append the records of ``lines`` to ``records`` (cut down as :func:`keep_only` does); returns how many record
    lines were ``CUT``."""
    append, cut = records.append, 0
    iteration, validation = ITERATION_WORD, VALIDATION_WORDS  # locals: this loop sees every line of a log
    for line in lines:
        # Prefilter with two substring tests: most lines of a real log are neither kind.
        if iteration not in line and validation not in line:
            continue
        record = parse_record(line)
        if record is None:
            continue
        if record is CUT:
            cut += 1
        else:
            append(record if keep is None else keep_only(record, keep))
    return cut


def scan_bytes(data: bytes, records: list, keep: frozenset[str] | None) -> int:
    """:func:`scan_lines` of complete lines as read from a file (bad UTF-8 bytes replaced)."""
    return scan_lines(data.decode("utf-8", errors="replace").split("\n"), records, keep)


MEMORY_WORDS = " memory (MB) |"
"""What Megatron's one-time GPU memory line has after its ``(after K iterations)`` (``opskit.train.log.memory_line``
writes it): ``[Rank R] (after K iterations) memory (MB) | allocated: A | max allocated: M | reserved: ... |``."""


def parse_memory_line(text: str) -> dict | None:
    """A memory line (:data:`MEMORY_WORDS`, after any prefix) -> ``{"rank", "iteration", "allocated_mib",
    "max_allocated_mib", "reserved_mib", "max_reserved_mib"}`` (MiB: Megatron's "MB" are 2**20 bytes, as
    ``torch.cuda.max_memory_allocated() / 2**20``); fields the line lacks are absent. None for any other line and for
    a cut or garbled one."""
    at = text.find(MEMORY_WORDS)
    head = text[:at]
    rank_at, after_at = head.rfind("[Rank "), head.rfind("] (after ")
    if at < 0 or rank_at < 0 or after_at < rank_at or not head.endswith(" iterations)"):
        return None
    try:
        record = {"rank": int(head[rank_at + 6:after_at]),
                  "iteration": int(head[after_at + 9:-len(" iterations)")])}
        for part in text[at + len(MEMORY_WORDS):].split("|"):
            name, colon, value = part.partition(":")
            if colon and name.strip() in ("allocated", "max allocated", "reserved", "max reserved"):
                record[f"{snake_case(name)}_mib"] = float(value)
    except ValueError:
        return None
    return record if "max_allocated_mib" in record else None
