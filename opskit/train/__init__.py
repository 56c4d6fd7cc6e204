"""The embedded Megatron-DeepSpeed-style trainer (torch, deepspeed and megatron-core live only under this package)."""

REQUIRED_MODULES = ("torch", "deepspeed", "megatron.core", "tokenizers", "numpy")
"""What the trainer imports whatever its flags (the ``train`` extra): checked by the trainer at start and by
``opskit submit`` against the job's Python (:func:`opskit.submission.submit.job_python_problem`), one list for both."""

REHEARSAL_CLOCK_ENV = "OPSKIT_REHEARSAL_MINUTES_PER_ITERATION"
"""The variable ``opskit rehearse`` sets in the job's environment so that each iteration counts as that many minutes
of the exit-duration clock (read once by :meth:`opskit.train.config.TrainConfig.from_args`): the first task stops on
its time limit after a few iterations. Here, beside nothing that imports torch, so that ``opskit rehearse`` can name
it."""
