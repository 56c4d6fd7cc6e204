"""The embedded Megatron-DeepSpeed-style trainer (torch, deepspeed and megatron-core live only under this package)."""

REQUIRED_MODULES = ("torch", "deepspeed", "megatron.core", "tokenizers", "numpy")
"""What the trainer imports whatever its flags (the ``train`` extra): checked by the trainer at start and by
``opskit submit`` against the job's Python (:func:`opskit.submit.job_python_problem`), one list for both."""
