"""MindFormers' optimizer state in a Checkpoint 2.0 <-> the torch optimizer state of mf-ds' DeepSpeed engine.

Names (MindFormers 2.0.0 / 2.1.0, under each parameter's full MindFormers name, in the opt-*.safetensors files):
    adam_m.<name>, adam_v.<name>    AdamW's moments (core/optim/adamw.py clone_state; pynative/optimizer/adamw.py
                                    _init_state; the AdamW part of Muon: pynative/optimizer/muon.py :2463)
                                    -> torch's exp_avg, exp_avg_sq (torch.optim.AdamW, mf_ds/optim.py, mf_ds/muon.py)
    muon_m.<name>                   Muon's momentum (pynative/optimizer/muon.py :2459, core/optim/muon.py :367)
                                    -> mf_ds/muon.py's momentum_buffer (the same recurrence: m = mu m + g)
    global_step [1]                 the optimizer's step counter (mindspore Optimizer.global_step)
    main_param.<name>               the PyNative AdamW's fp32 master of a bf16 / fp16 weight (_init_main_params)
                                    -> the fp32 weight mf-ds trains (its parameter, or DeepSpeed's fp32 partition)
    learning_rate                   the base LR: not read (the LR comes from the schedule at the resumed step)
The moments are laid out as their weights are (clone_state clones the weight's param_info), so they go through the
weights' own MindFormers -> HF conversion (mf_ds/weights.py to_hf: fused qkv / gate_up split, experts stacked).

Bias correction. MindFormers' AdamW (core/optim/adamw.py construct, pynative adamw.py construct + forward_opt):
    lr = schedule(global_step); global_step += 1; t = global_step
    m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w = w (1 - lr wd) - lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t)) + eps)
so after N updates global_step = N and the next update uses t = N + 1: torch.optim.AdamW's state `step` = N (it adds
one before its update), and the LR scheduler's position is N (LambdaLR.last_epoch, mf_ds/optim.py). The fused
PyNative AdamW (enable_fused_opt) starts global_step at -1 and saves N - 1: told by common.json's global_step being
one more, and read as N. The trainer's own step (data position, schedule) is common.json's global_step, rescaled by
the global batch size ratio as MindFormers' trainers rescale it when the batch size changed.

Which optimizers map: AdamW / MindSpore's AdamWeightDecay family (mf_ds/optim.py: exp_avg, exp_avg_sq, step) and
mf_ds/muon.py's Muon. Others (SGD, Adam with L2) have no MindFormers counterpart whose state means the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mf_ds.checkpoint.sharded import _FILE
from mf_ds.errors import RunError
from mf_ds.optim import _Fp32StateAdam
from mf_ds.weights import model_slot, to_hf
from translators import names

TORCH_KEYS = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq", "muon_m": "momentum_buffer"}
MF_PREFIX = {v: k for k, v in TORCH_KEYS.items()}
_ADAM = ("exp_avg", "exp_avg_sq")


class Unmapped(RunError):
    """The checkpoint's optimizer state does not map onto this run's optimizer (the message says why)."""


def state_keys(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[str, ...]]:
    """{parameter name: the torch state keys its optimizer keeps}, from the optimizer mf_ds/optim.py built (call it
    before deepspeed.initialize, which replaces the groups of a ZeRO optimizer). Unmapped for other optimizers."""
    from mf_ds.muon import Muon  # here: its class derives from DeepSpeed's, and DeepSpeed is imported only when used

    if not isinstance(optimizer, (torch.optim.AdamW, _Fp32StateAdam, Muon)):
        raise Unmapped(f"this run's optimizer is {type(optimizer).__name__}, whose state has no MindFormers "
                       "counterpart (AdamW and Muon map)")
    owner = {id(p): n for n, p in model.named_parameters()}
    keys = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            keys[owner[id(p)]] = ("momentum_buffer",) if group.get("muon") else _ADAM
    return keys


@dataclass
class OptimizerState:
    """Per parameter name its torch state tensors (fp32, the parameter's whole shape), and the step counts."""

    tensors: dict[str, dict[str, torch.Tensor]]
    step: int
    """The optimizer's update count t (torch `step`)."""
    trainer_step: int
    """The trainer's step: data position and LR schedule."""
    notes: list[str]


def _prefixes(ckpt) -> set[str]:
    return {n.split(".", 1)[0] for n in ckpt.names() if n.split(".", 1)[0] in TORCH_KEYS}


def read(ckpt, model: torch.nn.Module, family: str, layout, keys: dict[str, tuple[str, ...]],
         global_batch_size: int | None = None, masters: bool = False) -> OptimizerState:
    """The optimizer state of Checkpoint2 `ckpt` for `model`'s parameters; Unmapped (one line naming the checkpoint)
    when it has none, or not the state `keys` asks for, for every parameter. `masters`: also each parameter's fp32
    master ("master"), for an engine whose parameters are bf16 / fp16 (DeepSpeed makes its masters from them)."""
    where = ckpt.directory
    if not any((m := _FILE.match(f.name)) and m.group(1) == "opt" for f in ckpt.files()):
        raise Unmapped(f"{where}: holds no optimizer state (no opt-*.safetensors)")
    held, wanted = _prefixes(ckpt), {MF_PREFIX[k] for ks in keys.values() for k in ks}
    if not wanted <= held:
        kinds = {"muon_m": "Muon's", "adam_m": "AdamW's", "adam_v": "AdamW's"}
        have = ", ".join(sorted(f"{p}.*" for p in held)) or "no adam_m / adam_v / muon_m tensors"
        need = ", ".join(sorted(p + ".*" for p in wanted - held))
        raise Unmapped(f"{where}: its optimizer state is {have}; this run's optimizer needs {need} "
                       f"({' and '.join(sorted({kinds[p] for p in wanted - held}))} state)")
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters() if n in keys}
    out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in keys}
    for prefix in sorted(wanted):
        key = TORCH_KEYS[prefix]
        for n, value in _assemble(ckpt, prefix, [n for n, ks in keys.items() if key in ks], model, family, layout,
                                  shapes).items():
            out[n][key] = value
    if masters:
        # fp32 masters: the weights as stored (fp32 in MindFormers' graph mode and in mf-ds' files), or
        # main_param.* where MindFormers' PyNative AdamW kept them for bf16 / fp16 weights
        found = _assemble(ckpt, "", list(keys), model, family, layout, shapes)
        if "main_param" in {n.split(".", 1)[0] for n in ckpt.names()}:
            found.update(_assemble(ckpt, "main_param", list(keys), model, family, layout, shapes, partial=True))
        for n, value in found.items():
            out[n]["master"] = value
    common = ckpt.common
    trainer_step = _int(common.get("global_step"), where / "common.json", "global_step")
    counter = _counter(ckpt) if "global_step" in ckpt.names() else None
    notes = []
    if trainer_step is None:
        if counter is None:
            raise Unmapped(f"{where}: neither common.json nor the optimizer holds a global_step")
        trainer_step = counter
    if counter is None or counter == trainer_step:
        step = trainer_step
    elif counter == trainer_step - 1:  # the fused PyNative AdamW's counter starts at -1
        step = trainer_step
        notes.append(f"optimizer global_step {counter} = common.json's {trainer_step} - 1: the fused AdamW's count "
                     f"(it starts at -1); bias correction continues from t = {trainer_step}")
    else:
        step = counter
        notes.append(f"optimizer global_step {counter} differs from common.json's {trainer_step}: bias correction "
                     f"continues from the optimizer's, the data and the schedule from common.json's")
    if step < 0:
        raise Unmapped(f"{where}: global_step {step} is negative")
    consumed, saved_gbs = common.get("consumed_samples"), common.get("global_batch_size")
    if isinstance(saved_gbs, int) and not isinstance(saved_gbs, bool) and saved_gbs > MAX_COUNT:
        raise Unmapped(f"{where / 'common.json'}: global_batch_size {str(saved_gbs)[:40]}... is not a batch size "
                       f"(at most {MAX_COUNT})")
    if type(consumed) is int and type(saved_gbs) is int and consumed != trainer_step * saved_gbs:
        notes.append(f"consumed_samples {consumed} is not global_step x global_batch_size ({trainer_step} x "
                     f"{saved_gbs}; a dynamic batch size?): mf-ds continues the data at step {trainer_step}")
    if global_batch_size and isinstance(saved_gbs, int) and saved_gbs > 0 and saved_gbs != global_batch_size:
        scaled = int(trainer_step * (saved_gbs / global_batch_size))
        notes.append(f"global batch size {saved_gbs} in the checkpoint, {global_batch_size} here: step "
                     f"{trainer_step} -> {scaled} (MindFormers' rescaling; the sample budget is kept)")
        trainer_step = scaled
    return OptimizerState(out, step, trainer_step, notes)


