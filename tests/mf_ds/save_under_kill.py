"""Run by tests/mf_ds/test_durable.py in a subprocess: save a checkpoint twice, the second save SIGKILLed at one point.

    python -m tests.mf_ds.save_under_kill legacy|checkpoint2 ROOT POINT FIRST SECOND

The first save (step FIRST) completes; then MF_DS_TEST_KILL_AT=POINT@SECOND is set and step SECOND is saved (SECOND
== FIRST saves the same step again, as a run restarted from an earlier checkpoint does). Each save records which
one it was (`save`: 1 or 2) in its trainer state / common.json, and the weights differ, so the test can tell which
checkpoint survived. legacy: mf_ds/checkpoint/native.py `save` with a real one-rank DeepSpeed engine of a tiny Llama;
checkpoint2: mf_ds/checkpoint/sharded.py `write`, the files MindFormers' save_checkpoint writes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

KILL_AT = "MF_DS_TEST_KILL_AT"


def tensors(save: int) -> dict[str, torch.Tensor]:
    return {"embedding.word_embeddings.weight": torch.full((8, 4), float(save)),
            "output_layer.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4) * save}


def legacy(root: Path, point: str, first: int, second: int) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from mf_ds.checkpoint import native

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[6], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 0}})
    native.save(engine, root, "t", first, {"save": 1}, keep=2)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    os.environ[KILL_AT] = f"{point}@{second}"
    native.save(engine, root, "t", second, {"save": 2}, keep=2)
    dist.destroy_process_group()


def checkpoint2(root: Path, point: str, first: int, second: int) -> None:
    from mf_ds.checkpoint import sharded as ck2

    ck2.write(root, iter(tensors(1).items()), iteration=first, common={"save": 1},
              optimizer=iter({"adam_m.output_layer.weight": torch.ones(8, 4)}.items()))
    os.environ[KILL_AT] = f"{point}@{second}"
    ck2.write(root, iter(tensors(2).items()), iteration=second, common={"save": 2},
              optimizer=iter({"adam_m.output_layer.weight": torch.full((8, 4), 2.0)}.items()))


if __name__ == "__main__":
    kind, root, point, first, second = sys.argv[1:6]
    (legacy if kind == "legacy" else checkpoint2)(Path(root), point, int(first), int(second))
