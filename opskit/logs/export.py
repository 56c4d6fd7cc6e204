"""Records out as JSON lines or CSV (``opskit logs parse``)."""

from __future__ import annotations

import csv
import json
from typing import TextIO

# CSV columns in this order, then ``extra.KEY`` for every unknown field met.
COLUMNS = ("file", "segment", "kind", "iteration", "train_iters", "consumed_samples", "consumed_tokens",
           "elapsed_time_per_iteration_s", "learning_rate", "global_batch_size", "lm_loss", "loss_scale", "grad_norm",
           "num_zeros", "params_norm", "curriculum_seqlen", "skipped_iterations", "nan_iterations",
           "samples_per_second", "tflops", "dataset", "where", "validation_lm_loss", "validation_ppl")


def write_jsonl(records: list[dict], out: TextIO) -> None:
    """One JSON object per line (NaN written as JSON's non-standard ``NaN``, as Python's json does)."""
    for record in records:
        out.write(json.dumps(record) + "\n")


def write_csv(records: list[dict], out: TextIO) -> None:
    """A header and one row per record; empty cells for fields a record lacks."""
    extras = sorted({key for r in records for key in r.get("extra", {})})
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*COLUMNS, *(f"extra.{key}" for key in extras)])
    for r in records:
        extra = r.get("extra", {})
        writer.writerow([*(_cell(r.get(c)) for c in COLUMNS), *(_cell(extra.get(k)) for k in extras)])


def _cell(value) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)
