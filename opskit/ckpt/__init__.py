"""Megatron-DeepSpeed checkpoints: read, check, convert (torch is imported only inside functions)."""
