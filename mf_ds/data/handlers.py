"""MindFormers' data handlers (mindformers/dataset/handler/, 1.7.0; the 1.8-2.1 wheels ship the same three files),
as batched `datasets` maps, so that `datasets` caches their output (a second run reads the cache).

  instruct   AlpacaInstructDataHandler (alpaca_handler.py) and CodeAlpacaInstructDataHandler
             (codealpaca_handler.py): the prompt template, the prompt's labels -100, the labels shifted by one
             (alpaca: `labels[1:] + [ignore]`; code-alpaca: not shifted, as shipped), padding / truncation to
             seq_length (+1 for a legacy model)
  pack       PackingHandler(pack_strategy="pack") (packing_handler.py pack_examples): documents in order, a new
             sample when the next one does not fit, a document longer than seq_length dropped; `actual_seq_len`
             holds each document's end
  truncate   PackingHandler(pack_strategy="truncate") (truncate_examples): every 1000 documents (datasets' map
             batch) concatenated and cut into seq_length pieces, the last piece padded
Tokenising: the same strings as the handlers, each through the tokenizer's own call, in batches (the fast
tokenizer's batch encoding gives each string's ids exactly as one call would).

The known defect, decided here: PackingHandler appends `labels[1:] + [pad]` per document, shifting the labels the
instruct handler already shifted; a packed position then trains on the token two ahead, and each document's last
on the pad id (0: process_legacy_args builds PackingHandler without a tokenizer). `mf_labels=False` (mf-ds'
default) keeps the instruct handler's labels, the next token, as unpacked samples train;
`mf_labels=True` (`mf_ds.mindformers_packing_labels`) reproduces MindFormers' packed samples exactly.
Truncate's `actual_seq_len` (MindFormers: per-piece document lengths, read downstream as ends, so its position ids
do not even have seq_length entries) is here each document's end within its piece.
"""

from __future__ import annotations

import numpy as np

IGNORE = -100
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request.\n\n"
              "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
WITHOUT_INPUT = ("Below is an instruction that describes a task. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Response:")
CODE = ("Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
TRUNCATE_BATCH = 1000  # datasets' map batch size, which truncate_examples' pieces follow


class Instruct:
    """The alpaca / code-alpaca handler as a batched map: `__call__(batch) -> {"input_ids", "labels"}`."""

    def __init__(self, tokenizer, code: bool, seq_length: int, padding: bool, legacy: bool,
                 pad_id: int, ignore: int = IGNORE) -> None:
        self.tokenizer, self.code, self.padding, self.pad_id, self.ignore = tokenizer, code, padding, pad_id, ignore
        self.max_length = seq_length + 1 if legacy else seq_length  # _process_sequence_with_length
        self.system = [] if code else list(tokenizer(f"{SYSTEM} ")["input_ids"])

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts)["input_ids"]] if texts else []

    def __call__(self, batch: dict) -> dict:
        names = list(batch)
        rows = [dict(zip(names, values, strict=True)) for values in zip(*(batch[k] for k in names), strict=True)]
        if self.code:  # codealpaca_handler.py: prompt.format_map(example), output as it is
            users = self._ids([CODE.format_map(r) for r in rows])
            answers = self._ids([r.get("output") for r in rows])
        else:  # alpaca_handler.py apply_template + tokenize_example
            users = self._ids([f"USER: {(WITH_INPUT if r.get('input') else WITHOUT_INPUT).format_map(r)} "
                               for r in rows])
            answers = self._ids([f"ASSISTANT: {r.get('output', '')}</s>" for r in rows])
        out = {"input_ids": [], "labels": []}
        for user, answer in zip(users, answers, strict=True):
            ids = self.system + user + answer
            labels = [self.ignore] * (len(self.system) + len(user)) + answer
            if not self.code:
                labels = labels[1:] + [self.ignore]
            if self.padding and len(ids) < self.max_length:
                ids = ids + [self.pad_id] * (self.max_length - len(ids))
                labels = labels + [self.ignore] * (self.max_length - len(labels))
            out["input_ids"].append(ids[:self.max_length])
            out["labels"].append(labels[:self.max_length])
        return out


def _pad(values: list[int], length: int, fill: int) -> list[int]:
    return values + [fill] * (length - len(values))


