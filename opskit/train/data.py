"""Training samples from Megatron's mmap indexed dataset, in a deterministic order that resumes from consumed samples.

Like Megatron's GPTDataset: each epoch shuffles the documents, concatenates them (each already ends with the eod token)
and cuts windows of ``seq_length + 1`` tokens with stride ``seq_length``; the window order is shuffled too. Only
per-document arrays are built (O(documents) memory), tokens are read from the mmap on demand.

Like Megatron's MegatronPretrainingSampler: global sample ``i`` is a pure function of ``i`` and the seed, every
micro-batch step takes the next ``MBS * DP`` samples and DP rank ``r`` keeps the ``r``-th slice, so a run resumed at
``consumed_samples`` sees exactly the data the uninterrupted run would have seen.

Like Megatron's ``--split``: the documents are cut, in index order, into train / valid / test ranges
(``split_document_ranges``), and each split's samples only ever read its own documents.

The sources a run's flags name (``--data-path`` or the weighted split paths files) are checked before the model is
built (:func:`check_data_files`) and read into each split's samples (:func:`split_samples`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from opskit.rules.formats import parse_data_path, parse_split, parse_weighted_split_paths
from opskit.train.config import TrainConfig, TrainerError
from opskit.train.fault import PoisonedSamples, poisoned_samples
from opskit.train.state import TrainState


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


class BlendedSamples:
    """Megatron's blend of several datasets (``--data-path 0.3 A 0.7 B``): global sample ``i`` is sample ``j_i`` of
    dataset ``d_i``, where ``d_i`` is the dataset furthest behind its share (``weight * max(i, 1) - taken`` largest,
    megatron-core's ``helpers.build_blending_indices``, which builds the index here), so every prefix of the blend
    follows the weights within one sample per dataset. Each dataset is endless (epochs repeat), so the index is only
    grown, by doubling, as far as training reads; it costs 10 bytes per sample read (Megatron builds it for the whole
    run up front).

    Args:
        datasets: one :class:`GPTSamples` per prefix (already cut to the split).
        weights: their weights (normalised here).
    """

    def __init__(self, datasets: list[GPTSamples], weights: list[float]):
        self.datasets = datasets
        self.weights = np.asarray(weights, dtype=np.float64) / float(sum(weights))
        self.dataset_index = np.zeros(0, dtype=np.int16)
        self.dataset_sample_index = np.zeros(0, dtype=np.int64)

    def _grow(self, size: int) -> None:
        from megatron.core.datasets import helpers

        size = max(size, 2 * len(self.dataset_index), 1024)
        self.dataset_index = np.zeros(size, dtype=np.int16)
        self.dataset_sample_index = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(self.dataset_index, self.dataset_sample_index, self.weights,
                                       len(self.datasets), size, False)

    def __getitem__(self, index: int) -> np.ndarray:
        """Global sample ``index``: ``[seq_length + 1]`` int64."""
        if index >= len(self.dataset_index):
            self._grow(index + 1)
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]


def blend_samples(blend: list[tuple[float, str]], split: str, which: int, seq_length: int,
                  seed: int) -> GPTSamples | BlendedSamples:
    """The samples of split ``which`` (0 train, 1 valid, 2 test) of ``--data-path``: each prefix's documents are cut
    by ``--split`` on their own (Megatron's blend), then blended by weight; one prefix gives its GPTSamples.

    Raises:
        ValueError: naming the prefix, when its split holds fewer than ``seq_length + 1`` tokens.
        FileNotFoundError: when a prefix's ``.idx``/``.bin`` cannot be opened.
    """
    return _blend([(weight, prefix, lambda n: split_document_ranges(split, n)[which]) for weight, prefix in blend],
                  seq_length, seed)


def weighted_split_samples(entries: list[tuple[float, float, float, str]], seq_length: int,
                           seed: int) -> GPTSamples | BlendedSamples:
    """One group of a ``--{train,valid}-weighted-split-paths-path`` file: ``(weight, start, end, prefix)`` entries,
    each reading documents ``round(start * n) .. round(end * n)`` of its dataset (Megatron-DeepSpeed's
    get_split_by_range_), blended by weight. Raises as :func:`blend_samples`."""
    return _blend([(weight, prefix, lambda n, start=start, end=end: (round(start * n), round(end * n)))
                   for weight, start, end, prefix in entries], seq_length, seed)


def _blend(sources, seq_length: int, seed: int) -> GPTSamples | BlendedSamples:
    """``sources``: ``(weight, prefix, documents(num_documents) -> (begin, end))``."""
    datasets = []
    for index, (_, prefix, documents) in enumerate(sources):
        dataset = IndexedDataset(prefix)
        try:  # a different seed per prefix, so that equal datasets are not shuffled alike
            datasets.append(GPTSamples(dataset, seq_length, seed + index,
                                       documents=documents(len(dataset.sequence_lengths))))
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
    if len(datasets) == 1:
        return datasets[0]
    return BlendedSamples(datasets, [weight for weight, _, _ in sources])


def micro_batches(samples: GPTSamples | BlendedSamples, consumed_samples: int, micro_batch_size: int, dp_size: int,
                  dp_rank: int, seqlen: Callable[[], int] | None = None,
                  device: torch.device | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens [MBS, s], labels [MBS, s])`` (int64) for this DP rank, starting at ``consumed_samples``.

    ``seqlen``, when given, is asked before each micro-batch for the curriculum's length ``n``: tokens and labels are
    then their first ``n`` positions (Megatron-DeepSpeed's get_batch_pipe truncation); the samples consumed are the
    same. With a CUDA ``device`` the tensors are already there, copied from pinned memory without waiting: DeepSpeed's
    pipeline engine moves a CPU micro-batch with a blocking copy, which drains the GPU's queue at every micro-batch
    (measured on an H100: 18 stream synchronizations per iteration of 4 micro-batches, the GPU idle meanwhile)."""
    step = consumed_samples
    copy_ahead = device is not None and device.type == "cuda"
    while True:
        first = step + dp_rank * micro_batch_size
        batch = torch.from_numpy(np.stack([samples[i] for i in range(first, first + micro_batch_size)]))
        if copy_ahead:
            batch = batch.pin_memory().to(device, non_blocking=True)
        n = seqlen() if seqlen is not None else batch.shape[1] - 1
        yield batch[:, :n].contiguous(), batch[:, 1:n + 1].contiguous()
        step += micro_batch_size * dp_size


class TrainBatches:
    """This DP rank's training micro-batches (:func:`micro_batches`, cut to ``state.seqlen`` at each one) from the run's
    data position, ``state``'s consumed plus skipped samples, and the ``--skip-train-iteration-range`` ranges still to
    apply (:func:`pending_skip_ranges`). ``iterator`` is what the pipeline engine draws from.

    Raises:
        TrainerError: the train split cannot be read (:func:`split_samples`).
    """

    def __init__(self, config: TrainConfig, state: TrainState, dp_size: int, dp_rank: int,
                 device: torch.device | None = None):
        ((_, self.samples),) = split_samples(config, "train")
        if (poisoned := poisoned_samples(config.global_batch_size)) is not None:  # tests only (OPSKIT_TEST_FAULT)
            self.samples = PoisonedSamples(self.samples, poisoned)
        self.micro_batch_size, self.dp_size, self.dp_rank = config.micro_batch_size, dp_size, dp_rank
        self.state, self.device = state, device
        self.ranges = pending_skip_ranges(config.skip_train_iteration_range, state)
        self.iterator = self._from_position()

    def _from_position(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        state = self.state
        return micro_batches(self.samples, state.consumed_train_samples + state.skipped_train_samples,
                             self.micro_batch_size, self.dp_size, self.dp_rank, seqlen=lambda: state.seqlen,
                             device=self.device)

    def skip_range_at(self, iteration: int, global_batch_size: int) -> tuple[int, int] | None:
        """Apply the next range when it starts at ``iteration`` (the next one to train), Megatron's way: the data
        position passes over its global batches (``global_batch_size`` samples each, the ramp-up's at the current
        consumed samples); the iteration, the consumed samples and the LR stay. The range applied, else None."""
        ranges, state = self.ranges, self.state
        if not (ranges and ranges[0][0] <= iteration <= ranges[0][1]):
            return None
        first, last = ranges.popleft()
        state.skipped_train_samples += global_batch_size * (last - state.iteration)
        state.applied_skip_train_iteration_ranges.append([first, last])
        self.iterator = self._from_position()
        return first, last


def pending_skip_ranges(ranges: tuple[tuple[int, int], ...], state: TrainState) -> deque[tuple[int, int]]:
    """The ``--skip-train-iteration-range`` ``ranges`` still to apply after ``state.iteration``: Megatron drops those
    that end before it; we also drop those the checkpoint says were applied already (their iteration numbers were
    trained again, on later data, right after the skip)."""
    applied = state.applied_skip_train_iteration_ranges  # [start, end] lists, as the checkpoint saves them
    return deque(r for r in ranges if r[1] > state.iteration and list(r) not in applied)


def check_data_files(config: TrainConfig) -> None:
    """Every ``.idx`` / ``.bin`` file the flags name exists and is not empty: megatron-core only asserts on a missing
    or empty dataset (and its ``__del__`` then prints a traceback).

    Raises:
        TrainerError: naming the flag, the prefix and the file.
    """
    if config.data_path is None:  # (flag naming the file, prefix) of every weighted group entry
        sources = [(f"{flag} {path}", prefix) for flag, path in (
            ("--train-weighted-split-paths-path", config.train_weighted_split_paths_path),
            ("--valid-weighted-split-paths-path", config.valid_weighted_split_paths_path))
            for _, entries in _weighted_split_groups(flag, path) for *_, prefix in entries]
    else:
        sources = [(f"--data-path {prefix} (--split {config.split}, train)", prefix)
                   for _, prefix in parse_data_path(config.data_path)]
    for where, prefix in sources:
        for suffix in (".idx", ".bin"):
            file = Path(prefix + suffix)
            if not file.is_file():
                raise TrainerError(f"{where}: no {file}")
            if file.stat().st_size == 0:  # megatron-core's mmap fails, and its __del__ prints tracebacks
                raise TrainerError(f"{where}: {file} is empty (no documents)")


def split_samples(config: TrainConfig, split: str) -> list:
    """``[(name, samples)]`` of the ``train`` or ``valid`` split: ``[(None, ...)]`` from ``--data-path`` (cut by
    ``--split``), or one per group of ``--{split}-weighted-split-paths-path`` (a train file holds exactly one).

    Raises:
        TrainerError: a source that cannot be read or is too short (names the flag).
    """
    flag = f"--{split}-weighted-split-paths-path"
    path = getattr(config, f"{split}_weighted_split_paths_path")
    if config.data_path is not None:
        where = f"--data-path {' '.join(config.data_path)} (--split {config.split}, {split})"
    else:
        where = f"{flag} {path}"
    try:
        if config.data_path is not None:
            which = ("train", "valid").index(split)
            return [(None, blend_samples(parse_data_path(config.data_path), config.split, which, config.seq_length,
                                         config.seed))]
        groups = _weighted_split_groups(flag, path)
        if split == "train" and len(groups) != 1:
            raise ValueError(f"{len(groups)} groups; the train file holds exactly one")
        return [(name, weighted_split_samples(entries, config.seq_length, config.seed)) for name, entries in groups]
    except (FileNotFoundError, ValueError) as e:
        raise TrainerError(f"{where}: {e}") from None


def _weighted_split_groups(flag: str, path: str) -> list:
    """The groups of a ``--*-weighted-split-paths-path`` file (see rules.formats.parse_weighted_split_paths)."""
    try:
        return parse_weighted_split_paths(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TrainerError(f"{flag} {path}: {e}") from None