def _assemble(ckpt, prefix: str, targets: list[str], model, family: str, layout, shapes: dict[str, tuple],
              partial: bool = False) -> dict[str, torch.Tensor]:
    """{parameter: its `prefix`.* tensors of `ckpt` (the weights themselves for prefix ""), through the weights'
    MindFormers -> HF conversion}, fp32, for every parameter of `targets` (Unmapped when one lacks them; with
    `partial`, those that have them)."""
    where = ckpt.directory
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    state_prefixes = tuple(f"{p}." for p in (*TORCH_KEYS, "main_param"))
    buffers = {n: torch.full(shapes[n], math.nan) for n in targets}
    filled: dict[str, int] = {}
    for name in ckpt.names():
        if prefix and not name.startswith(prefix + "."):
            continue
        if not prefix and name.startswith(state_prefixes):
            continue
        mf_name = name[len(prefix) + 1:] if prefix else name
        mtp_built = getattr(model.config, "mtp_variant", None) is not None  # mf_ds/mtp.py built the MTP blocks
        if not names.is_weight(mf_name, family) or (not mtp_built and names.mtp_layer(
                mf_name, family, model.config.num_hidden_layers)):
            continue
        for piece in to_hf(mf_name, ckpt.tensor(name).float(), family, model.config, layout) or []:
            slot = model_slot(piece.name, buffers)
            if slot is None:
                if piece.name in tied or model_slot(piece.name, shapes) is not None or not prefix:
                    continue  # tied, a parameter whose optimizer keeps another state (Muon's AdamW part), a buffer
                raise Unmapped(f"{where}: {name} ({piece.name}) is not the state of a parameter of this model")
            param, index = slot
            whole = buffers[param][index] if index else buffers[param]
            region = whole.reshape(piece.view)[piece.index] if piece.view else whole
            if tuple(region.shape) != tuple(piece.tensor.shape):
                raise Unmapped(f"{where}: {name} gives {piece.name} the shape {list(piece.tensor.shape)}, the "
                               f"model {list(region.shape)}")
            region.copy_(piece.tensor)
            filled[param] = filled.get(param, 0) + piece.tensor.numel()
    short = sorted(n for n, b in buffers.items() if filled.get(n, 0) < b.numel() or not torch.isfinite(b).all())
    if partial:
        return {n: b for n, b in buffers.items() if n not in short}
    if short:
        what = f"{prefix}.* state" if prefix else "weight"
        raise Unmapped(f"{where}: {len(short)} of {len(buffers)} parameters have no (or no whole, or a non-finite) "
                       f"{what} (first: {short[0]}, MindFormers name "
                       f"{(prefix + '.') if prefix else ''}{names.hf_to_mf(short[0], family)})")
    return buffers


