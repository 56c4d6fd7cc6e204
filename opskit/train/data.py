"""Training samples from Megatron's mmap indexed dataset, in a deterministic order that resumes from consumed samples.

Like Megatron's GPTDataset: each epoch shuffles the documents, concatenates them (each already ends with the eod token)
and cuts windows of ``seq_length + 1`` tokens with stride ``seq_length``; the window order is shuffled too. Only
per-document arrays are built (O(documents) memory), tokens are read from the mmap on demand.

Like Megatron's MegatronPretrainingSampler: global sample ``i`` is a pure function of ``i`` and the seed, every
micro-batch step takes the next ``MBS * DP`` samples and DP rank ``r`` keeps the ``r``-th slice, so a run resumed at
``consumed_samples`` sees exactly the data the uninterrupted run would have seen.

Like Megatron's ``--split``: the documents are cut, in index order, into train / valid / test ranges
(``split_document_ranges``), and each split's samples only ever read its own documents.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from opskit.train.args import parse_split


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Document index ranges ``[(begin, end)]`` of train, valid and test: Megatron's get_train_valid_test_split_
    (each split gets ``round(weight * documents)`` documents in index order; the rounding error comes off the
    last boundaries so that the test range ends at ``num_documents``)."""
    bounds = [0]
    for weight in parse_split(split):
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class GPTSamples:
    """Windows of ``seq_length + 1`` tokens over (a range of) the documents of an indexed dataset.

    Args:
        dataset: megatron-core ``IndexedDataset`` (one sequence per document).
        seq_length: tokens per sample fed to the model; a sample holds one more for the shifted labels.
        seed: shuffling seed (``--seed``).
        documents: ``(begin, end)`` document indices this split reads (default: all).

    Raises:
        ValueError: when those documents hold fewer than ``seq_length + 1`` tokens.
    """

    def __init__(self, dataset: IndexedDataset, seq_length: int, seed: int,
                 documents: tuple[int, int] | None = None):
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
        begin, end = documents if documents is not None else (0, len(dataset.sequence_lengths))
        self.first_document = begin
        self.doc_sizes = np.asarray(dataset.sequence_lengths, dtype=np.int64)[begin:end]
        total = int(self.doc_sizes.sum())
        self.samples_per_epoch = (total - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise ValueError(f"documents {begin}..{end - 1} hold {total} tokens, fewer than seq_length + 1 = "
                             f"{seq_length + 1}")
        self._cached_epoch: tuple[int, tuple] | None = None

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, token offset where each document starts, window order) of one epoch."""
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            doc_order = rng.permutation(len(self.doc_sizes))
            starts = np.concatenate([[0], np.cumsum(self.doc_sizes[doc_order])])
            self._cached_epoch = (epoch, (doc_order, starts, rng.permutation(self.samples_per_epoch)))
        return self._cached_epoch[1]

    def __getitem__(self, index: int) -> np.ndarray:
        """Global sample ``index`` (any int >= 0; epochs repeat with a new shuffle): ``[seq_length + 1]`` int64."""
        epoch, position = divmod(index, self.samples_per_epoch)
        doc_order, starts, window_order = self._epoch(epoch)
        begin = int(window_order[position]) * self.seq_length
        end = begin + self.seq_length + 1
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        pieces, doc = [], first
        while starts[doc] < end:
            lo, hi = max(begin, int(starts[doc])), min(end, int(starts[doc + 1]))
            document = self.first_document + int(doc_order[doc])
            pieces.append(self.dataset.get(document, offset=lo - int(starts[doc]), length=hi - lo))
            doc += 1
        return np.concatenate(pieces).astype(np.int64)


def micro_batches(samples: GPTSamples, consumed_samples: int, micro_batch_size: int, dp_size: int,
                  dp_rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens [MBS, s], labels [MBS, s])`` for this DP rank, starting at ``consumed_samples``."""
    step = consumed_samples
    while True:
        first = step + dp_rank * micro_batch_size
        batch = torch.from_numpy(np.stack([samples[i] for i in range(first, first + micro_batch_size)]))
        yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        step += micro_batch_size * dp_size
