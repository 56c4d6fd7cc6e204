"""Sample text from a converted Hugging Face folder with transformers: the quickest proof that a conversion works."""

from __future__ import annotations

from pathlib import Path


def generate(model_dir: str | Path, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    """Sampled continuation of ``prompt`` (top-k 40, temperature 0.8, seeded, so it repeats run to run).

    Raises:
        FileNotFoundError: when ``model_dir`` has no ``config.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model folder)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)
