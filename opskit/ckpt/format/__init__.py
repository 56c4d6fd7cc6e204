"""The Megatron-DeepSpeed checkpoint format, torch-free: layout, the one definition of a complete step, tensor files
and manifests. The trainer writes through it; every ``opskit ckpt`` tool reads through it."""
