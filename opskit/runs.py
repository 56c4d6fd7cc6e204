"""Every path of a run, in one place (the spec's ``paths.output`` is the run directory)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opskit.data import DataError, output_paths
from opskit.spec import Spec


@dataclass(frozen=True)
class RunPaths:
    """Layout of a run directory; all paths absolute so rendered scripts work from any working directory."""

    root: Path

    @classmethod
    def of(cls, spec: Spec) -> RunPaths:
        """The run directory of a spec (``paths.output``, ``$VAR`` expanded).

        Raises:
            SpecError: when ``paths.output`` uses an environment variable that is not set here.
        """
        return cls(Path(spec.expand(spec.paths.output, "paths.output")).resolve())

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
    def ds_config(self) -> Path:
        return self.slurm_dir / "ds_config.json"

    @property
    def resolved_spec(self) -> Path:
        return self.slurm_dir / "spec.yaml"

    @property
    def kill_switch(self) -> Path:
        return self.root / "kill-switch"

    def hf_dir(self, tag: str) -> Path:
        """Default output of ``opskit ckpt convert`` for one checkpoint step."""
        return self.root / "hf" / tag


def data_paths(spec: Spec, environ: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """(tokenizer folder, indexed dataset prefix) that ``opskit data prepare`` writes for this spec.

    Raises:
        DataError: for a spec whose data was prepared elsewhere (no ``data.corpus``): nothing to prepare.
        SpecError: when ``data.dir`` uses an environment variable that is not set here.
    """
    if not spec.data.prepared_by_opskit:
        source = "data_path" if spec.data.data_path is not None else "train_weighted_split_paths_path"
        raise DataError(f"{spec.file or spec.name}: data: this spec reads a dataset prepared elsewhere "
                        f"(data.{source}); `opskit data prepare` only builds a data.corpus: prepare it with "
                        "Megatron's tools/preprocess_data.py, or give the spec a corpus and dir")
    return output_paths(Path(spec.expand(spec.data.dir, "data.dir", environ)).resolve(), spec.data.name)


def corpus_inputs(spec: Spec) -> tuple[str | list[str], Path]:
    """(corpus, output folder) to pass to ``opskit.data.prepare_data`` for a spec, ``$VAR`` expanded.

    Raises:
        DataError: for a spec whose data was prepared elsewhere (see :func:`data_paths`).
        SpecError: an unset ``$VAR``.
    """
    tokenizer_dir, _ = data_paths(spec)
    corpus = spec.data.corpus
    if isinstance(corpus, list):
        corpus = [spec.expand(c, "data.corpus") for c in corpus]
    else:
        corpus = spec.expand(corpus, "data.corpus")
    return corpus, tokenizer_dir.parent
