"""The HF Trainer in a page: a MindFormers YAML drives model, TrainingArguments, DeepSpeed and callbacks.

    python examples/hf_trainer.py configs/tiny_llama.yaml --max_steps 20 --output_dir out/hf_trainer
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", "29692")):
    os.environ.setdefault(name, value)

from mf_ds.hf import from_mf_yaml  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default=str(Path(__file__).parents[1] / "configs" / "tiny_llama.yaml"))
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--output_dir", default="out/hf_trainer")
    args = p.parse_args()
    torch.set_flush_denormal(True)  # CPU: subnormal gradients (MoE routers) slow every matmul ~40x; see mf_ds/loop.py
    # Any YAML key can be overridden by its dotted path, as --set does on the command line.
    setup = from_mf_yaml(args.config, output_dir=args.output_dir, max_steps=args.max_steps,
                         **{"mf_ds.zero_stage": 2})
    trainer = setup.trainer()  # transformers.Trainer with MindFormers' optimizer and LR formula
    trainer.train()
    trainer.save_model(f"{args.output_dir}/final")  # HF layout: AutoModelForCausalLM.from_pretrained loads it


if __name__ == "__main__":
    main()
