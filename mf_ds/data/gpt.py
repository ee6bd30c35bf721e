"""GPT-style training samples from token sources, blending by weight, and the per-rank batch stream.

Samples are Megatron's (megatron/core/datasets/gpt_dataset.py, `_build_sample_index`): a source's documents are
concatenated, epoch after epoch, and cut into windows of seq_length + 1 tokens that start seq_length apart (the
last token of one sample is the first of the next); input_ids = window[:-1], labels = window[1:], as
MindFormers' `input_sliced_sig: False` slicing does. With `shuffle`, each epoch's document order is a fresh
permutation and the samples are permuted as well (Megatron's document and shuffle indices). As many epochs are
laid out as the requested number of samples needs (train_samples, `sizes[0]` in MindFormers' YAML); without
one, a single pass.

Blending (`data_path: [w0, p0, w1, p1, ...]`): source d gets round(n * w_d / sum(w)) of the n samples (largest
remainder) and its samples are spread evenly through the stream, every prefix within one sample of the
weights. This is neither Megatron's C++ `build_blending_indices` order nor its numpy shuffles bit for bit:
the order differs, the sample contents (Megatron's concatenation) do not. Everything is a function of the seed.

The loss mask is GPTDataset's (MindFormers' dataset/blended_datasets/gpt_dataset.py, `__getitem__` and
`_get_ltor_masks_and_position_ids`): positions whose *input* is `eod` (with eod_mask_loss) and whose label is `pad`
get label -100, the ignore index of HF's causal-LM loss; this holds when the data set's loss_mask column feeds the
model (`loss_mask`), else the model masks by itself (mf_ds/loop.py) and only the token rewrite below applies. Pad
tokens are then rewritten to 0 in the inputs and labels, as GPTDataset does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from mf_ds.data.indexed import DataError

IGNORE = -100  # HF's CrossEntropyLoss ignore_index


class Samples:
    """One source's samples: windows of seq_length + 1 tokens over its documents concatenated epoch by epoch."""

    def __init__(self, source, count: int, seq_length: int, rng: np.random.Generator, shuffle: bool) -> None:
        self.source, self.seq_length = source, seq_length
        lengths = source.sequence_lengths
        total = int(lengths.sum())
        epochs = max(1, -(-(count * seq_length + 1) // total))  # smallest E with (E*total - 1) // L >= count
        orders = [rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths)) for _ in range(epochs)]
        self.order = np.concatenate(orders)
        self.ends = np.cumsum(lengths[self.order])
        self.shuffle_index = rng.permutation(count) if shuffle else np.arange(count)

    @staticmethod
    def one_pass(source, seq_length: int) -> int:
        return (int(source.sequence_lengths.sum()) - 1) // seq_length

    def __getitem__(self, j: int) -> np.ndarray:
        start = int(self.shuffle_index[j]) * self.seq_length
        i = int(np.searchsorted(self.ends, start, side="right"))
        offset = start - (int(self.ends[i]) - int(self.source.sequence_lengths[self.order[i]]))
        need, pieces = self.seq_length + 1, []
        while need:
            doc = int(self.order[i])
            take = min(need, int(self.source.sequence_lengths[doc]) - offset)
            pieces.append(self.source.get(doc, offset, take))
            need, i, offset = need - take, i + 1, 0
        return np.concatenate(pieces).astype(np.int64)


