"""Every path of a run, in one place (the spec's ``paths.output`` is the run directory): no other module joins a
name onto a run directory. Importing it is cheap (no pydantic, no yaml: the spec is imported where a spec is read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opskit.ckpt.format.layout import STEP_DIR

if TYPE_CHECKING:
    from opskit.spec.schema import Spec


@dataclass(frozen=True)
class RunPaths:
    """Layout of a run directory; all paths absolute so rendered scripts work from any working directory."""

    root: Path

    @classmethod
    def of(cls, spec: Spec) -> RunPaths:
        """The run directory of a spec: ``paths.output``, ``$VAR`` expanded, a relative path taken from the spec's
        base directory (``Spec.base_dir``: the project holding ``trainings/``), so every command finds the same run
        from any current directory.

        Raises:
            SpecError: when ``paths.output`` uses an environment variable that is not set here.
        """
        return cls(folder_path(spec, spec.paths.output, "paths.output"))

    @classmethod
    def above(cls, checkpoints: Path) -> RunPaths:
        """The run a checkpoint folder belongs to (the folder above it, as ``--save <run>/checkpoints``): where a
        command given a bare checkpoint folder finds the run's log and converted steps."""
        return cls(checkpoints.parent)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def codecarbon(self) -> Path:
        """CodeCarbon's emissions CSVs (``--codecarbon-dir``), as BigScience kept them beside tensorboard/."""
        return self.root / "codecarbon"

    @property
    def main_log(self) -> Path:
        """All jobs of the chain append here, as BigScience's ``main_log.txt``."""
        return self.logs / "main_log.txt"

    @property
    def slurm_dir(self) -> Path:
        """Rendered job script, DeepSpeed config, resolved spec and SLURM's ``%x-%j.out`` files."""
        return self.root / "slurm"

    @property
    def script(self) -> Path:
        return self.slurm_dir / "train.slurm"

    @property
    def job_output(self) -> Path:
        """SLURM's ``--output`` of the training jobs (``%x`` job name, ``%j`` job id)."""
        return self.slurm_dir / "%x-%j.out"

    @property
    def ds_config(self) -> Path:
        return self.slurm_dir / "ds_config.json"

    @property
    def resolved_spec(self) -> Path:
        return self.slurm_dir / "spec.yaml"

    @property
    def kill_switch(self) -> Path:
        """While this file exists the running task saves and exits, and queued tasks exit at start."""
        return self.root / "kill-switch"

    @property
    def finished_flag(self) -> Path:
        """Written by the trainer (``--finished-flag-path``) once ``--train-samples`` are consumed: every later task
        exits 0 at start."""
        return self.root / "finished"

    @property
    def stopped_flag(self) -> Path:
        """Written after ``slurm.max_failures`` consecutive failed tasks: later tasks exit 0 at start."""
        return self.root / "chain-stopped"

    @property
    def ledger(self) -> Path:
        """One JSON line per task: outcome (COMPLETED, TIMEOUT, FAILED, NODE_FAIL, CANCELLED, SKIPPED), exit code,
        nodes."""
        return self.root / "ledger.jsonl"

    @property
    def report(self) -> Path:
        """The run's page (``opskit report``), published by ``opskit sync`` with the logs."""
        return self.logs / "report.html"

    @property
    def incidents(self) -> Path:
        """The divergence incidents, one record each (opskit.run.incidents)."""
        return self.root / "incidents.json"

    @property
    def bad_nodes(self) -> Path:
        """Nodes the next submission excludes (``--exclude``), one per line with why."""
        return self.root / "bad-nodes.txt"

    @property
    def node_logs(self) -> Path:
        """Each node's own copy of its output (:meth:`node_log`), where crash lines name their node."""
        return self.logs / "nodes"

    def node_log(self, job_id: str, node: str) -> Path:
        """Node ``node``'s copy of job ``job_id``'s output: ``logs/nodes/<job id>-<node>.log``."""
        return self.node_logs / f"{job_id}-{node}.log"

    @property
    def cron_dir(self) -> Path:
        """What ``opskit cron install`` wrote: its state file and, on SLURM, the self-resubmitting job script."""
        return self.root / "cron"

    @property
    def cron_record(self) -> Path:
        """What ``opskit cron install`` added (crontab line or SLURM job), read back by status and uninstall."""
        return self.cron_dir / "cron.json"

    @property
    def cron_script(self) -> Path:
        """The self-resubmitting hourly SLURM job (``--via slurm``)."""
        return self.cron_dir / "cron.slurm"

    @property
    def cron_output(self) -> Path:
        """SLURM's ``--output`` of the hourly job (``%x`` job name, ``%j`` job id)."""
        return self.cron_dir / "%x-%j.out"

    @property
    def cron_log(self) -> Path:
        """Output of the hourly commands run from the crontab (``--via crontab``)."""
        return self.cron_dir / "cron.log"

    @property
    def watchdog_dir(self) -> Path:
        """``opskit status`` state: the log offset and recent records, and which alerts were sent when."""
        return self.root / "watchdog"

    @property
    def watchdog_state(self) -> Path:
        """The watchdog's memory between runs: log offset, recent records, when things were last seen."""
        return self.watchdog_dir / "state.json"

    @property
    def alerts_state(self) -> Path:
        """Which alert went to which channel when (de-duplication, ``--ack``)."""
        return self.watchdog_dir / "alerts.json"

    def sync_manifest(self, url: str) -> Path:
        """``<run>/.sync-manifest-<url slug>.json``: what ``opskit sync`` last published to ``url`` (size, mtime,
        CRC32C per key)."""
        return self._sync_file("manifest", url).with_suffix(".json")

    def sync_lock(self, url: str) -> Path:
        """``<run>/.sync-lock-<url slug>``: held by the one ``opskit sync`` of this run to ``url`` running now."""
        return self._sync_file("lock", url)

    def _sync_file(self, what: str, url: str) -> Path:
        """The slug keeps the URL's last 80 letters and digits, ``_`` for the rest (no dot: a suffix can follow)."""
        slug = "".join(c if c.isalnum() else "_" for c in url).strip("_")[-80:]
        return self.root / f".sync-{what}-{slug}"

    @property
    def hf_dir(self) -> Path:
        """Converted Hugging Face folders, one ``global_stepN`` each: ``opskit ckpt convert`` writes them (its default
        output), ``opskit ckpt publish`` uploads them."""
        return self.root / "hf"


