"""The peer of bench/train_throughput.py: the same HF model and DeepSpeed config trained by a plain loop, no mf_ds.

Inputs are the files `mf-translate` writes (hf.json, ds.json): the translation is configuration, the training
loop here is the textbook one (DeepSpeed's getting-started loop with an HF causal LM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _name, _value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                      ("MASTER_PORT", "29671")):
    os.environ.setdefault(_name, _value)
import deepspeed  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--ds", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    hf = json.load(open(args.hf))
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ds = json.load(open(args.ds))
    ds.pop("scheduler", None)
    opt = ds.pop("optimizer")["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    micro, ga = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    data = torch.randint(3, config.vocab_size, (args.steps * ga * micro, args.seq))
    loader = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=micro))
    rates = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for _ in range(ga):
            (tokens,) = next(loader)
            loss = engine(input_ids=tokens, labels=tokens).loss  # HF shifts the labels itself
            engine.backward(loss)
            engine.step()
        rates.append(ds["train_batch_size"] * args.seq / (time.perf_counter() - start))
    json.dump({"tokens_per_s": rates, "median": statistics.median(rates[5:])}, open(args.out, "w"))


if __name__ == "__main__":
    main()