class TrainDataset(Dataset):
    """Item i is the i-th training sample: {"input_ids": LongTensor[L], "labels": LongTensor[L]}."""

    def __init__(self, sources: list, weights: list[float] | None, seq_length: int, seed: int, shuffle: bool,
                 num_samples: int | None = None, eod: int | None = None, eod_mask_loss: bool = False,
                 pad: int | None = None, loss_mask: bool = True) -> None:
        self.name = ", ".join(source.prefix for source in sources)
        self.seed, self.shuffle, self.seq_length = seed, shuffle, seq_length
        self.eod_masked = eod if eod_mask_loss and loss_mask else None
        self.pad, self.loss_mask = pad, loss_mask
        one_pass = [Samples.one_pass(source, seq_length) for source in sources]
        weights = list(one_pass) if weights is None else list(weights)  # None: each source once per pass
        used = [d for d, w in enumerate(weights) if w > 0]
        n = num_samples if num_samples else sum(one_pass[d] for d in used)
        if n == 0:
            raise DataError(self.name, f"too few tokens: no source holds seq_length + 1 = {seq_length + 1} tokens")
        counts = _apportion(n, np.array(weights, dtype=np.float64))
        self.sources = [Samples(source, int(c), seq_length, np.random.default_rng([seed, d]), shuffle)
                        for d, (source, c) in enumerate(zip(sources, counts, strict=True))]
        # Sample j of source d sits at (j + 0.5) / count_d of the stream; ties go to the lower d.
        which = np.repeat(np.arange(len(counts)), counts)
        local = np.concatenate([np.arange(c) for c in counts])
        times = (local + 0.5) / np.maximum(counts, 1)[which]
        stream = np.lexsort((which, times))
        self.which, self.local = which[stream], local[stream]

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.sources[int(self.which[i])][int(self.local[i])]
        tokens, labels = window[:-1].copy(), window[1:].copy()
        ignore = np.zeros(len(labels), dtype=bool)
        if self.eod_masked is not None:
            ignore |= tokens == self.eod_masked
        if self.pad is not None:
            if self.loss_mask:
                ignore |= labels == self.pad
            tokens[tokens == self.pad] = 0
            labels[labels == self.pad] = 0
        labels[ignore] = IGNORE
        return {"input_ids": torch.from_numpy(tokens), "labels": torch.from_numpy(labels)}

    def pass_order(self, p: int) -> np.ndarray:
        """Sample order of pass p: the data set's own order first, then a fresh permutation per pass."""
        if p == 0 or not self.shuffle:
            return np.arange(len(self))
        # Three words, so the stream never coincides with a source's [seed, d].
        return np.random.default_rng([self.seed, p, 1]).permutation(len(self))


def _apportion(n: int, weights: np.ndarray) -> np.ndarray:
    """n split in proportion to weights, largest remainder first (ties to the lower index)."""
    exact = n * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    extra = np.argsort(-(exact - counts), kind="stable")[: n - int(counts.sum())]
    counts[extra] += 1
    return counts


def batches(dataset: Dataset, micro_batch_size: int, rank: int, world: int, start: int = 0,
            passes: int | None = 1, drop_last: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro batches, collated, from micro batch `start` on (counted per rank across passes).

    Rank r's micro batch q of a pass holds the samples at positions r + world * (q * B + b), b < B: exactly what
    `DistributedSampler(shuffle=False)` + `DataLoader(batch_size=B, drop_last=True)` give, the order being the
    data set's own. Every rank gets the same number of micro batches; without drop_last the last one wraps
    around to the start of the pass (as DistributedSampler pads). A resumed run passes start = micro batches
    already consumed (optimizer steps x gradient accumulation) and sees the tail of the uninterrupted stream.
    `passes=None` repeats without end.
    """
    if not 0 <= rank < world or micro_batch_size < 1:
        raise ValueError(f"rank {rank} of world {world}, micro batch {micro_batch_size}: out of range")
    n, per_step = len(dataset), world * micro_batch_size
    steps = n // per_step if drop_last else -(-n // per_step)
    if steps == 0:
        name = getattr(dataset, "name", "train_dataset")
        raise DataError(name, f"{n} samples make no micro batch of "
                        f"{micro_batch_size} on each of {world} ranks")
    order, current = None, -1
    m = start
    while passes is None or m < steps * passes:
        p, q = divmod(m, steps)
        if p != current:
            order = dataset.pass_order(p) if hasattr(dataset, "pass_order") else np.arange(n)
            current = p
        positions = rank + world * (q * micro_batch_size + np.arange(micro_batch_size))
        items = [dataset[int(i)] for i in order[positions % n]]
        yield {key: torch.stack([item[key] for item in items]) for key in items[0]}
        m += 1
