"""LoRA on a pipeline (mf_ds/pipeline.py builds the stages, mf_ds/lora.py places the adapters).

Placement. PEFT is applied to the whole model on the meta device (pipeline.Pieces.meta), after the stage's modules
are materialised and patched: the stage's modules are the meta model's own objects, so PEFT's LoraModel, which
replaces each chosen Linear by a LoRA layer in its parent, puts the adapters into the stage; the other stages' chosen
Linears get theirs on the meta device (no memory). So the chosen modules are exactly one rank's (`lora.targets`
on the same model and names), the adapters carry one rank's names (`base_model.model.model.layers.N...`), and PEFT
freezes every base weight as on one rank. The adapters' initial values come from a generator per adapter
(`lora.initialise`: the run's seed and the module's name), the values one rank draws. mf-ds' optimizer takes the
trainable parameters only (mf_ds/optim.py), so ZeRO-1 partitions the adapters alone.

A weight tied across stages (the embedding under tie_word_embeddings or MTP) is frozen: its copies have no
gradient, which PipelineEngine's sum over the tie skips (_exec_reduce_tied_grads: `if grad is not None`).

Export at the end of the run (lora_export.export on one rank): every stage's tensors under the PEFT model's names
(experts gathered over the stage's expert-parallel ranks, a tied copy counted once) are gathered on rank 0, which
writes the same files from them (lora_export.write): PEFT's adapter directory, name by name one rank's, and the
merged HF weights. Rank 0 then holds the whole merged model on the CPU once, as one rank's export does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mf_ds.errors import RunError
from translators.plan_types import Plan


def attach(module: nn.Module, plan: Plan, weights: str | None, log: Callable[[str], None] | None) -> None:
    """The Plan's adapters on this stage (PEFT on the meta model the stage was cut from); `module.pieces.peft`
    keeps the PEFT model for the export."""
    from mf_ds import lora, shared_expert

    pieces = module.pieces
    config = pieces.meta.config
    if weights and shared_expert.width(config) is None and not getattr(config, "mtp_variant", None):
        # the base's name, as one rank's from_pretrained (mf_ds/model.py build_model) leaves it for PEFT's
        # adapter_config.json `base_model_name_or_path`
        config._name_or_path = pieces.meta.name_or_path = str(Path(weights))
    chosen = lora.targets(pieces.meta, plan.run.lora, plan.weights_family, plan)
    if "lm_head" in chosen:  # the last stage lends the head's weight to the loss (pipeline_stage.StageLoss)
        raise RunError(f"{plan.run.lora.source}.target_modules {plan.run.lora.target_modules!r} with "
                       "pipeline_stage > 1: an adapter on the LM head is not composed with the pipeline yet; narrow "
                       "it to the decoder layers")
    pieces.peft = lora.apply(pieces.meta, plan, log)


def stage_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's tensors under the PEFT model's names, on the CPU; collective over each expert-parallel group."""
    from mf_ds.moe.parallel import gather_full_state_dict

    peft = module.pieces.peft
    copies = {name for name, p in peft.named_parameters() if getattr(p, "ds_pipe_replicated", False)}
    state = {name: t.detach() for name, t in peft.state_dict().items()
             if t.device.type != "meta" and name not in copies}
    return {name: t.cpu() for name, t in gather_full_state_dict(peft, base=state).items()}


def _on_rank0(engine: Any, adapters_only: bool) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors (or its adapters alone) on rank 0, from each stage's data-parallel rank 0; None on the
    other ranks. Collective."""
    state = stage_state(engine.module)  # every rank: the experts' gather is collective
    if adapters_only:
        state = {name: t for name, t in state.items() if ".lora_" in name}
    mine = state if engine.grid.get_data_parallel_rank() == 0 else {}
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return None if parts is None else {name: tensor for part in parts for name, tensor in part.items()}


def export(engine: Any, output_dir, plan: Plan, log: Callable[[str], None] | None = None) -> None:
    """lora_export.export of a pipelined run: rank 0 writes the adapters and the merged weights from every stage's
    tensors. Collective."""
    from mf_ds.lora_export import write

    whole = _on_rank0(engine, adapters_only=False)
    if whole is not None:
        write(engine.module.pieces.peft, whole, output_dir, plan, log)


def write_adapters(engine: Any, directory: Path) -> None:
    """A checkpoint's weights under LoRA, as one rank's checkpoint holds them (PeftModel.save_pretrained: the
    adapters in PEFT's layout; the base weights stay those the run loaded): the pipelined checkpoint's hf_writer
    (mf_ds/checkpoint/pipelined.py). Collective; rank 0 writes."""
    adapters = _on_rank0(engine, adapters_only=True)
    if adapters is not None:
        engine.module.pieces.peft.save_pretrained(str(directory), state_dict=adapters, safe_serialization=True)