def _counter(ckpt) -> int:
    """The optimizer's global_step tensor ([1] integers in MindFormers' files) as a Python int."""
    entry = ckpt.entries["global_step"]
    if entry.dtype not in ("I32", "I64") or len(entry.shape) > 1 or math.prod(entry.shape) != 1:
        raise Unmapped(f"{entry.chunks[0].file}: global_step is {entry.dtype}{list(entry.shape)}; MindFormers' "
                       "optimizer counter is one integer")
    return int(ckpt.tensor("global_step").reshape(-1)[0])


# MindSpore keeps global_step and the batch size as int32; a larger number in common.json is damage, and a 400-digit
# one overflowed the float rescaling below.
MAX_COUNT = 2**31 - 1


def _int(value, where, what: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise Unmapped(f"{where}: {what} {str(value)[:40]!r} is not a step count (an int from 0 to {MAX_COUNT})")
    return value


def _inner(engine) -> torch.optim.Optimizer:
    """The torch optimizer that holds the state: the engine's own, or the one a ZeRO / bf16 optimizer wraps."""
    opt = engine.optimizer
    return opt.optimizer if hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer) else opt


def _flat(engine, inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the torch optimizer steps: the parameters (ZeRO 0), the fp32 flat partitions (ZeRO 1/2, bf16),
    or ZeRO 3's sub-group partitions (stage3.py hands them to the optimizer one at a time in _optimizer_step)."""
    if engine.zero_optimization_stage() == 3:
        return list(engine.optimizer.fp32_partitioned_groups_flat)
    return [p for g in inner.param_groups for p in g["params"]]


def _step_value(inner: torch.optim.Optimizer, step: int):
    """torch.optim.AdamW keeps `step` as a float tensor; mf-ds' own optimizers as an int."""
    return torch.tensor(float(step)) if isinstance(inner, torch.optim.AdamW) else step


def install(engine, state: OptimizerState, keys: dict[str, tuple[str, ...]]) -> None:
    """Write `state` into the engine's optimizer, at ZeRO 0 (the torch optimizer's own per-parameter state), ZeRO 1/2
    and the bf16 optimizer (the fp32 flat partitions, through each parameter's DeepSpeed fragment address) and ZeRO 3
    (DeepSpeed's set_full_hp_param). Every rank writes its own partition; nothing is communicated."""
    inner = _inner(engine)
    params = dict(engine.module.named_parameters())
    mine = {id(p) for p in params.values()}
    flat = _flat(engine, inner)
    every = sorted({k for ks in keys.values() for k in ks})
    for p in flat:  # a ZeRO flat partition: its state exists before the first step (torch creates it lazily)
        if id(p) not in mine:
            slot = inner.state[p]
            for key in every:
                slot.setdefault(key, torch.zeros_like(p))
            slot["step"] = _step_value(inner, state.step)
    zero3 = engine.zero_optimization_stage() == 3
    by_ptr = {p.data_ptr(): p for p in flat}
    for name, ks in keys.items():
        p = params[name]
        if id(p) in {id(q) for q in flat}:  # ZeRO 0: the optimizer steps the parameter itself
            slot = inner.state[p]
            slot.clear()
            slot.update({key: state.tensors[name][key].to(p.device).clone() for key in ks})
            if ks == _ADAM:
                slot["step"] = _step_value(inner, state.step)
            continue
        for key in ks:
            value = state.tensors[name][key]
            if zero3:
                p._z3_optimizer.set_full_hp_param(value.to(flat[0].device), p, key)
            elif getattr(p, "_hp_mapping", None) is not None:
                mapping = p._hp_mapping
                base = mapping.hp_fragment._base if mapping.hp_fragment._base is not None else mapping.hp_fragment
                buf = inner.state[by_ptr[base.data_ptr()]][key]
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                buf.narrow(0, hp.start, hp.numel).copy_(value.flatten().narrow(0, lp.start, lp.numel))
            # else: ZeRO 1/2 and this rank's partition holds none of the parameter
    with torch.no_grad():
        for name, tensors in state.tensors.items():
            value = tensors.get("master")
            if value is None:
                continue
            p = params[name]
            if zero3:
                p._z3_optimizer.set_full_hp_param(value.to(flat[0].device), p)
                continue
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                lp = mapping.lp_fragment_address
                mapping.hp_fragment.copy_(value.flatten().narrow(0, lp.start, lp.numel))
            p.data.copy_(value.reshape(p.shape).to(p.dtype))  # the whole low-precision copy (ZeRO 0-2 keep it whole)


def gather(engine, keys: dict[str, tuple[str, ...]]) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """Every parameter's whole optimizer state (fp32, CPU) and the update count, on every rank. Collective under
    ZeRO: each rank contributes the fragments its partition holds (the reverse of `install`)."""
    inner = _inner(engine)
    params = dict(engine.module.named_parameters())
    flat = _flat(engine, inner)
    by_ptr = {p.data_ptr(): p for p in flat}
    zero3 = engine.zero_optimization_stage() == 3
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, ks in keys.items():
        p = params[name]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        out[name] = {}
        for key in ks:
            if zero3:
                value = p._z3_optimizer.get_full_hp_param(p, key)
            elif hasattr(p, "_hp_mapping"):
                value = torch.zeros(p.numel(), dtype=torch.float32, device=flat[0].device)
                mapping = p._hp_mapping
                if mapping is not None:
                    base = mapping.hp_fragment._base if mapping.hp_fragment._base is not None else mapping.hp_fragment
                    held = inner.state.get(by_ptr[base.data_ptr()], {}).get(key)
                    if held is not None:
                        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                        value.narrow(0, lp.start, lp.numel).copy_(held.narrow(0, hp.start, hp.numel))
                dist.all_reduce(value, group=p._dp_group)
            else:
                value = inner.state.get(p, {}).get(key)
            if value is None:  # never stepped (no gradient yet): zeros, as a fresh optimizer holds
                value = torch.zeros(shape)
            out[name][key] = value.detach().float().cpu().reshape(shape)
    steps = [inner.state[p]["step"] for p in flat if "step" in inner.state.get(p, {})]
    step = int(max((float(s) for s in steps), default=0))
    return out, step


def low_precision(engine) -> bool:
    """bf16 / fp16 engines keep fp32 masters apart from the module's parameters."""
    return engine.bfloat16_enabled() or engine.fp16_enabled()


def masters(engine, names: list[str]) -> dict[str, torch.Tensor]:
    """Every named parameter's fp32 master, whole, on every rank (collective under ZeRO: each rank adds the fragments
    its partition holds, as `gather`)."""
    params = dict(engine.module.named_parameters())
    zero3 = engine.zero_optimization_stage() == 3
    out = {}
    for name in names:
        p = params[name]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if zero3:
            value = p._z3_optimizer.get_full_hp_param(p)
        elif hasattr(p, "_hp_mapping"):
            value = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            mapping = p._hp_mapping
            if mapping is not None:
                lp = mapping.lp_fragment_address
                value.narrow(0, lp.start, lp.numel).copy_(mapping.hp_fragment)
            dist.all_reduce(value, group=p._dp_group)
        else:
            value = p.detach()
        out[name] = value.detach().float().cpu().reshape(shape)
    return out


def mindformers_state(state: dict[str, dict[str, torch.Tensor]],
                      convert: Callable[[dict[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The MindFormers-named optimizer tensors (adam_m.<name>, ...) of `state`; `convert` turns one HF-named dict
    into MindFormers-named tensors (the weights' own conversion)."""
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensors in state.items():
        for key, value in tensors.items():
            by_key.setdefault(key, {})[name] = value
    for key in sorted(by_key):
        for mf_name, tensor in convert(by_key[key]):
            yield f"{MF_PREFIX[key]}.{mf_name}", tensor