class Pack:
    """PackingHandler's `pack` over the whole data set as one arrow batch (`ds.with_format("arrow").map(...,
    batched=True, batch_size=None)`): {"input_ids", "labels", "actual_seq_len"} as arrow list columns."""

    def __init__(self, seq_length: int, mf_labels: bool, pad: int = 0, ignore: int = IGNORE) -> None:
        self.seq_length, self.mf_labels, self.pad, self.ignore = seq_length, mf_labels, pad, ignore

    def groups(self, lengths: np.ndarray) -> list[list[int]]:
        """_process_sample's greedy order: documents in order, a new sample when the next one does not fit; a
        document longer than seq_length is skipped."""
        out, current, used = [], [], 0
        for d, n in enumerate(lengths.tolist()):
            if n > self.seq_length:
                continue
            if used + n > self.seq_length:
                out.append(current)
                current, used = [], 0
            current.append(d)
            used += n
        if not out:  # pack_examples' check, made before it adds the last sample
            raise ValueError(f"fewer than one full packed sample of seq_length {self.seq_length} (MindFormers' "
                             "PackingHandler refuses it: 'dataset is empty after packing')")
        return out + [current]

    def __call__(self, table):
        import pyarrow as pa

        ids_col, labels_col = table.column("input_ids").combine_chunks(), table.column("labels").combine_chunks()
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        lengths = np.diff(offsets)
        ids = ids_col.flatten().to_numpy().astype(np.int64)
        labels = labels_col.flatten().to_numpy().astype(np.int64)
        if self.mf_labels:  # labels[1:] + [pad] per document (packing_handler.py _process_sample)
            shifted = np.empty_like(labels)
            shifted[:-1] = labels[1:]
            shifted[offsets[1:] - 1] = self.pad
            labels = shifted
        S, groups = self.seq_length, self.groups(lengths)
        index = [np.concatenate([np.arange(offsets[d], offsets[d + 1]) for d in g]) if g else
                 np.zeros(0, np.int64) for g in groups]
        fill = [S - len(i) for i in index]
        flat_ids = np.concatenate([np.concatenate([ids[i], np.full(f, self.pad)])
                                   for i, f in zip(index, fill, strict=True)])
        flat_labels = np.concatenate([np.concatenate([labels[i], np.full(f, self.ignore)])
                                      for i, f in zip(index, fill, strict=True)])
        ends = [np.cumsum(lengths[g]) if g else np.zeros(0, np.int64) for g in groups]
        row_offsets = pa.array(np.arange(len(groups) + 1, dtype=np.int32) * S)
        end_offsets = pa.array(np.concatenate([[0], np.cumsum([len(e) for e in ends])]).astype(np.int32))
        return pa.table({
            "input_ids": pa.ListArray.from_arrays(row_offsets, pa.array(flat_ids.astype(np.int32))),
            "labels": pa.ListArray.from_arrays(row_offsets, pa.array(flat_labels.astype(np.int32))),
            "actual_seq_len": pa.ListArray.from_arrays(end_offsets, pa.array(np.concatenate(ends).astype(np.int64)))})


class Truncate:
    """PackingHandler's `truncate` on one map batch: the documents joined and cut into seq_length pieces."""

    def __init__(self, seq_length: int, pad: int = 0, ignore: int = IGNORE) -> None:
        self.seq_length, self.pad, self.ignore = seq_length, pad, ignore

    def __call__(self, batch: dict) -> dict:
        S = self.seq_length
        ids = [t for doc in batch["input_ids"] for t in doc]
        labels = [t for doc in batch["labels"] for t in doc]
        doc_ends = np.cumsum([len(doc) for doc in batch["input_ids"]])
        out = {"input_ids": [], "labels": [], "actual_seq_len": []}
        for start in range(0, len(ids), S):
            inside = doc_ends[(doc_ends > start) & (doc_ends < start + S)] - start
            out["input_ids"].append(_pad(ids[start:start + S], S, self.pad))
            out["labels"].append(_pad(labels[start:start + S], S, self.ignore))
            out["actual_seq_len"].append(sorted(set(inside.tolist() + [min(S, len(ids) - start)])))
        return out


def packed_columns(input_ids, labels, ends, compressed_length: int | None = None) -> dict[str, np.ndarray]:
    """HFDataset._iter_packed_data (hf_dataloader.py): loss_mask = labels != -100, position_ids restarting at each
    document end (the padded tail its own run), and the compressed EOD mask (`actual_seq_len` padded with
    seq_length to `compressed_length` entries); `doc_ids` numbers the documents for the attention mask."""
    tokens, labels = np.asarray(input_ids, np.int64), np.asarray(labels, np.int64)
    S = len(tokens)
    ends = [int(e) for e in ends if 0 < int(e) <= S]
    bounds = sorted(set(ends))
    doc_ids = np.searchsorted(np.asarray(bounds, np.int64), np.arange(S), side="right")
    starts = np.concatenate([[0], bounds])[doc_ids]
    out = {"input_ids": tokens, "labels": labels, "loss_mask": (labels != IGNORE).astype(np.int64),
           "position_ids": np.arange(S) - starts, "doc_ids": doc_ids}
    if compressed_length is not None:
        if len(ends) > compressed_length:
            raise ValueError(f"{len(ends)} documents in a packed sample exceed compressed_eod_mask_length "
                             f"{compressed_length}")
        out["actual_seq_len"] = np.asarray(ends + [S] * (compressed_length - len(ends)), np.int64)
    return out
