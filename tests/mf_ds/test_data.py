"""mf_ds.data: the Megatron format round trip, GPT samples, blending, masks, sources, damaged files, resume."""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from mf_ds.data import (
    IGNORE,
    ByteTokenizer,
    DataError,
    IndexedDataset,
    TrainDataset,
    batches,
    build_train_dataset,
    write_indexed,
)
from mf_ds.data.indexed import MAGIC
from translators.plan_types import Data, from_json

L = 16  # seq_length in these tests


def plan_data(**changes) -> Data:
    """run.data as translators/data.py writes it."""
    data = {"kind": "builtin", "paths": [], "weights": [], "seq_length": L, "shuffle": True, "seed": None,
            "drop_remainder": True, "repeat": 1, "input_columns": ["input_ids"], "train_samples": None,
            "eod_mask_loss": False, "eod": None, "pad": None, "files_as_given": False, "columns": {},
            "shifted": True, "reset_attention_mask": False, "reset_position_ids": False, "eod_pad_length": None}
    data.update(changes)
    return from_json(Data, data, "run.data")


def documents(n: int, base: int, seed: int = 0) -> list[list[int]]:
    """n documents of 5-40 tokens in [base, base + 50), each ending in the eod id 3."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(base, base + 50, rng.integers(5, 40))) + [3] for _ in range(n)]


@pytest.fixture
def megatron(tmp_path):
    prefix = str(tmp_path / "a_text_document")
    docs = documents(60, 10)
    write_indexed(prefix, docs)
    return prefix, docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_is_megatrons_layout(tmp_path, dtype):
    docs = [[5, 6, 7], [], [70000 if dtype == np.int32 else 9, 1]]
    prefix = str(tmp_path / "x")
    write_indexed(prefix, docs, dtype=dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.dtype(dtype)
    assert [ds.get(i).tolist() for i in range(3)] == docs
    assert ds.get(2, offset=1, length=1).tolist() == [1]
    raw = open(prefix + ".idx", "rb").read()
    code = 8 if dtype == np.uint16 else 4
    assert raw[:34] == MAGIC + struct.pack("<QBQQ", 1, code, 3, 4)  # document count = documents + 1
    assert np.frombuffer(raw[34 + 12 * 3:], np.int64).tolist() == [0, 1, 2, 3]


def test_samples_are_megatrons_concatenation(megatron):
    prefix, docs = megatron
    ds = build_train_dataset(plan_data(kind="megatron", paths=[prefix], weights=[1.0], shuffle=False), L, 0, 100)
    stream = np.concatenate(docs)
    assert len(ds) == (len(stream) - 1) // L
    for k in (0, 1, len(ds) - 1):
        item = ds[k]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (L,)
        assert item["input_ids"].tolist() == stream[k * L:k * L + L].tolist()
        assert item["labels"].tolist() == stream[k * L + 1:k * L + L + 1].tolist()


def test_shuffled_samples_cover_more_epochs_when_asked(megatron):
    prefix, docs = megatron
    data = plan_data(kind="megatron", paths=[prefix], weights=[1.0], train_samples=500)
    ds = build_train_dataset(data, L, 7, 100)
    assert len(ds) == 500 > (sum(map(len, docs)) - 1) // L
    for k in range(0, 500, 37):
        assert ds[k]["labels"][:-1].tolist() == ds[k]["input_ids"][1:].tolist()
    unshuffled = build_train_dataset(dataclasses.replace(data, shuffle=False), L, 7, 100)
    assert [ds[k]["input_ids"].tolist() for k in range(5)] != [unshuffled[k]["input_ids"].tolist() for k in range(5)]


def test_blending_follows_weights_and_the_seed(tmp_path):
    write_indexed(str(tmp_path / "a"), documents(200, 10, seed=1))
    write_indexed(str(tmp_path / "b"), documents(200, 60, seed=2))
    data = plan_data(kind="megatron", paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[0.25, 0.75],
                     train_samples=800)
    ds = build_train_dataset(data, L, 1234, 200)
    from_b = [int((ds[k]["input_ids"] >= 60).any()) for k in range(800)]  # a's tokens are all below 60
    which = ds.which.tolist()
    assert which.count(1) == 600 and abs(sum(from_b) / 800 - 0.75) < 0.05
    assert abs(which[:100].count(1) - 75) <= 1  # every prefix follows the weights
    again = build_train_dataset(data, L, 1234, 200)
    other = build_train_dataset(data, L, 99, 200)
    assert all(torch.equal(ds[k]["input_ids"], again[k]["input_ids"]) for k in range(0, 800, 50))
    assert any(not torch.equal(ds[k]["input_ids"], other[k]["input_ids"]) for k in range(0, 800, 50))


@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("fed", [True, False])
def test_gpt_dataset_loss_mask(megatron, mask, fed):
    """GPTDataset.__getitem__ / _get_ltor_masks_and_position_ids: with eod_mask_loss the positions whose *input* is
    the eod are out of the loss, those whose label is the pad too; pads become 0 in inputs and labels. Without a
    loss_mask column feeding the model only the rewrite applies (the model masks by itself)."""
    prefix, _ = megatron
    data = plan_data(kind="megatron", paths=[prefix], weights=[1.0])
    plain = build_train_dataset(data, L, 0, 100)
    columns = {"input_ids": "input_ids", "labels": "labels", **({"loss_mask": "loss_mask"} if fed else {})}
    ds = build_train_dataset(dataclasses.replace(data, eod_mask_loss=mask, eod=3, pad=12, columns=columns), L, 0,
                             100)
    raw = torch.cat([plain[k]["labels"] for k in range(len(ds))])
    raw_in = torch.cat([plain[k]["input_ids"] for k in range(len(ds))])
    labels = torch.cat([ds[k]["labels"] for k in range(len(ds))])
    inputs = torch.cat([ds[k]["input_ids"] for k in range(len(ds))])
    assert (raw == 3).any() and (raw == 12).any() and not (raw == IGNORE).any()
    ignored = ((raw == 12) | ((raw_in == 3) & mask)) & fed
    assert (labels[ignored] == IGNORE).all()
    assert torch.equal(labels[~ignored], raw.masked_fill(raw == 12, 0)[~ignored])
    assert torch.equal(inputs, raw_in.masked_fill(raw_in == 12, 0))


def test_builtin_corpus_is_real_text():
    ds = build_train_dataset(plan_data(), 128, 0, 320)
    assert len(ds) > 1000
    text = ByteTokenizer().decode(torch.cat([ds[k]["input_ids"] for k in range(20)]).tolist())
    assert text.count(" the ") > 10
    with pytest.raises(DataError, match="vocab_size >= 259"):
        build_train_dataset(plan_data(), 128, 0, 256)


def save_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(directory)


def test_jsonl_with_a_local_tokenizer(tmp_path):
    save_tokenizer(tmp_path / "tok")
    path = tmp_path / "train.jsonl"
    path.write_text("".join('{"text": "the cat sat on a mat"}\n{"text": "a dog"}\n' for _ in range(20)))
    data = plan_data(kind="json", paths=[str(path)], shuffle=False)
    ds = build_train_dataset(data, 8, 0, 9, tokenizer_dir=str(tmp_path / "tok"))
    assert ds[0]["input_ids"].tolist() == [2, 3, 4, 5, 7, 6, 1, 7]  # "a dog" after the EOS (1)
    assert len(ds) == (20 * (7 + 3) - 1) // 8
    via_dir = build_train_dataset(plan_data(shuffle=False), 8, 0, 9, str(tmp_path / "tok"), str(tmp_path))
    assert via_dir[0]["input_ids"].tolist() == [2, 3, 4, 5, 7, 6, 1, 7]


def test_train_dataset_dir_with_megatron_pairs(tmp_path):
    for name, base in (("a", 10), ("b", 60)):
        write_indexed(str(tmp_path / name), documents(30, base))
    data = plan_data(kind="mindrecord", paths=["/ignored"], shuffle=False)  # the override wins over the YAML
    ds = build_train_dataset(data, L, 0, 200, override_dir=str(tmp_path))
    assert ds.which.tolist().count(0) == (sum(map(len, documents(30, 10))) - 1) // L  # each file once per pass
    os.remove(tmp_path / "b.idx")
    with pytest.raises(DataError, match="missing") as info:
        build_train_dataset(data, L, 0, 200, override_dir=str(tmp_path))
    assert info.value.path == str(tmp_path / "b.idx")


def damage(prefix: str, how: str) -> str:
    """Damage a written pair; returns the file the error must name."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if how == "truncated .idx":
        open(idx, "r+b").truncate(100)
        return idx
    if how == "bad magic":
        raw = open(idx, "rb").read()
        open(idx, "wb").write(b"NOTANIDX\x00" + raw[9:])
        return idx
    if how == ".bin size":
        open(bin_, "ab").write(b"\x00\x00")
        return bin_
    os.remove(bin_ if how == "missing .bin" else idx)
    return bin_ if how == "missing .bin" else idx