def checkpoint_dir_of(run_or_dir: str) -> tuple[Path, RunPaths]:
    """``opskit ckpt``'s RUN_OR_DIR: (checkpoint dir, its run). An existing folder is taken as is, and its run is the
    folder above it (:meth:`RunPaths.above`; above the checkpoint dir for a ``global_stepN`` folder); anything else (a
    spec name, prefix or YAML path) as a spec, whose run's ``checkpoints/`` it is.

    Raises:
        SpecError: not a folder, and no spec of that name; a file that is not a spec's YAML (``/etc/hostname``).
    """
    path = Path(run_or_dir)
    if path.is_dir():
        return path, RunPaths.above(path.parent if STEP_DIR.match(path.name) else path)
    from opskit.spec.files import SpecError

    if path.exists() and path.suffix not in (".yaml", ".yml"):  # never read as a spec: its error would mislead
        raise SpecError(f"{run_or_dir}: a file, not a checkpoint folder; expected a checkpoint dir, a global_stepN "
                        "folder or a spec name")
    from opskit.spec.load import load_spec  # pydantic, yaml: only for a spec name, not a folder

    run = RunPaths.of(load_spec(run_or_dir))
    return run.checkpoints, run


def folder_path(spec: Spec, value: str, field: str, environ: Mapping[str, str] | None = None) -> Path:
    """A folder the spec names (``Spec.local_path``), refused when it, or a folder above it, is a file: every command
    would otherwise fail on it later with an OS error of its own (``Spec.refuse``: a ``Spec.with_placeholders`` copy
    records it and goes on).

    Raises:
        SpecError: naming the file, the field and the path that is a file; an unset ``$VAR``.
    """
    path = spec.local_path(value, field, environ)
    if spec.unsettled(field):  # an unset $VAR: not a path of this machine
        return path
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        spec.refuse(field, f"{spec.file or spec.name}: {field}: {existing} is a file, not a folder")
    return path


def data_paths(spec: Spec, environ: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """(tokenizer folder, indexed dataset prefix) that ``opskit data prepare`` writes for this spec.

    Raises:
        DataError: for a spec whose data was prepared elsewhere (no ``data.corpus``): nothing to prepare.
        SpecError: when ``data.dir`` uses an environment variable that is not set here.
    """
    from opskit.data.corpus import DataError, output_paths  # not needed by the hourly commands (~20 ms)

    if not spec.data.prepared_by_opskit:
        source = "data_path" if spec.data.data_path is not None else "train_weighted_split_paths_path"
        raise DataError(f"{spec.file or spec.name}: data: this spec reads a dataset prepared elsewhere "
                        f"(data.{source}); `opskit data prepare` only builds a data.corpus: prepare it with "
                        "Megatron's tools/preprocess_data.py, or give the spec a corpus and dir")
    return output_paths(folder_path(spec, spec.data.dir, "data.dir", environ), spec.data.name)


def corpus_inputs(spec: Spec) -> tuple[str | list[str], Path]:
    """(corpus, output folder) to pass to ``opskit.data.corpus.prepare_data`` for a spec: ``$VAR`` expanded, corpus
    files taken from the spec's base directory (as ``data.dir``); the named corpus ``kjv`` as it is.

    Raises:
        DataError: for a spec whose data was prepared elsewhere (see :func:`data_paths`).
        SpecError: an unset ``$VAR``.
    """
    from opskit.data.corpus import KJV  # as in data_paths

    tokenizer_dir, _ = data_paths(spec)
    corpus = spec.data.corpus
    if isinstance(corpus, list):
        return [str(spec.local_path(c, "data.corpus")) for c in corpus], tokenizer_dir.parent
    return (corpus if corpus == KJV else str(spec.local_path(corpus, "data.corpus"))), tokenizer_dir.parent
