"""Megatron-DeepSpeed's and DeepSpeed's rules, written once: the spec's validation, ``opskit plan``, the job renderer
and the trainer all use these modules. Torch-free and pydantic-free, so the trainer imports them without the CLI side
and ``opskit status`` stays light. Their errors are ``opskit.errors.OpskitError``s (a module of one class)."""
