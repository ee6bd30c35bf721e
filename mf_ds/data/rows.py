"""MindFormers' causal-LM samples from MindRecord rows: one row, one sample, the columns in their model roles.

MindDataset gives rows as they were written (no concatenation across rows, unlike Megatron data). Which column
feeds which model argument is `run.data.columns` (translators/data.py: input_columns zipped with
construct_args_key, or with the model's construct parameters in order). What the model then does with them,
in training:
  legacy LlamaForCausalLM.construct (mindformers/models/llama/llama.py:637-690, input_sliced_sig False):
      tokens = input_ids[:-1]
      labels = labels[1:] with a labels column, else input_ids[1:]
      mask   = loss_mask[:-1] with a loss_mask column, else (tokens != pad_token_id) * (labels != -100)
  input_sliced_sig True, and mcore GPTModel (gpt_model.py:121-147): the row as it is, tokens = input_ids,
      labels = labels, mask = loss_mask (or tokens != pad) * (labels != -100).
A sample here is {"input_ids": tokens, "labels": labels with -100 where the mask is 0}; the training loop's
`run.loss_mask_pad_id` adds the input-pad mask of the legacy models (llama.py:667), and HF's loss leaves out
-100, so the loss is MindFormers' sum(loss * mask) / sum(mask).

Token ids are checked row by row as rows are read (a pass over a MindRecord set larger than RAM at start-up would
cost as much as an epoch): an id outside the vocabulary, or a row whose length is not the model's, is a
`DataError` naming the file and the row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from mf_ds.data.indexed import DataError
from mf_ds.data.mindrecord import MindRecord

IGNORE = -100  # MindFormers' ignore_token_id and HF's ignore_index


class RowDataset(Dataset):
    """Item i is MindRecord row i as a training sample: {"input_ids": LongTensor[L], "labels": LongTensor[L]}."""

    def __init__(self, records: MindRecord, columns: dict[str, str], shifted: bool, seq_length: int,
                 vocab_size: int, seed: int, shuffle: bool) -> None:
        self.records, self.shifted, self.seq_length, self.vocab_size = records, shifted, seq_length, vocab_size
        self.seed, self.shuffle, self.name = seed, shuffle, records.prefix
        role = {argument: column for column, argument in columns.items()}
        if "input_ids" not in role:
            raise DataError("train_dataset.input_columns", f"no column feeds input_ids ({columns})")
        self.input, self.labels, self.loss_mask = role["input_ids"], role.get("labels"), role.get("loss_mask")
        if not shifted and self.labels is None:
            raise DataError("train_dataset.input_columns", "rows taken as they are (input_sliced_sig or an mcore "
                            "model) need a column that feeds labels; MindFormers' model would fail without one")
        self.read = [c for c in (self.input, self.labels, self.loss_mask) if c is not None]
        for name in self.read:
            column = records.columns.get(name)
            if column is None:
                raise DataError(records.files[0], f"has no column {name!r} (train_dataset.input_columns); its "
                                f"columns: {', '.join(records.columns)}")
            if column.dtype not in ("int32", "int64") or column.shape is None or len(column.shape) != 1:
                raise DataError(records.files[0], f"column {name!r} is {column.describe()}: a token column must "
                                "be a one-dimensional int32 or int64 array")
        if len(records) == 0:
            raise DataError(self.name, "empty dataset (no rows)")
        self[0]  # the first row's length and ids: a wrong seq_length fails before the model is built

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.records.row(i, self.read)
        ids = row[self.input].astype(np.int64)
        want = self.seq_length + 1 if self.shifted else self.seq_length
        for name in self.read:
            if len(row[name]) != want:
                shard, r = self.records.locate(i)
                how = "seq_length + 1 (cut into inputs and next-token labels)" if self.shifted else "seq_length"
                raise DataError(shard.path, f"row {r}: column {name!r} holds {len(row[name])} tokens; the model's "
                                f"seq_length {self.seq_length} needs {how} = {want}")
        labels = row[self.labels].astype(np.int64) if self.labels else ids
        tokens = ids[:-1] if self.shifted else ids
        labels = labels[1:].copy() if self.shifted else labels.copy()
        if self.loss_mask:
            mask = row[self.loss_mask][:-1] if self.shifted else row[self.loss_mask]
            labels[mask == 0] = IGNORE
        bad_input = (tokens < 0) | (tokens >= self.vocab_size)
        bad_label = ((labels < 0) & (labels != IGNORE)) | (labels >= self.vocab_size)
        if bad_input.any() or bad_label.any():
            shard, r = self.records.locate(i)
            value = tokens[bad_input][0] if bad_input.any() else labels[bad_label][0]
            raise DataError(shard.path, f"row {r}: token id {value} outside the model's vocabulary "
                            f"[0, {self.vocab_size})" + ("" if bad_input.any() else " (labels: or -100)"))
        return {"input_ids": torch.from_numpy(tokens.copy()), "labels": torch.from_numpy(labels)}

    def pass_order(self, p: int) -> np.ndarray:
        """Row order of pass p: as written without shuffle, else a fresh permutation per pass (seeded)."""
        if not self.shuffle:
            return np.arange(len(self))
        # MindSpore's own shuffle order cannot be reproduced; this one is a function of the seed alone.
        return np.random.default_rng([self.seed, p, 2]).permutation(len(self))
