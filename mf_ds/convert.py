"""`mf-convert --mf-config x.yaml SRC DST`: MindFormers weights <-> an HF directory, by the family's name table.

  MindFormers -> HF   SRC: what load_checkpoint takes (a .ckpt, rank_0/*.ckpt, MindFormers safetensors); DST: a
                      directory with model.safetensors (the tensors in their own dtype, HF names) and config.json
                      (the YAML's HF config), loadable by AutoModelForCausalLM.from_pretrained.
  HF -> MindFormers   SRC: an HF directory (an mf-ds checkpoint or a save_pretrained one); DST: a .ckpt written as
                      mindspore.save_checkpoint writes it, or a .safetensors with MindFormers names (metadata
                      {"format": "ms"}, as MindSpore writes); MindFormers' load_checkpoint reads either.
Every tensor is checked against the model the YAML describes (built on the meta device: shapes only), and the
conversion is exact: the same bits, the dtype kept. The logic is in `to_hf` / `to_mindformers`; `cli` parses and
prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mf_ds.ckpt import load_into, write_ckpt
from mf_ds.errors import RunError
from translators import names


def _meta_model(plan: dict):
    from transformers import AutoModelForCausalLM

    from mf_ds.model import hf_config

    config = hf_config(plan)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def to_hf(plan: dict, src: str, dst: str) -> dict[str, int]:
    """MindFormers checkpoint SRC -> HF directory DST."""
    from safetensors.torch import save_file

    model = _meta_model(plan)
    out: dict[str, torch.Tensor] = {}
    counts = load_into(model, src, plan["run"]["family"], write=lambda name, t: out.__setitem__(name, t.contiguous()))
    target = Path(dst)
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(target))
    return counts


def to_mindformers(plan: dict, src: str, dst: str) -> int:
    """HF directory SRC -> MindFormers .ckpt or .safetensors DST; returns the number of tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mf_ds.model import weight_files

    family = plan["run"]["family"]
    names.name_map(family)
    state = _meta_model(plan).state_dict()
    owners = weight_files(Path(src))  # checks the files (index, shards, checksums) first
    unknown = sorted(set(owners) - set(state))
    if unknown:
        raise RunError(f"{owners[unknown[0]]}: {unknown[0]} is not a weight of the YAML's {family} model")

    def tensors():
        for name in sorted(owners):
            with safe_open(str(owners[name]), framework="pt") as f:
                tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise RunError(f"{owners[name]}: {name} has shape {list(tensor.shape)}, the YAML's model "
                               f"{list(state[name].shape)}")
            yield names.hf_to_mf(name, family), tensor

    if dst.endswith(".ckpt"):
        return write_ckpt(dst, tensors())
    if dst.endswith(".safetensors"):
        out = dict(tensors())
        save_file(out, dst, metadata={"format": "ms"})
        return len(out)
    raise RunError(f"{dst}: the MindFormers output must end in .ckpt or .safetensors")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mf-convert", description="Convert MindFormers weights to an HF directory "
                                     "(SRC a .ckpt / MindFormers safetensors) or back (SRC an HF directory, DST a "
                                     ".ckpt or .safetensors).")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--mf-config", required=True, help="the MindFormers YAML of the model")
    args = parser.parse_args(argv)
    from translators.errors import ConfigError
    from translators.plan import translate_file

    try:
        plan = translate_file(args.mf_config).plan
        src = Path(args.src)
        if src.is_dir() and (src / "config.json").is_file():
            count = to_mindformers(plan, args.src, args.dst)
            print(json.dumps({"direction": "hf->mindformers", "tensors": count, "output": args.dst}))
        else:
            counts = to_hf(plan, args.src, args.dst)
            print(json.dumps({"direction": "mindformers->hf", **counts, "output": args.dst}))
    except (RunError, ConfigError, OSError) as exc:
        print(f"mf-convert: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def main() -> None:
    sys.exit(cli())


if __name__ == "__main__":
    main()