@pytest.mark.parametrize("how, message", [("truncated .idx", "truncated: header says 60 sequences"),
                                          ("bad magic", "not a Megatron index"),
                                          (".bin size", "does not match the index"),
                                          ("missing .bin", "missing"), ("missing .idx", "missing")])
def test_damaged_megatron_files_are_named(megatron, how, message):
    prefix, _ = megatron
    path = damage(prefix, how)
    with pytest.raises(DataError, match=message) as info:
        build_train_dataset(plan_data(kind="megatron", paths=[prefix], weights=[1.0]), L, 0, 100)
    assert info.value.path == path and path in str(info.value)


def test_bad_data_is_named(tmp_path, megatron):
    prefix, _ = megatron
    write_indexed(str(tmp_path / "empty"), [])
    cases = [
        (plan_data(kind="megatron", paths=[str(tmp_path / "empty")], weights=[1.0]), {}, "empty dataset",
         str(tmp_path / "empty")),
        (plan_data(kind="megatron", paths=[prefix], weights=[1.0]), {"vocab_size": 50}, "token id 59 >= ",
         prefix + ".bin"),
        (plan_data(kind="mindrecord", paths=["/data/wiki"]), {}, "not a directory and not a MindRecord file name",
         "/data/wiki"),
        (plan_data(kind="json", paths=[str(tmp_path / "t.jsonl")]), {"tokenizer_dir": str(tmp_path / "nope")},
         "does not exist", str(tmp_path / "nope")),
        (plan_data(kind="json", paths=[str(tmp_path / "t.jsonl")]), {"tokenizer_dir": str(tmp_path)},
         "no tokenizer.json / tokenizer_config.json", str(tmp_path)),
    ]
    for data, kwargs, message, path in cases:
        kwargs = {"vocab_size": 100, **kwargs}
        with pytest.raises(DataError, match=message) as info:
            build_train_dataset(data, L, 0, **kwargs)
        assert info.value.path == path


