"""The Plan's recompute settings applied to an HF causal LM as activation checkpointing.

MindFormers decides per decoder layer (`LayerSetting.set`, r1.5.0 mindformers/models/utils.py; reference
recompute.md §6): a fully recomputed layer keeps only its input and reruns its forward in backward; otherwise the
selected ops (`select_recompute`) keep their outputs out of the saved set and are rerun from what is kept, and
`select_comm_recompute` reruns the communication feeding an op. Full recompute wins over select. The Plan's
`layers` hold the outcome as HF module paths of one decoder layer (`mlp.act_fn`, `input_layernorm`, ...).

What each form keeps for backward (T tokens, H hidden, I MLP width; 4 bytes an element in fp32):
- full recompute: HF v5's own per-layer switch (`GradientCheckpointingLayer.gradient_checkpointing` and
  `_gradient_checkpointing_func`, modeling_layers.py), set on the planned layers only. Keeps the layer's input
  (T x H); the rest of the layer is rerun in backward. `checkpoint_fn` (e.g. `deepspeed.checkpointing.checkpoint`)
  replaces torch's non-reentrant checkpoint here, and only here.
- select, ops of a SwiGLU MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`; `mul` is the product, which HF
  computes inline): as in MindSpore, a selected op's output is not kept; backward rebuilds it from what is kept.
  The selected ops and the ops that read their outputs run under one non-reentrant torch checkpoint whose inputs
  are what stays saved; checkpoint's early stop ends the rerun once the last saved tensor is rebuilt, before the
  reading matmul itself runs, so no matmul is repeated beyond the selected ones.
    act_fn + mul (MindFormers' default `feed_forward.w1.activation.silu` + `feed_forward.mul`): keeps gate_proj
      and up_proj outputs; drops act(gate) and the product, 2 x T x I.
    act_fn alone: `swiglu_recomputed` keeps gate and up; drops act(gate), T x I (the product stays, down_proj needs it).
    mul alone: keeps act(gate) and up; drops the product, T x I.
    gate_proj / up_proj: keeps the MLP input; drops that projection's output, T x I, and reruns its matmul.
    down_proj: keeps the product as before; its output is saved only if its reader needs it.
- select, any other module (norms, attention projections, the router, the experts, a whole `self_attn` or `mlp`):
  the module is checkpointed: it keeps its inputs and drops its internals (an RMSNorm drops x * rsqrt(var) and
  rsqrt(var), T x (H + 1) in fp32, and in bf16 also its fp32 copy of x); its output is still saved wherever a
  reader needs it (q_proj's output in Llama is read by RoPE, which keeps only cos and sin: checkpointing q_proj
  saves nothing).
- comm recompute: there is no sequence-parallel communication on this stack, so the op itself (the norm feeding
  the communication, in MindFormers' default `.*\\.norm`) is recomputed as a select entry would be.
Select regions always use torch's non-reentrant checkpoint: they take keyword tensors, nest, and need early stop.
Everything is set on instances (no class is touched, parameters and state-dict keys stay) and is undone by
`revert_recompute`. Select regions act only in training with grad enabled; in eval the HF forward runs as is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from mf_ds.ops.swiglu import fused_swiglu
from mf_ds.patch.core import Op, Recorder, decoder_layers, is_silu, swiglu_graph
from translators.plan_types import Layer

_APPLIED = "_mf_ds_recompute"  # model attribute holding apply_recompute's Recorder, for revert_recompute
_COMM_NOTE = "comm recompute: no sequence-parallel communication on this stack, so the op itself is recomputed"
_MODULE_NOTE = "keeps its input, drops its internals; its output stays saved where a reader needs it"


def swiglu_recomputed(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU product silu(gate) * up whose backward recomputes silu: mf_ds.ops.swiglu's fused op, one mechanism
    for the recompute plan and the fused-SwiGLU kernel."""
    return fused_swiglu(gate, up)


# --- the SwiGLU MLP as a graph of ops, so any selection of them becomes checkpoint regions -----------------------

