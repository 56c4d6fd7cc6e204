"""``opskit ckpt publish``: converted steps to a Hub repository, as the BLOOM intermediate checkpoints were.

Each ``global_stepN`` folder made by ``opskit ckpt convert`` becomes ONE commit on ``main`` (its files at the repo root,
so ``from_pretrained(repo, revision="global_stepN")`` loads it) with a regenerated model card, then the tag
``global_stepN`` on that commit. Steps whose tag exists are skipped, so an interrupted publish resumes. Files of the
previously published step that the new one lacks (a different shard count) are deleted in the same commit.

The card lists every published step with its consumed tokens (from the checkpoint) and the validation lm loss logged
at that iteration (from ``main_log.txt``); these facts are kept in ``<hf dir>/.opskit-published.json`` per repository,
beside the converted folders.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.info import describe_step
from opskit.ckpt.format.layout import STEP_DIR, CheckpointFormatError
from opskit.fsutil import atomic_write_text
from opskit.logs.parse import read_from
from opskit.targets import open_target
from opskit.targets.base import TargetError, TargetOptions

RECORD = ".opskit-published.json"


@dataclass(frozen=True)
class Published:
    """One step: ``tag`` (``global_stepN``), ``commit`` id (None when skipped: the tag already existed), files sent."""

    tag: str
    commit: str | None
    files: int


def converted_steps(hf_root: Path) -> dict[int, Path]:
    """Iteration -> converted folder (``global_stepN`` with ``config.json``) under ``hf_root``."""
    found = {}
    for folder in sorted(hf_root.iterdir()) if hf_root.is_dir() else []:
        match = STEP_DIR.match(folder.name)
        if match and (folder / "config.json").is_file():
            found[int(match.group(1))] = folder
    return found


def model_card(repo_id: str, rows: list[dict]) -> str:
    """README.md: what the repo is, how to load a step, one table row per published step (ascending)."""
    lines = ["---", "library_name: transformers", "tags:", "- opskit", "- megatron-deepspeed", "---", "",
             f"# {repo_id.split('/')[-1]}: intermediate checkpoints", "",
             "Each training checkpoint is a tagged revision of this repository:", "", "```python",
             "from transformers import AutoModelForCausalLM", "",
             f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", revision="global_step{rows[-1]["step"]}")',
             "```", "", "| revision | iteration | consumed tokens | validation lm loss |", "|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: r["step"]):
        tokens = "—" if row.get("tokens") is None else f"{row['tokens']:,}"
        loss = "—" if row.get("validation_loss") is None else f"{row['validation_loss']:.4f}"
        lines.append(f"| `global_step{row['step']}` | {row['step']:,} | {tokens} | {loss} |")
    return "\n".join(lines) + "\n\nPublished with `opskit ckpt publish`.\n"


def publish(hf_root: str | Path, url: str, steps: list[int] | None, facts: Callable[[int], dict],
            options: TargetOptions | None = None, progress: Callable[[str], None] | None = None) -> list[Published]:
    """Publish converted ``steps`` (None: all) under ``hf_root`` to the Hub repository ``url``.

    Args:
        facts: ``facts(step)`` -> ``{"tokens": int | None, "validation_loss": float | None}`` for the card.

    Raises:
        CheckpointFormatError: nothing converted, or an asked step that is not.
        TargetError: not an hf:// URL, or the Hub failed after retries (steps tagged before that stay published).
    """
    hf_root = Path(hf_root)
    if not url.startswith("hf://"):
        raise TargetError(f"--to {url}: expected hf://[datasets/]org/repo")
    available = converted_steps(hf_root)
    chosen = sorted(available) if steps is None else sorted(steps)
    if not chosen:
        raise CheckpointFormatError(f"{hf_root}: no converted global_stepN folders: run `opskit ckpt convert ... "
                                    "--all` first")
    missing = [s for s in chosen if s not in available]
    if missing:
        raise CheckpointFormatError(f"{hf_root / f'global_step{missing[0]}'}: not converted (no config.json): run "
                                    f"`opskit ckpt convert ... --step {missing[0]}` first")
    options = options or TargetOptions(create_repo=True)
    target = open_target(url, options=options)
    done_tags = target.tags()
    record_path = hf_root / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    mine = record.setdefault(url, {"steps": {}, "files": []})
    results = []
    for step in chosen:
        tag = f"global_step{step}"
        if tag in done_tags:
            results.append(Published(tag, None, 0))
            continue
        if progress:
            progress(tag)
        folder = available[step]
        files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*"))
                 if p.is_file() and not p.name.startswith(".")}
        mine["steps"][str(step)] = {"step": step, **facts(step)}
        rows = [row for key, row in mine["steps"].items() if f"global_step{key}" in done_tags or int(key) == step]
        card = model_card(target.repo_id, rows).encode()
        stale = [key for key in mine["files"] if key not in files and key != "README.md"]
        commit = target.commit_files({**files, "README.md": card}, f"{tag}: converted checkpoint (iteration {step:,})",
                                     delete=stale)
        target.tag(tag, commit)
        done_tags.add(tag)
        mine["files"] = sorted(files)
        atomic_write_text(record_path, json.dumps(record, indent=1, sort_keys=True))
        results.append(Published(tag, commit, len(files)))
    return results


def publish_checkpoint(checkpoint_dir: Path, run_hf_dir: Path, main_log: Path, url: str, step: int | None = None,
                       hf_dir: Path | None = None, public: bool = False,
                       progress: Callable[[str], None] | None = None) -> list[Published]:
    """``opskit ckpt publish``: the converted ``step`` (None: every converted step) of ``hf_dir`` (default: the run's
    ``run_hf_dir``, where ``opskit ckpt convert`` writes) to ``url``, into a repository created private unless
    ``public``, with a card of the tokens and validation loss of each step (:func:`card_facts`). Raises as
    :func:`publish`."""
    return publish(hf_dir or run_hf_dir, url, None if step is None else [step], card_facts(checkpoint_dir, main_log),
                   TargetOptions(create_repo=True, private=not public), progress=progress)


def card_facts(checkpoint_dir: Path, main_log: Path) -> Callable[[int], dict]:
    """The ``facts`` argument of :func:`publish` for a run: the tokens a step consumed, from its checkpoint folder in
    ``checkpoint_dir`` (None when that step is gone), and the validation loss ``main_log`` logged at that iteration
    (None when none was)."""
    losses = validation_losses(main_log)

    def facts(iteration: int) -> dict:
        step_dir = checkpoint_dir / f"global_step{iteration}"
        tokens = describe_step(step_dir).consumed_tokens if step_dir.is_dir() else None
        return {"tokens": tokens, "validation_loss": losses.get(iteration)}

    return facts


def validation_losses(main_log: Path) -> dict[int, float]:
    """Iteration -> validation lm loss logged at that iteration in ``main_log`` (the last one wins after a restart)."""
    if not main_log.is_file():
        return {}
    return {r["iteration"]: r["validation_lm_loss"] for r in read_from(main_log).records
            if r.get("kind") == "validation" and r.get("iteration") is not None}
