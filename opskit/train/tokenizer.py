"""The tokenizer's part of the model: its vocabulary size (a PretrainedFromHF folder or Hugging Face Hub tokenizer's
``tokenizer.json``, or GPT-2's BPE files) and Megatron's padding of it. The trainer never tokenizes: its data is
token ids already (Megatron's indexed dataset).
"""

from __future__ import annotations

from pathlib import Path

from opskit.rules.model_size import VocabPaddingError, padded_vocab_size
from opskit.train.config import TrainConfig, TrainerError


def vocab_sizes(config: TrainConfig, rank: int) -> tuple[int, int]:
    """Megatron's ``original_vocab_size`` (the tokenizer's) and ``padded_vocab_size`` (the model's, saved in every
    checkpoint), with Megatron's line about the padding on ``rank`` 0.

    Raises:
        TrainerError: a tokenizer that cannot be read (names the flag); ``--pad-vocab-size-to`` below its vocabulary.
    """
    original = _load_vocab_size(config)
    padded = _padded_vocab(config, original)
    if rank == 0:
        print(f" > padded vocab (size: {original}) with {padded - original} dummy tokens (new size: {padded})",
              flush=True)
    return original, padded


def _padded_vocab(config: TrainConfig, vocab_size: int) -> int:
    """Megatron's padding (:func:`opskit.rules.model_size.padded_vocab_size`): ``--pad-vocab-size-to`` or up to a
    multiple of make_vocab_size_divisible_by * TP.

    Raises:
        TrainerError: ``--pad-vocab-size-to`` below the tokenizer's vocabulary.
    """
    try:
        return padded_vocab_size(vocab_size, config.make_vocab_size_divisible_by, config.tensor_model_parallel_size,
                                 config.pad_vocab_size_to)
    except VocabPaddingError as e:
        raise TrainerError(f"--pad-vocab-size-to {e}") from None


def _load_vocab_size(config: TrainConfig) -> int:
    """The tokenizer's vocabulary size (Megatron's ``tokenizer.vocab_size``, before padding): a PretrainedFromHF
    folder's ``tokenizer.json``, or GPT-2's BPE files (``--vocab-file`` + ``--merge-file``, 50257 for GPT-2's own)."""
    from tokenizers import Tokenizer

    if config.tokenizer_type == "GPT2BPETokenizer":
        from tokenizers.models import BPE

        for flag, file in (("--vocab-file", config.vocab_file), ("--merge-file", config.merge_file)):
            if not Path(file).is_file():
                raise TrainerError(f"{flag} {file}: no such file")
        try:
            return Tokenizer(BPE.from_file(config.vocab_file, config.merge_file)).get_vocab_size()
        except Exception as e:  # the tokenizers library raises its own untyped errors for bad JSON or merges
            raise TrainerError(f"--vocab-file {config.vocab_file} / --merge-file {config.merge_file}: not GPT-2 BPE "
                               f"files ({e})") from None
    name = config.tokenizer_name_or_path
    path = Path(name) / "tokenizer.json"
    if not path.is_file() and not Path(name).is_dir():
        path = _hub_tokenizer_file(name)
    if not path.is_file():
        raise TrainerError(f"--tokenizer-name-or-path {name}: no tokenizer.json there")
    return Tokenizer.from_file(str(path)).get_vocab_size()


def _hub_tokenizer_file(name: str) -> Path:
    """``tokenizer.json`` of a Hugging Face Hub tokenizer (tr11's ``bigscience-catalogue-data-dev/...``), from the
    Hugging Face cache or downloaded into it (``HF_HUB_OFFLINE=1`` on nodes without internet; ``HF_TOKEN`` or
    ``huggingface-cli login`` for private ones).

    Raises:
        TrainerError: when it is neither a local folder nor a Hub tokenizer that can be had.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        return Path(hf_hub_download(repo_id=name, filename="tokenizer.json"))
    except (HFValidationError, EntryNotFoundError, OSError) as e:  # bad id; no such file, no network, not cached
        raise TrainerError(f"--tokenizer-name-or-path {name}: not a local folder, and no tokenizer.json from the "
                           f"Hugging Face Hub or its cache ({type(e).__name__})") from None