class _Unit(NamedTuple):
    ops: tuple[Op, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    recompute: bool


def _units(graph: tuple[Op, ...], selected: set[str]) -> list[_Unit]:
    """Selected ops plus the ops reading their outputs (through views), split into connected regions, and the
    other ops one by one, in an order where each unit's inputs exist before it runs."""
    region, frontier = set(selected), list(selected)
    while frontier:
        name = frontier.pop()
        made = next(op for op in graph if op.name == name).outputs
        for op in graph:
            if op.name not in region and set(op.inputs) & set(made):
                region.add(op.name)
                if op.kind == "view":
                    frontier.append(op.name)
    groups: list[list[Op]] = []
    for op in (op for op in graph if op.name in region):
        linked = [g for g in groups if any(set(o.outputs) & set(op.inputs) for o in g)]
        groups = [g for g in groups if g not in linked] + [[o for g in linked for o in g] + [op]]
    groups += [[op] for op in graph if op.name not in region]
    final = graph[-1].outputs
    units = []
    for ops in groups:
        made = {t for op in ops for t in op.outputs}
        read_elsewhere = {t for op in graph if op not in ops for t in op.inputs} | set(final)
        units.append(_Unit(tuple(ops), tuple(dict.fromkeys(t for op in ops for t in op.inputs if t not in made)),
                           tuple(t for op in ops for t in op.outputs if t in read_elsewhere), ops[0].name in region))
    ordered, ready = [], {"input"}
    while units:
        unit = next(u for u in units if set(u.inputs) <= ready)
        units.remove(unit)
        ordered.append(unit)
        ready.update(unit.outputs)
    return ordered


def _run_ops(mlp: nn.Module, ops: tuple[Op, ...], values: dict[str, torch.Tensor]) -> None:
    act = next((op for op in ops if op.kind == "act"), None)
    fused = act is not None and any(op.kind == "mul" for op in ops) and is_silu(getattr(mlp, act.name))
    for op in ops:
        if op.kind == "act" and fused:
            continue  # made together with the product
        if op.kind == "mul" and fused:
            up = next(t for t in op.inputs if t != act.outputs[0])
            values[op.outputs[0]] = swiglu_recomputed(values[act.inputs[0]], values[up])
            continue
        args = [values[t] for t in op.inputs]
        if op.kind == "view":
            values.update(zip(op.outputs, args[0].chunk(2, dim=-1), strict=True))
        elif op.kind == "mul":
            values[op.outputs[0]] = args[0] * args[1]
        else:
            values[op.outputs[0]] = getattr(mlp, op.name)(*args)


@dataclass
class _SwiGLUForward:
    """Instance forward of a SwiGLU MLP whose selected ops are recomputed (an object, so deepcopy rebinds it)."""

    mlp: nn.Module
    inner: Callable | None  # an earlier instance forward, or None for the class's
    units: list[_Unit]

    def __call__(self, *args, **kwargs):
        if not (self.mlp.training and torch.is_grad_enabled()):
            return self.inner(*args, **kwargs) if self.inner else type(self.mlp).forward(self.mlp, *args, **kwargs)
        (x,) = (*args, *kwargs.values())
        values = {"input": x}
        for unit in self.units:
            if not unit.recompute or ({op.kind for op in unit.ops} == {"act", "mul"} and self._fused(unit)):
                _run_ops(self.mlp, unit.ops, values)  # swiglu_recomputed is that recompute by itself
                continue
            # no random op in an MLP: skip stashing the RNG state
            outs = checkpoint(functools.partial(self._region, unit), *(values[t] for t in unit.inputs),
                              use_reentrant=False, preserve_rng_state=False)
            values.update(zip(unit.outputs, outs, strict=True))
        return values["down_proj"]  # both graphs end there

    def _fused(self, unit: _Unit) -> bool:
        return is_silu(getattr(self.mlp, next(op.name for op in unit.ops if op.kind == "act")))

    def _region(self, unit: _Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = dict(zip(unit.inputs, tensors, strict=True))
        _run_ops(self.mlp, unit.ops, values)
        return tuple(values[t] for t in unit.outputs)


@dataclass
class _CheckpointedForward:
    """Instance forward that checkpoints a module: every tensor argument is a checkpoint input (and so counted by
    saved-tensor hooks), everything else rides along."""

    module: nn.Module
    inner: Callable | None

    def __call__(self, *args, **kwargs):
        if not (self.module.training and torch.is_grad_enabled()):
            return self._forward(*args, **kwargs)
        if kwargs.get("past_key_values") is not None:  # a rerun must not write the KV cache twice (as HF's layers)
            kwargs["past_key_values"] = None
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def run(*tensors):
            filled = list(leaves)
            for i, tensor in zip(where, tensors, strict=True):
                filled[i] = tensor
            a, k = tree_unflatten(filled, spec)
            return self._forward(*a, **k)

        return checkpoint(run, *(leaves[i] for i in where), use_reentrant=False)

    def _forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) if self.inner else type(self.module).forward(self.module, *args, **kwargs)


# --- reading the plan ---------------------------------------------------------------------------------------------

def _find(root: nn.Module, path: str) -> tuple[nn.Module | None, nn.Module, str]:
    """The module at `path` (None if absent), and the deepest module on the way with the first missing name."""
    module = root
    for name in path.split(".") if path else ():
        child = module._modules.get(name)
        if child is None:
            return None, module, name
        module = child
    return module, module, ""


def _check_entries(layers: tuple[Layer, ...], num_layers: int, model_name: str) -> None:
    seen = set()
    for n, entry in enumerate(layers):
        index = entry.index
        if index in seen:
            raise ValueError(f"recompute plan layers[{n}]: layer {index} is planned twice")
        seen.add(index)
        if not entry.mtp and not 0 <= index < num_layers:
            raise ValueError(f"recompute plan layers[{n}]: layer {index} does not exist: {model_name} has "
                             f"{num_layers} decoder layers")


def _route(layer: nn.Module, path: str) -> tuple[str, str | None]:
    """("mlp", prefix) for an op of a SwiGLU MLP, ("module", None) for a module, ("missing", why) otherwise."""
    prefix, _, leaf = path.rpartition(".")
    graph = swiglu_graph(_find(layer, prefix)[0])
    if graph and any(op.name == leaf and op.kind != "view" for op in graph):
        return "mlp", prefix
    module, ancestor, name = _find(layer, path)
    if module is None:
        return "missing", f"{type(ancestor).__name__} has no {name}"
    return "module", None


def _kept(graph: tuple[Op, ...], units: list[_Unit]) -> str:
    """What the recompute units keep, by the op whose output it is (a view's tensors live in its input's storage)."""
    owner = {t: op.inputs[0] for op in graph if op.kind == "view" for t in op.outputs}
    kept = dict.fromkeys(owner.get(t, t) for u in units if u.recompute for t in u.inputs)
    outputs = [t for t in kept if t != "input"]
    parts = ["the MLP input"] if "input" in kept else []
    return " and ".join(parts + ([f"the outputs of {', '.join(outputs)}"] if outputs else []))


def _resolve(model_name: str, prefix: str, decoder: nn.ModuleList, layers: tuple[Layer, ...]) -> dict:
    """(layer index, path) -> _route's answer for every planned path; raises for a path no planned layer has."""
    routes = {}
    for entry in layers:
        if entry.index < len(decoder):  # MTP entries too, where mf_ds/mtp.py built the block there
            for path in (*entry.select_recompute, *entry.comm_recompute):
                routes[entry.index, path] = _route(decoder[entry.index], path)
    for path in dict.fromkeys(path for _, path in routes):
        outcomes = {i: route for (i, p), route in routes.items() if p == path}
        # MoE layers hold `mlp.experts`, not `mlp.act_fn`: their SwiGLU belongs to the MoE layer (another
        # issue), so a dense-MLP path missing only from MoE layers is reported per layer, not raised.
        moe_only = all(hasattr(getattr(decoder[i], "mlp", None), "experts") for i in outcomes)
        if all(kind == "missing" for kind, _ in outcomes.values()) and not moe_only:
            i, (_, why) = next(iter(outcomes.items()))
            raise ValueError(f"recompute path {path!r} exists in none of the layers it is planned for "
                             f"({', '.join(f'{prefix}.{i}' for i in outcomes)}): {prefix}.{i}.{path}: {why} "
                             f"({model_name})")
    return routes


def _apply_select(applied: Recorder, name: str, layer: nn.Module, entry: Layer, routes: dict) -> list[str]:
    report, mlp_ops, modules = [], {}, []
    comm = set(entry.comm_recompute)
    for path in dict.fromkeys([*entry.select_recompute, *entry.comm_recompute]):
        kind, detail = routes[entry.index, path]
        if kind == "mlp":
            mlp_ops.setdefault(detail, set()).add(path.rpartition(".")[2])
        elif kind == "module":
            modules.append(path)
        else:
            report.append(f"{name}.{path}: not applicable to this layer ({detail})")
    for mlp_path, ops in mlp_ops.items():
        mlp = _find(layer, mlp_path)[0]
        graph = swiglu_graph(mlp)
        units = _units(graph, ops)
        applied.set_forward(mlp, functools.partial(_SwiGLUForward, mlp, units=units))
        chosen = [op for op in graph if op.name in ops]
        swiglu = " (SwiGLU)" if {op.kind for op in chosen} >= {"act", "mul"} else ""
        note = f"; {_COMM_NOTE}" if any(f"{mlp_path}.{op}" in comm for op in ops) else ""
        report.append(f"{name}.{mlp_path}: recompute {', '.join(op.name for op in chosen)}{swiglu}; "
                      f"keeps {_kept(graph, units)}{note}")
    for path in modules:
        module = _find(layer, path)[0]
        applied.set_forward(module, functools.partial(_CheckpointedForward, module))
        note = f"; {_COMM_NOTE}" if path in comm else ""
        report.append(f"{name}.{path}: recompute ({_MODULE_NOTE}{note})")
    return report


# --- public API -----------------------------------------------------------------------------------------------------

def patch_layers(model: nn.Module, layers: tuple[Layer, ...], recorder: Recorder,
                 checkpoint_fn: Callable | None = None) -> list[str]:
    """Apply the Plan's per-layer recompute settings to `model`, recording every change in `recorder`; return the
    report (`mf_ds.patch.apply` calls this after the MoE and kernel patches, whose modules it then wraps).

    `checkpoint_fn` checkpoints the fully recomputed layers (default: torch's non-reentrant checkpoint, as HF).
    A path a layer lacks (an MoE layer has `mlp.experts`, not `mlp.gate_proj`) is reported as not applicable
    there; MTP entries apply to the MTP blocks mf_ds/mtp.py built, and are reported and skipped where none is.
    Raises ValueError for a malformed plan, a planned path that exists in none of the layers it is planned for,
    or a model already under activation checkpointing; a bad plan changes nothing.
    """
    model_name = type(model).__name__
    prefix, decoder = decoder_layers(model)
    on = [f"{prefix}.{i}" for i, layer in enumerate(decoder) if layer.gradient_checkpointing]
    if on:
        raise ValueError(f"activation checkpointing is already on in {', '.join(on)}; the recompute plan decides "
                         "which layers are recomputed: call model.activation_checkpointing_disable() first")
    _check_entries(layers, len(decoder), model_name)
    routes = _resolve(model_name, prefix, decoder, layers)

    report = []
    full_fn = checkpoint_fn or functools.partial(checkpoint, use_reentrant=False)  # HF's default
    for entry in sorted(layers, key=lambda e: e.index):
        name = f"{prefix}.{entry.index}"
        if entry.index >= len(decoder):
            report.append(f"{name}: MTP layer, not built by {model_name}; its recompute plan is skipped")
        elif entry.full_recompute:
            layer = decoder[entry.index]
            recorder.set(layer, "gradient_checkpointing", True)
            recorder.set(layer, "_gradient_checkpointing_func", full_fn)
            report.append(f"{name}: full recompute")
            report += [f"{name}.{path}: covered by the layer's full recompute (full wins over select, as in "
                       "MindFormers)" for path in dict.fromkeys([*entry.select_recompute, *entry.comm_recompute])]
            report += [f"{name}.{path}: full_recompute_exclude not honoured: the whole layer is recomputed"
                       for path in entry.full_recompute_exclude]
        else:
            report += _apply_select(recorder, name, decoder[entry.index], entry, routes)
    if any(entry.full_recompute and entry.index < len(decoder) for entry in layers):
        # as HF's activation_checkpointing_enable: a reentrant checkpoint_fn needs an input that requires grad
        embeddings = model.get_input_embeddings()
        recorder.hooks.append(embeddings.register_forward_hook(lambda module, args, out: out.requires_grad_(True)))
    return report


def apply_recompute(model: nn.Module, layers: tuple[Layer, ...], checkpoint_fn: Callable | None = None) -> list[str]:
    """The recompute patch alone (tests; `checkpoint_fn` e.g. `deepspeed.checkpointing.checkpoint`): as
    `patch_layers`, undone by `revert_recompute`. A second apply without revert raises ValueError."""
    if hasattr(model, _APPLIED):
        raise ValueError("recompute is already applied to this model; call revert_recompute(model) first")
    recorder = Recorder()
    report = patch_layers(model, tuple(layers), recorder, checkpoint_fn)
    setattr(model, _APPLIED, recorder)
    return report


def revert_recompute(model: nn.Module) -> None:
    """Undo apply_recompute: every instance attribute and hook it set goes back to what it was."""
    recorder = model.__dict__.pop(_APPLIED, None)
    if recorder is None:
        raise ValueError("recompute is not applied to this model")
    recorder.revert()
