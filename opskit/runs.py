"""Every path of a run, in one place (the spec's ``paths.output`` is the run directory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opskit.data import output_paths
from opskit.spec import Spec


@dataclass(frozen=True)
class RunPaths:
    """Layout of a run directory; all paths absolute so rendered scripts work from any working directory."""

    root: Path

    @classmethod
    def of(cls, spec: Spec) -> RunPaths:
        return cls(Path(spec.paths.output).resolve())

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


def data_paths(spec: Spec) -> tuple[Path, Path]:
    """(tokenizer folder, indexed dataset prefix) that ``opskit data prepare`` writes for this spec."""
    return output_paths(Path(spec.data.dir).resolve(), spec.data.name)
