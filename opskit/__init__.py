"""opskit: operations toolkit for months-long LLM pretraining on SLURM clusters."""

__version__ = "0.1.0"
