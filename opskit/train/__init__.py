"""The embedded Megatron-DeepSpeed-style trainer (torch, deepspeed and megatron-core live only under this package)."""
