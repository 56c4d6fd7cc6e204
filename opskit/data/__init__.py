"""Training data: the corpus (download, tokenize, Megatron's indexed dataset)."""
