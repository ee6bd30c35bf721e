"""`mf-convert --mf-config x.yaml SRC DST`: MindFormers weights <-> an HF directory, by the family's name table.

  MindFormers -> HF   SRC: what load_checkpoint takes (a .ckpt, rank_0/*.ckpt, MindFormers safetensors); DST: a
                      directory with model.safetensors (the tensors in their own dtype, HF names) and config.json
                      (the YAML's HF config), loadable by AutoModelForCausalLM.from_pretrained.
  HF -> MindFormers   SRC: an HF directory (an mf-ds checkpoint or a save_pretrained one); DST: a .ckpt written as
                      mindspore.save_checkpoint writes it, or a .safetensors with MindFormers names (metadata
                      {"format": "ms"}, as MindSpore writes); MindFormers' load_checkpoint reads either. A DST
                      without a suffix is written as a one-card MindFormers 2.x Checkpoint 2.0 directory
                      (mf_ds/checkpoint/sharded.py), which SRC may also be (any number of ranks: merged on reading).
  LoRA (the YAML's pet_config / lora_config, mf_ds/lora.py): a MindFormers SRC's adapters (`mindpet_delta_lora_a`,
                      ...) go to DST/adapter in PEFT's layout; SRC a PEFT adapter directory (adapter_config.json):
                      DST a .ckpt / .safetensors of the adapters under MindFormers' names.
Every tensor is checked against the model the YAML describes (built on the meta device: shapes only), and the
conversion is exact: the same bits, the dtype kept. The logic is in `to_hf` / `to_mindformers`; `cli` parses and
prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from mf_ds.checkpoint.mindspore_ckpt import load_into, write_ckpt
from mf_ds.errors import RunError
from mf_ds.weights import attach_router_bias, from_hf, layout_of, mindformers_names, model_slot
from translators import names
from translators.plan_types import Plan


def _meta_model(plan: Plan):
    from mf_ds.model import hf_config, new_model

    config = hf_config(plan)
    with torch.device("meta"):
        return new_model(config)


def _family(plan: Plan) -> str:
    return plan.weights_family


def _shape(file: Path, name: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_slice(name).get_shape()


def _progress(total: int, what: str):
    """A byte-count bar on stderr (tqdm comes with transformers); silent when stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr, disable=None, leave=False)


def to_hf(plan: Plan, src: str, dst: str) -> dict[str, int]:
    """MindFormers checkpoint SRC -> HF directory DST (HF checkpoint names: per expert, q/k/v and gate/up apart).
    Holds the output and one MindFormers tensor at a time."""
    from safetensors.torch import save_file

    from mf_ds.checkpoint.mindspore_ckpt import _checkpoint_files

    model = _meta_model(plan)
    out: dict[str, torch.Tensor] = {}
    total = sum(f.stat().st_size for f in _checkpoint_files(Path(src)))
    with _progress(total, "mf-convert") as bar:
        counts = load_into(model, src, _family(plan), write=lambda name, t: out.__setitem__(name, t.contiguous()),
                           layout=layout_of(plan), progress=bar.update, adapters=plan.run.lora is not None)
    target = Path(dst)
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    shareable(target / "model.safetensors")
    # What from_pretrained, vLLM and the Hub read: the class that holds these weights and the dtype they are in
    # (the config's own dtype is the YAML's compute dtype, float32 by default, whatever the file holds).
    model.config.architectures = [type(model).__name__]
    model.config.dtype = _dtype_of(out)
    model.config.save_pretrained(str(target))
    return counts


