"""Sample text from a converted Hugging Face folder with transformers: the quickest proof that a conversion works."""

from __future__ import annotations

from pathlib import Path

from opskit.errors import OpskitError


class GenerateError(OpskitError, ValueError):
    """A prompt the model cannot take; one line."""


def generate(model_dir: str | Path, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
    """Sampled continuation of ``prompt`` (top-k 40, temperature 0.8, seeded, so it repeats run to run); at most
    ``max_new_tokens`` tokens, fewer where the model's positions (``n_positions``) end first.

    Raises:
        FileNotFoundError: when ``model_dir`` has no ``config.json``.
        GenerateError: the tokenizer gives the prompt a token id outside the model's vocabulary (a folder converted
            before ``ckpt convert`` checked its tokenizer), or the prompt fills every position.
    """
    import torch  # torch, transformers: only when sampling; a missing one is named by the CLI
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model folder)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    vocab_size = model.config.vocab_size
    if outside := sorted({i for i in ids if not 0 <= i < vocab_size}):
        raise GenerateError(f"{model_dir}: the tokenizer gives the prompt token ids {outside}, outside the model's "
                            f"vocabulary of {vocab_size} (config.json vocab_size); convert the checkpoint again: "
                            "`opskit ckpt convert` refuses such a tokenizer")
    positions = getattr(model.config, "n_positions", None)  # GPT-2's learned positions end; BLOOM's ALiBi does not
    if positions is not None:
        if len(ids) >= positions:
            raise GenerateError(f"--prompt: {len(ids)} tokens, the model has {positions} positions (config.json "
                                "n_positions): shorten the prompt")
        max_new_tokens = min(max_new_tokens, positions - len(ids))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)
