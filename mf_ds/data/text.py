"""Text sources held in memory: the built-in corpus (byte-level) and JSON lines (a local HF tokenizer).

The built-in corpus is CPython's `pydoc_data.topics.topics`, the help topics of the Python documentation
(79 topics, about 465 KB of English prose in 3.11): real text on every Python installation, with no download.
Each topic (in key order) is one document, tokenised by `ByteTokenizer` (ids 0 pad, 1 bos, 2 eos, byte b ->
b + 3; vocab 259) and followed by EOS. A model needs vocab_size >= 259 to train on it.

JSON lines: one `{"text": ...}` object per line, tokenised with
`AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)` (never a download), special tokens as the
tokenizer adds them, then its EOS when it has one and the text does not already end with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from mf_ds.data.indexed import DataError, TokenSequences

BUILTIN = "<built-in corpus: pydoc_data.topics>"


class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 pad, 1 bos, 2 eos, byte b -> b + 3."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) - self.offset for i in ids if int(i) >= self.offset).decode("utf-8", errors="replace")


class TokenArray(TokenSequences):
    """Documents concatenated in one int64 array, read through the same interface as `IndexedDataset`."""

    def __init__(self, name: str, documents: list[list[int]]) -> None:
        self.prefix = self.token_file = name
        self.sequence_lengths = np.array([len(doc) for doc in documents], dtype=np.int64)
        if len(documents) == 0 or int(self.sequence_lengths.sum()) == 0:
            raise DataError(name, f"empty dataset ({len(documents)} documents, no tokens)")
        self.starts = np.concatenate([[0], np.cumsum(self.sequence_lengths)[:-1]])
        self.tokens = np.fromiter((t for doc in documents for t in doc), dtype=np.int64,
                                  count=int(self.sequence_lengths.sum()))

    def token_range(self) -> tuple[int, int]:
        return int(self.tokens.min()), int(self.tokens.max())


def builtin_corpus() -> TokenArray:
    from pydoc_data.topics import topics

    tok = ByteTokenizer()
    return TokenArray(BUILTIN, [tok.encode(topics[key]) + [tok.eos_token_id] for key in sorted(topics)])


def load_tokenizer(tokenizer_dir: str | None):
    """The HF tokenizer saved in `tokenizer_dir`, loaded offline."""
    if not tokenizer_dir:
        raise DataError("mf_ds.tokenizer_dir", "JSON-lines data needs a local tokenizer directory (the YAML's "
                        "pretrained_model_dir, or --set mf_ds.tokenizer_dir=/path/to/tokenizer)")
    if not os.path.isdir(tokenizer_dir):
        raise DataError(tokenizer_dir, "tokenizer directory does not exist")
    if not any(os.path.isfile(os.path.join(tokenizer_dir, name))
               for name in ("tokenizer.json", "tokenizer_config.json")):
        raise DataError(tokenizer_dir, f"tokenizer directory {tokenizer_dir} has no tokenizer.json / "
                        "tokenizer_config.json")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a broken directory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(tokenizer_dir, f"cannot load the tokenizer: {type(exc).__name__}: {first}") from None


def parse_json_line(line: str, where: str):
    """One JSON line; anything json.loads refuses is a one-line DataError naming `where` (file:line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(where, f"not JSON ({exc.msg})") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise DataError(where, f"not JSON this reader takes ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise DataError(where, "not JSON this reader takes (nested too deeply)") from None


def read_jsonl(path: str, tokenizer) -> TokenArray:
    """Tokenise every line's "text"; a bad line is a DataError naming file:line."""
    if not os.path.isfile(path):
        raise DataError(path, "missing")
    eos = tokenizer.eos_token_id
    documents = []
    with open(path, "rb") as f:  # bytes, so that text which is not UTF-8 is named by its line
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            record = parse_json_line(line, f"{path}:{number}")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{number}", 'expected an object with a "text" string')
            ids = list(tokenizer(record["text"])["input_ids"])
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            documents.append(ids)
    return TokenArray(path, documents)
