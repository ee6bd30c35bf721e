"""The DeepSpeed loop in a page: a MindFormers YAML, the translated HF model, mf_ds's data and optimizer.

    python examples/train_deepspeed.py configs/tiny_llama.yaml --max_steps 20
(`mf-train` / `deepspeed mf_ds/train.py` add checkpoints, resume, metrics and reports to this loop.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", "29691")):
    os.environ.setdefault(name, value)

import deepspeed  # noqa: E402

from mf_ds.data import batches  # noqa: E402
from mf_ds.engine import deepspeed_config  # noqa: E402
from mf_ds.model import prepare  # noqa: E402
from mf_ds.optim import build_optimizer, build_scheduler  # noqa: E402
from translators import translate_file  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default=str(Path(__file__).parents[1] / "configs" / "tiny_llama.yaml"))
    p.add_argument("--max_steps", type=int, default=20)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    plan = translate_file(args.config, world_size=torch.distributed.get_world_size()).plan
    run = plan.run
    # seed; AutoModelForCausalLM.from_config(plan.hf_config); the MoE layer, fused kernels and MindFormers'
    # per-layer / per-op recompute (mf_ds.patch.apply); the data set and the step counts
    prepared = prepare(plan, max_steps=args.max_steps)
    model, dataset = prepared.model, prepared.dataset
    optimizer = build_optimizer(model, run.optimizer)  # AdamW or AdamWeightDecay, decay on matrices only
    # MindFormers' exact formula; total_steps counts epochs x data_size
    scheduler = build_scheduler(optimizer, run.lr_schedule, prepared.data_size, log=print)
    config = deepspeed_config(plan)  # plan.deepspeed without the optimizer and schedule built here
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=config)
    data = batches(dataset, run.micro_batch_size, engine.global_rank, engine.world_size, passes=None)
    for step in range(1, prepared.total_steps + 1):
        for _ in range(run.gradient_accumulation_steps):
            batch = next(data)
            # labels are already the next tokens (Megatron samples): shift_labels stops HF shifting them again
            loss = engine(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=batch["labels"]).loss
            engine.backward(loss)  # divides by gradient_accumulation_steps
            engine.step()          # the optimizer steps (with clipping) at the accumulation boundary
        if engine.global_rank == 0:
            print(f"step {step}: loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
