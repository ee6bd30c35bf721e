"""Build the HF model the Plan describes: `from_config`, weights from an HF-layout safetensors directory, or a
MindFormers checkpoint (a MindSpore .ckpt, rank_0/*.ckpt, MindFormers-named safetensors:
mf_ds/checkpoint/mindspore_ckpt.py); and `prepare(plan)`, the one setup both trainers share (mf_ds/loop.py's
Trainer, mf_ds/hf.py's from_mf_yaml): seed, build, patch (MoE, kernels, recompute), data, step counts.

The runtime reads only the Plan (DESIGN.md): `plan.hf_config` is `AutoConfig.for_model` kwargs. Kernel and MoE
settings the runtime cannot honour yet are reported, never silently ignored.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from mf_ds.errors import RunError
from mf_ds.init import as_mindformers
from translators.plan_types import Plan


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Prepared:
    """A patched model, its data and step counts: what both trainers start from."""

    model: torch.nn.Module
    notes: list[str]
    """Plan features this runtime does not apply (pending_features)."""
    report: list[str]
    """What mf_ds.patch.apply did, one line each (the recompute plan's lines begin `recompute: `)."""
    dataset: torch.utils.data.Dataset
    steps_per_epoch: int
    """Global batches in one pass over the data."""
    total_steps: int
    """Steps this run trains: epochs x steps_per_epoch, cut by max_steps and run.stop_step."""
    data_size: int
    """MindFormers' dataset size for the LR schedule: steps_per_epoch x repeat (lr_schedule.total_steps -1)."""


def prepare(plan: Plan, *, weights: str | None = None, max_steps: int | None = None, dataset_dir: str | None = None,
            full_reason: str | None = None, log: Callable[[str], None] | None = None,
            checkpoint_fn: Callable | None = None, stage_builder: Callable | None = None) -> Prepared:
    """Seed, build (with the weights at `weights`: a file or directory, or None), patch as the Plan asks (mf_ds.patch:
    MoE, kernels, recompute), build the training data and count the steps. `log` gets the build's lines as they
    happen."""
    from mf_ds import patch, startup
    from mf_ds.data import DataError, build_train_dataset

    run = plan.run
    # The data first: data the YAML names but mf-ds cannot read stops the run before the (slow) model build.
    hf_config(plan)  # (a family with no HF architecture is named first)
    seed_everything(run.seed)
    try:
        dataset = build_train_dataset(run.data, run.seq_length, run.seed, plan.hf_config["vocab_size"],
                                      tokenizer_dir=run.tokenizer_dir, override_dir=dataset_dir)
    except DataError as exc:  # named as the run's YAML names it (PyNative: train_dataset.dataloader...)
        raise startup.in_yaml_names(exc, plan) from None
    seed_everything(run.seed)  # the model's initial weights do not depend on what reading the data drew
    lora = plan.run.lora is not None
    whole = full_reason or ("LoRA: PEFT wraps whole Linear layers (mf_ds/lora.py)" if lora else None)
    if stage_builder is not None:  # a pipeline stage (mf_ds/pipeline.py): its own modules, patched there
        model, report = stage_builder(plan, weights, log, checkpoint_fn)
    else:
        model = build_model(plan, weights, log=log, full_reason=whole)
        report = patch.apply(model, plan, checkpoint_fn=checkpoint_fn)
    notes = pending_features(plan)
    if lora and stage_builder is None:  # a pipeline stage takes its adapters as it is built (mf_ds/pipeline_lora.py)
        from mf_ds import lora as peft_lora

        model = peft_lora.attach(model, plan, weights, log)
    steps_per_epoch = len(dataset) // run.global_batch_size
    if steps_per_epoch == 0:
        raise RunError(f"the data set holds {len(dataset)} samples, fewer than one global batch of "
                       f"{run.global_batch_size}")
    total = steps_per_epoch * run.epochs
    for limit in (max_steps, run.stop_step):
        if limit:
            total = min(total, limit)
    return Prepared(model, notes, report, dataset, steps_per_epoch, total, steps_per_epoch * run.data.repeat)


def hf_config(plan: Plan):
    from mf_ds import mtp

    cfg = plan.hf_config
    if cfg is None:
        notes = plan.notes_on("model")
        raise RunError("no Hugging Face architecture for this model: " + (notes[0] if notes else "see the plan notes"))
    kwargs = dict(cfg)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.use_cache = False  # training: no KV cache
    mtp.configure(config, plan)  # DeepSeek's MTP blocks, built by new_model (mf_ds/mtp.py)
    return config


def new_model(config, log=None) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config` (fp32), then what transformers' class cannot express, before any weight is
    loaded: a DeepSeek-V4 shared expert of its own width (mf_ds/shared_expert.py). Every model mf-ds builds comes
    from here (under torch.device("meta") or zero.construction as the caller sets up)."""
    from mf_ds import mtp, shared_expert

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _report(shared_expert.apply(model), log)
    _report(mtp.attach(model), log)
    return model


def build_model(plan: Plan, load_checkpoint: str | None = None, log=None,
                full_reason: str | None = None) -> torch.nn.Module:
    """fp32 parameters (DeepSpeed casts to bf16/fp16 and keeps fp32 masters in its optimizer).

    Under ZeRO-3 the model is built partitioned (mf_ds/zero.py) unless something needs whole weights, or the caller
    gives `full_reason`; `log` gets one line either way (what each rank holds, or why the whole model is built)."""
    from mf_ds import shared_expert, zero

    config = hf_config(plan)
    if plan.parallel.context_parallel > 1:
        config._attn_implementation = "sdpa"  # Ulysses wraps SDPA; eager's 4-D masks do not shard
    if zero.partitioned(plan) and full_reason is None:
        with zero.construction(plan.deepspeed, config):
            model = new_model(config, log)
        if load_checkpoint:
            _load_partitioned(model, plan, Path(load_checkpoint))
        else:
            _report(as_mindformers(model), log)
        if log is not None:
            mine, total = zero.held(model)
            log(f"mf-ds: zero: built partitioned (deepspeed.zero.Init): this rank holds {mine:,} of {total:,} "
                "parameter elements")
        return model
    if zero.zero3(plan) and log is not None:
        why = full_reason or zero.full_build_reason(plan)
        log(f"mf-ds: zero: ZeRO-3 builds the whole model on every rank first: {why}")
    if not load_checkpoint:
        model = new_model(config, log)
        _report(as_mindformers(model), log)
        return model
    path = Path(load_checkpoint)
    if is_mindformers_checkpoint(path):
        from mf_ds.checkpoint.mindspore_ckpt import load_into
        from mf_ds.weights import layout_of

        model = new_model(config, log)
        load_into(model, path, plan.weights_family, layout=layout_of(plan), adapters=plan.run.lora is not None)
        return model
    # from_pretrained would build transformers' widths, and no MTP blocks: load ourselves
    if shared_expert.width(config) is not None or getattr(config, "mtp_variant", None):
        model = new_model(config, log)
        _load_hf(model, path, plan.weights_family)
        return model
    files = weight_files(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32,
                                                           local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise RunError(f"{path}: cannot load the weights: {str(exc).splitlines()[0]}") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise RunError(f"{path}: {len(missing)} weights of the model are not in the checkpoint (first: "
                       f"{missing[0]}); is it a checkpoint of another model?")
    _router_biases(model, files)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise RunError(f"{files.get(name, path)}: weight {name} holds inf/NaN (a damaged file?)")
    return model


def _report(lines: list[str], log) -> None:
    for line in lines if log is not None else ():
        log(line)


def _load_partitioned(model: torch.nn.Module, plan: Plan, path: Path) -> None:
    """Weights into a partitioned model, one tensor at a time (mf_ds.zero.Writer); the same checks as the whole
    build's loaders. Every rank reads every tensor (memory: one tensor), rank 0's values are kept."""
    if is_mindformers_checkpoint(path):
        from mf_ds.checkpoint.mindspore_ckpt import load_into
        from mf_ds.weights import layout_of

        # load_into sees the partitioned model and writes through zero.Writer
        load_into(model, path, plan.weights_family, layout=layout_of(plan), adapters=plan.run.lora is not None)
        return
    _load_hf(model, path, plan.weights_family)


def _load_hf(model: torch.nn.Module, path: Path, family: str | None) -> None:
    """An HF-layout safetensors directory into a built model (partitioned or whole), one tensor at a time through
    mf_ds.zero.Writer, with from_pretrained's checks (shapes, nothing missing, finite). Names as saved (DeepSeek-V4's
    save_pretrained writes DeepSeek's own) are read as transformers' modules hold them (names.hf_module_name)."""
    from mf_ds import mtp_v4, zero
    from mf_ds.weights import attach_router_bias, model_slot
    from translators import names

    files = weight_files(path)
    writer = zero.Writer(model)
    filled: dict[str, int] = {}
    for shard in sorted(set(files.values())):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for saved in f.keys():
                    tensor = f.get_tensor(saved)
                    name = names.hf_module_name(saved, family) if family else saved
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        raise RunError(f"{shard}: weight {name} holds inf/NaN (a damaged file?)")
                    slot = model_slot(name, writer.shapes)
                    if slot is None and getattr(model.config, "mtp_variant", None) == "v4":  # DeepSeek's mtp.k names
                        slot = mtp_v4.release_slot(name, writer.shapes, model.config.num_hidden_layers)
                    if slot is None and (bias := attach_router_bias(model, name, tensor)) is not None:
                        writer.shapes[bias] = writer.tensors[bias] = model.get_buffer(bias)
                        slot = (bias, ())
                    if slot is None:  # no weight of the model: ignored, as from_pretrained does
                        continue
                    param, index = slot
                    want = writer.shapes[param][index] if index else writer.shapes[param]
                    if tuple(want.shape) != tuple(tensor.shape):
                        raise RunError(f"{shard}: cannot load the weights: {name} has the shape "
                                       f"{list(tensor.shape)}, the model {list(want.shape)}")
                    writer.put(slot, tensor)
                    filled[param] = filled.get(param, 0) + tensor.numel()
        except (OSError, SafetensorError) as exc:
            raise RunError(f"{shard}: cannot load the weights: {str(exc).splitlines()[0]}") from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(n for n in params - tied if filled.get(n, 0) < writer.shapes[n].numel())
    if missing:
        raise RunError(f"{path}: {len(missing)} weights of the model are not in the checkpoint (first: "
                       f"{missing[0]}); is it a checkpoint of another model?")


def _router_biases(model: torch.nn.Module, files: dict[str, Path]) -> None:
    """The routers' e_score_correction_bias of an HF directory saved by mf-ds for a family whose HF router has none
    (balance_via_topk_bias on Mixtral, Qwen2-MoE): from_pretrained leaves it out as unexpected; put it back."""
    from mf_ds.weights import ROUTER_BIAS, attach_router_bias, model_slot

    state = model.state_dict()
    for name, file in files.items():
        if name.endswith(ROUTER_BIAS) and model_slot(name, state) is None:
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(name)
            bias = attach_router_bias(model, name, tensor)
            if bias is not None:
                with torch.no_grad():
                    model.get_buffer(bias).copy_(tensor)


def is_mindformers_checkpoint(path: Path) -> bool:
    """A file (.ckpt, .safetensors), or a directory without an HF config.json: MindFormers' layouts (a Checkpoint 2.0
    root holds its safetensors in iteration_%08d/)."""
    from mf_ds.checkpoint.sharded import is_checkpoint2

    return path.is_file() or (path.is_dir() and not (path / "config.json").is_file()
                              and ((path / "rank_0").is_dir() or any(path.glob("*.ckpt"))
                                   or any(path.glob("*.safetensors")) or is_checkpoint2(path)))


def weight_files(path: Path) -> dict[str, Path]:
    """Check the safetensors files of an HF directory before transformers reads them; {tensor name: file}.

    Each damage gets one error naming the file: an index that is not JSON or names a missing shard, a header that
    does not parse or promises more bytes than the file holds (a truncated copy), and, when the directory came out
    of an mf-ds checkpoint (checksums.json), any byte that changed since the save.
    """
    from mf_ds.checkpoint.native import verify

    if not path.exists():
        raise RunError(f"{path}: load_checkpoint does not exist")
    if not path.is_dir():
        raise RunError(f"{path}: load_checkpoint must be a .ckpt or .safetensors file, or a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RunError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        for shard in shards:
            if not (path / shard).is_file():
                raise RunError(f"{path / shard}: missing (named by {index.name})")
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        if not shards:
            raise RunError(f"{path}: no *.safetensors weights in this directory")
    problem = verify(path, only={index.name, *shards})
    if problem:
        raise RunError(f"{problem[0]}: {problem[1]}")
    owners = {}
    for shard in shards:
        try:
            with safe_open(str(path / shard), framework="pt") as f:
                owners.update(dict.fromkeys(f.keys(), path / shard))
                for name in f.keys():  # from_pretrained would cast an integer tensor into a float weight silently
                    kind = f.get_slice(name).get_dtype()
                    if name.endswith((".weight", ".bias")) and not kind.startswith(("F", "BF")):
                        raise RunError(f"{path / shard}: weight {name} is {kind}, not floating point (a weight of "
                                       "another kind of model, or a damaged conversion)")
        except (OSError, SafetensorError) as exc:
            raise RunError(f"{path / shard}: not a readable safetensors file ({exc}); truncated or damaged?") from None
    return owners


def pending_features(plan: Plan) -> list[str]:
    """Plan features this runtime does not apply, each as a report line (a note, not a silent no-op)."""
    lines = []
    if plan.mtp is None and any(layer.mtp for layer in plan.layers):
        model_type = (plan.hf_config or {}).get("model_type", "model")
        lines.append(f"mtp: transformers' {model_type} builds no MTP layers; the MTP loss is not trained")
    return lines
