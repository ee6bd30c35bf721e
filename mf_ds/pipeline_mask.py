"""Attention masks and positions on a pipeline (mf_ds/pipeline.py builds the stages): each stage builds what one
rank's HF model hands its decoder layers, from the micro batch's integer tensors carried with the hidden state.

Without a pipeline the loop gives the HF model `mf_ds.attention.model_inputs(input_ids, run, implementation,
doc_ids, position_ids)`: MindFormers' pad-key mask, its per-document mask (reset_attention_mask), its restarted
positions (reset_position_ids), or the packed HFDataLoader samples' own `doc_ids` / `position_ids`; LlamaModel.forward
then makes the layers' mask (create_causal_mask returns a given 4-D mask as it is), RoPE from those positions, and
passes any other keyword (flash attention's cu_seq_lens) to every layer. On a pipeline no stage but the first sees
the batch, so the first stage's input is the tuple `(input_ids, doc_ids?, position_ids?)` (`carried`: which the
Plan's data holds) and every stage passes it on after the hidden state: `(aux?, hidden, *carried)`. Each decoder
layer then gets `layer_kwargs`, the same call on the same tensors as one rank's forward, so the same mask and
positions, batch by batch (a batch with only trailing pads keeps the plain causal path on every stage alike).

DeepSpeed's PipelineEngine carries integer tensors between stages as they are (pipe/engine.py: _send_tensor_meta
sends each tensor's dtype from ID_TO_DTYPE, int64 included; _exec_recv_activations sets requires_grad only on
floating tensors; _exec_send_grads and _exec_backward_pass skip the others, so no gradient travels for them). They
go last in the tuple, after (aux, hidden): the floating tensors keep their backward order (pipeline_stage: aux's
first), and DeepSpeed's partitioning of activations under tensor parallel, which splits the tuple's first tensor,
asserts only that the others take no gradient (_exec_forward_pass), as integer tensors do not. No bool tensors: NCCL
does not send them (DeepSpeed's has_bool_tensors hack). Cost: B x S int64 per carried tensor per micro batch, next
to the [B, S, hidden] activation. The mask itself ([B, 1, S, S]) is never sent; each stage
builds it once per micro batch (`StageInputs` keeps it for the stage's other layers).

Under do_eval (mf_ds/pipeline_eval.py) one rank's forward is `model_inputs(input_ids, run, implementation)`, without
the data's doc_ids / positions: `eval_batch` fills their slots with the ids (the tuple's shapes stay training's) and
`StageInputs.evaluating` leaves them out.
Legend: B batch, S sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from translators.plan_types import Run

DATA = ("doc_ids", "position_ids")  # what packed HFDataLoader samples hand the model (mf_ds/data/hfloader.py)


def carried(run: Run) -> tuple[str, ...]:
    """The batch's tensors that travel with the hidden state, in order: () where every batch is plain causal with
    positions 0..S-1 (then nothing more is sent than before)."""
    hf = run.data.hf or {}
    data = tuple(name for name, key in zip(DATA, ("documents", "positions"), strict=True) if hf.get(key))
    if not (run.pad_attention_mask or run.data.reset_attention_mask or run.data.reset_position_ids or data):
        return ()
    return ("input_ids", *data)


def first_stage_input(batch: dict[str, torch.Tensor], names: tuple[str, ...], evaluating: bool = False):
    """What PipelineEngine loads on the first stage for this micro batch: the ids, or the carried tuple. Evaluating,
    the data's columns are not read (one rank's eval does not): their slots hold the ids."""
    if not names:
        return batch["input_ids"]
    return tuple(batch["input_ids"] if evaluating and name in DATA else batch[name] for name in names)


def split(inputs, aux: bool, count: int) -> tuple[torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(aux or None, hidden, carried) from what a stage's layer receives."""
    if not aux and not count:
        return None, inputs, ()
    parts = inputs if isinstance(inputs, tuple) else (inputs,)
    if aux:
        return parts[0], parts[1], tuple(parts[2:])
    return None, parts[0], tuple(parts[1:])


def join(aux: torch.Tensor | None, hidden: torch.Tensor, extras: tuple[torch.Tensor, ...]):
    """The inverse of `split`: what the layer hands the next one."""
    head = (hidden,) if aux is None else (aux, hidden)
    return head + extras if extras or aux is not None else hidden


class StageInputs:
    """The decoder layers' keyword arguments on this stage, built once per micro batch (all the stage's layers
    receive the same carried tensors, so the first builds them and the others reuse them)."""

    def __init__(self, run: Run, config, rotary: nn.Module):
        self.run, self.config, self.rotary = run, config, rotary
        self.names = carried(run)
        self.evaluating = False  # set by mf_ds/pipeline_eval.py: the data's doc_ids / positions are not read
        self._key: tuple | None = None
        self._kwargs: dict | None = None

    def __call__(self, hidden: torch.Tensor, extras: tuple[torch.Tensor, ...]) -> dict:
        if not self.names:
            from mf_ds.pipeline_mtp import layer_inputs

            return layer_inputs(self.config, self.rotary, hidden)
        key = (*extras, hidden.dtype, self.evaluating)
        same = self._key is not None and len(key) == len(self._key) and \
            all(a is b for a, b in zip(key, self._key, strict=True))
        if not same:
            self._key, self._kwargs = key, layer_kwargs(self.config, self.rotary, hidden, self.run,
                                                        dict(zip(self.names, extras, strict=True)), self.evaluating)
        return self._kwargs


def layer_kwargs(config, rotary: nn.Module, hidden: torch.Tensor, run: Run, batch: dict[str, torch.Tensor],
                 evaluating: bool = False) -> dict:
    """What LlamaModel.forward hands each decoder layer when the loop calls the model with
    `model_inputs(...)` (see the module docstring)."""
    from transformers.masking_utils import create_causal_mask

    from mf_ds.attention import model_inputs

    data = {} if evaluating else batch
    given = model_inputs(batch["input_ids"], run, config._attn_implementation, data.get("doc_ids"),
                         data.get("position_ids"))
    positions = given.pop("position_ids", None)
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=given.pop("attention_mask", None),
                              past_key_values=None, position_ids=positions)
    return {"attention_mask": mask, "position_embeddings": rotary(hidden, positions), "position_ids": positions,
            **given}