def _dtype_of(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating dtype that holds most of the weights (a float32 router bias beside bf16 weights is the rest)."""
    sizes: dict[torch.dtype, int] = {}
    for tensor in tensors.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return max(sizes, key=sizes.get) if sizes else None


def shareable(*files: Path) -> None:
    """safetensors' save_file creates its file 0600 (private); a converted checkpoint is meant to be read by others
    (a serving job, a colleague), so it gets the mode open() gives any new file: 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    for file in files:
        file.chmod(0o666 & ~mask)


def to_mindformers(plan: Plan, src: str, dst: str) -> int:
    """HF directory SRC -> MindFormers .ckpt or .safetensors DST; returns the number of tensors. Holds the output
    (.safetensors) or nothing (.ckpt, streamed) beyond the MindFormers tensor being built."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mf_ds.model import weight_files

    family = _family(plan)
    try:
        names.name_map(family)
    except KeyError as exc:
        raise RunError(f"{src}: {exc.args[0]}") from None
    model = _meta_model(plan)
    state = model.state_dict()
    files = weight_files(Path(src))  # checks the files (index, shards, checksums) first
    # the names transformers' modules hold (save_pretrained may write others: DeepSeek-V4's own) -> the file's name
    saved = {names.hf_module_name(name, family): name for name in files
             if not names.mtp_shared_copy(name, model.config.num_hidden_layers)}
    owners = {name: files[saved[name]] for name in saved}
    for name in sorted(owners):
        slot = model_slot(name, state)
        shape = _shape(owners[name], saved[name]) if slot is None else None
        if slot is None and (bias := attach_router_bias(model, name, torch.empty(shape, device="meta"))) is not None:
            state[bias] = model.get_buffer(bias)  # balance_via_topk_bias on a family whose HF router has no bias
        elif slot is None:
            raise RunError(f"{owners[name]}: {saved[name]} is not a weight of the YAML's {family} model")
    layout = layout_of(plan)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(owners[name]), framework="pt") as f:
            tensor = f.get_tensor(saved[name])
        param, index = model_slot(name, state)
        want = tuple(state[param][index].shape) if index else tuple(state[param].shape)
        if tuple(tensor.shape) != want:
            raise RunError(f"{owners[name]}: {name} has shape {list(tensor.shape)}, the YAML's model {list(want)}")
        if not tensor.is_floating_point() and state[param].is_floating_point():  # (DeepSeek-V4's tid2eid is int)
            raise RunError(f"{owners[name]}: weight {name} is {str(tensor.dtype).removeprefix('torch.')}, not "
                           "floating point")
        if not torch.isfinite(tensor).all():  # the other direction (load_into) refuses them too
            raise RunError(f"{owners[name]}: weight {name} holds inf/NaN (a damaged file?)")
        return tensor

    def tensors():
        groups = mindformers_names(sorted(owners), family, layout, model.config.num_hidden_layers)
        with _progress(sum(f.stat().st_size for f in set(owners.values())), "mf-convert") as bar:
            for mf_name in sorted(groups):
                tensor = from_hf(mf_name, groups[mf_name], read, family, model.config, layout)
                bar.update(tensor.numel() * tensor.element_size())
                yield mf_name, tensor
                frozen = names.frozen(family)
                for part, (beside, constant, axis) in frozen.items():  # MindFormers' constants HF does not hold
                    if mf_name.endswith(beside):
                        fill = torch.ones if constant == "ones" else torch.zeros
                        yield mf_name[: -len(beside)] + part, fill(tensor.shape[axis], dtype=torch.float32)
                for bias, load in () if frozen else names.EXPERT_LOAD.items():  # the router's load counter
                    if mf_name.endswith(bias):
                        yield mf_name[: -len(bias)] + load, torch.zeros_like(tensor)

    if dst.endswith(".ckpt"):
        return write_ckpt(dst, tensors())
    if dst.endswith(".safetensors"):
        out = dict(tensors())  # every tensor checked before the file is opened
        save_file(out, dst, metadata={"format": "ms"})
        shareable(Path(dst))
        return len(out)
    if Path(dst).suffix:
        raise RunError(f"{dst}: the MindFormers output must end in .ckpt or .safetensors, or be a directory "
                       "(Checkpoint 2.0)")
    from mf_ds.checkpoint import sharded

    count = sharded.write(dst, tensors())
    shareable(*Path(dst, "iteration_00000000").glob("*.safetensors"))  # the iteration sharded.write wrote
    return count


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mf-convert", description="Convert MindFormers weights to an HF directory "
                                     "(SRC a .ckpt / MindFormers safetensors) or back (SRC an HF directory, DST a "
                                     ".ckpt or .safetensors).")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--mf-config", required=True, help="the MindFormers YAML of the model")
    parser.add_argument("--set", action="append", default=[], metavar="a.b.c=VALUE",
                        help="override a YAML key, as mf-translate and mf-train take it (repeatable)")
    args = parser.parse_args(argv)
    from translators.errors import ConfigError
    from translators.plan import translate_file

    try:
        # stdout holds the one JSON line; what the libraries print on the way (DeepSpeed's logger writes to stdout
        # when transformers imports it) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            plan = translate_file(args.mf_config, args.set).plan
            src = Path(args.src)
            if src.is_dir() and (src / "adapter_config.json").is_file():  # PEFT adapters (mf_ds/lora.py)
                from mf_ds.lora_export import peft_to_mindformers

                result = {"direction": "peft->mindformers",
                          "tensors": peft_to_mindformers(plan, args.src, args.dst, _meta_model(plan).config)}
            elif src.is_dir() and (src / "config.json").is_file():
                result = {"direction": "hf->mindformers", "tensors": to_mindformers(plan, args.src, args.dst)}
            else:
                result = {"direction": "mindformers->hf", **to_hf(plan, args.src, args.dst)}
                if plan.run.lora is not None:  # its adapters beside, in PEFT's layout
                    from mf_ds.lora_export import mindformers_to_peft

                    result["adapters"] = mindformers_to_peft(plan, args.src, str(Path(args.dst) / "adapter"),
                                                             _meta_model(plan).config)
    except (RunError, ConfigError, OSError) as exc:
        print(f"mf-convert: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps({**result, "output": args.dst}))
    return 0


def main() -> None:
    sys.exit(cli())


if __name__ == "__main__":
    main()