@pytest.mark.parametrize("line, message", [("{not json", "not JSON"), ('{"txt": "a"}', '"text" string')])
def test_bad_jsonl_line_is_named(tmp_path, line, message):
    save_tokenizer(tmp_path / "tok")
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "the cat"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=message) as info:
        build_train_dataset(plan_data(kind="json", paths=[str(path)]), 4, 0, 9, str(tmp_path / "tok"))
    assert info.value.path == f"{path}:3"


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_sees_the_uninterrupted_tail(megatron, drop_last):
    prefix, _ = megatron
    ds = build_train_dataset(plan_data(kind="megatron", paths=[prefix], weights=[1.0], seed=5), L, 0, 100)
    full = {r: list(batches(ds, 3, r, 2, passes=2, drop_last=drop_last)) for r in (0, 1)}
    per_pass = len(ds) // 6 if drop_last else -(-len(ds) // 6)
    assert len(full[0]) == len(full[1]) == 2 * per_pass
    for start in (0, 5, per_pass, per_pass + 3):
        for r in (0, 1):
            tail = list(batches(ds, 3, r, 2, start=start, passes=2, drop_last=drop_last))
            assert len(tail) == len(full[r]) - start
            assert all(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
                       for a, b in zip(tail, full[r][start:], strict=True))
    first = {r: torch.cat([b["input_ids"] for b in full[r][:per_pass]]) for r in (0, 1)}
    second = torch.cat([b["input_ids"] for b in full[0][per_pass:]])
    assert not torch.equal(first[0], second)  # a new pass, a new order
    if drop_last:  # the order DistributedSampler(shuffle=False) + DataLoader gives
        loader = DataLoader(ds, batch_size=3, drop_last=True,
                            sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False))
        assert torch.equal(torch.cat([b["input_ids"] for b in loader]), first[1])


def test_too_few_samples_for_a_batch(megatron):
    prefix, _ = megatron
    ds = build_train_dataset(plan_data(kind="megatron", paths=[prefix], weights=[1.0], train_samples=5), L, 0, 100)
    assert isinstance(ds, TrainDataset) and len(ds) == 5
    with pytest.raises(DataError, match="make no micro batch"):
        next(batches(ds, 3, 0, 2))
