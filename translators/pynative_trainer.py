"""What MindFormers 2.x's PyNative Trainer derives from a PyNative YAML, and what it refuses on the way
(translators/pynative.py builds the Plan from it). Each function follows the MindFormers function it names:
  degrees                trainer/trainer.py `_compute_data_parallel_size` and parallel_dims.py `ParallelDims._validate`:
                         data_parallel = world / (tp x pp x cp), accumulation = global / (local x dp)
  recompute_layers       activation_checkpoint.py `_validate_recompute_config` and the full-recompute layer ids
  select_modules         activation_checkpoint.py `_expand_select_module` / `_clean_and_parse_config`, onto HF modules
  check_context_parallel context_parallel.py `_validate_cp_method`, `apply_context_parallel_model_io`'s mask rule
  (pipeline_parallel.py `PpLayerSetting`: translators/pynative_layout.py)
Sources: mindformers/pynative/ of the 2.0.0 and 2.1.0 wheels; tests/fixtures/make_pynative_golden.py runs them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from translators import recompute_ops
from translators.errors import ConfigError, join, show
from translators.fixes import global_fit
from translators.notes import Ledger

_LAYER_SPEC = re.compile(r"^(\d+)(?:-(\d+))?$")  # activation_checkpoint.py _LAYER_ID_SPEC_PATTERN


@dataclasses.dataclass(frozen=True)
class Degrees:
    """What the PyNative Trainer derives from `parallelism` and `training` at a world size."""

    world: int
    data_parallel: int  # world / (tp x pp x cp)
    dp_shard: int
    dp_replicate: int
    tp: int
    cp: int
    pp: int
    ep: int
    gradient_accumulation_steps: int  # global / (local x dp)
    global_batch: int  # local x dp x accumulation (2.0.0 floors the accumulation)


def degrees(cfg: dict, version: str, world_size: int | None, ledger: Ledger) -> Degrees:
    """trainer.py `_compute_data_parallel_size` and parallel_dims.py `ParallelDims._validate` of `version`."""
    p, t = cfg["parallelism"], cfg["training"]
    tp, cp, pp, ep = p["tensor_parallel"], p["context_parallel"], p["pipeline_parallel"], p["expert_parallel"]
    local, global_ = t["local_batch_size"], t["global_batch_size"]
    for key, value in (("tensor_parallel", tp), ("context_parallel", cp), ("pipeline_parallel", pp),
                       ("expert_parallel", ep)):
        if value < 1:
            raise ConfigError(join("parallelism", key), f"must be >= 1, got {value} (MindFormers' ParallelDims: "
                              "\"Parallelism degree should be >= 1, except for dp_shard\")")
    shard = p["data_parallel_shard"]
    if not (shard == -1 or shard >= 1):
        raise ConfigError("parallelism.data_parallel_shard", f"must be -1 or >= 1, got {shard} (MindFormers' "
                          "ParallelDims refuses it)")
    if world_size is None:
        world = max(global_ // local, 1) * tp * cp * pp
        ledger.runtime("", f"world size {world}: a PyNative YAML names none (MindFormers takes the launcher's); "
                       f"this is the world whose gradient accumulation is 1 (global_batch_size {global_} / "
                       f"local_batch_size {local} data-parallel ranks x tp {tp} x cp {cp} x pp {pp}); "
                       "mf-translate --world-size and the ranks deepspeed starts set it")
    else:
        world = world_size
        if world < 1:
            raise ConfigError("--world-size", f"expected an int >= 1, got {world}")
    dp = world // (tp * pp * cp)
    if dp <= 0:
        raise ConfigError("parallelism.tensor_parallel", f"tensor_parallel {tp} x pipeline_parallel {pp} x "
                          f"context_parallel {cp} must be <= the world size {world} (MindFormers refuses it)")
    if dp * tp * pp * cp != world:
        raise ConfigError("--world-size", f"{world} is not a multiple of tensor_parallel x pipeline_parallel x "
                          f"context_parallel = {tp * pp * cp} (MindFormers' ParallelDims: \"Invalid parallel dims\")")
    replicate = 1 if shard < 0 else max(dp // shard, 1)
    dp_shard = dp // replicate
    if dp_shard * replicate != dp:
        raise ConfigError("parallelism.data_parallel_shard", f"{shard} does not divide the data-parallel degree {dp} "
                          "(MindFormers' ParallelDims: \"Invalid parallel dims\")")
    if (dp_shard * cp * tp) % ep:
        raise ConfigError("parallelism.expert_parallel", f"{ep} must divide dp_shard {dp_shard} x cp {cp} x tp {tp} "
                          f"= {dp_shard * cp * tp} (MindFormers' ParallelDims refuses it)")
    if version == "2.0.0":
        if dp * local > global_:
            raise ConfigError("training.global_batch_size", f"{global_} is smaller than data_parallel {dp} x "
                              f"local_batch_size {local} (MindFormers 2.0.0: \"The product of data_parallel and "
                              "local_batch_size exceeds global_batch_size\")", *global_fit(global_, dp * local))
        ga = global_ // (dp * local)  # 2.0.0 floors: the run takes ga x dp x local samples a step
    else:
        if global_ % (dp * local):
            raise ConfigError("training.global_batch_size", f"{global_} must be divisible by data_parallel {dp} x "
                              f"local_batch_size {local} (MindFormers refuses it)", *global_fit(global_, dp * local))
        ga = global_ // (dp * local)
    return Degrees(world, dp, dp_shard, replicate, tp, cp, pp, ep, ga, ga * dp * local)


def recompute_layers(cfg: dict, total_layers: int) -> set[int]:
    """The fully recomputed layer ids: activation_checkpoint.py `_validate_recompute_config` over num_layers + MTP
    layers, then its ranges ('0-42', '5') expanded."""
    rc, comm = cfg["recompute"], cfg["recompute_comm"]
    full: set[int] = set()
    if rc["mode"] != "None":
        select = rc["select_module"]
        if select is not None and not isinstance(select, dict):
            raise ConfigError("recompute.select_module", f"must be a mapping of module path -> layer ranges, got "
                              f"{show(select)} (MindFormers refuses it)")
        for key, ranges in (select or {}).items():
            if not isinstance(ranges, (list, tuple)):
                raise ConfigError(join("recompute.select_module", key), "must be a list of layer ranges "
                                  "(MindFormers refuses it)")
        if rc["mode"] == "full" and not rc["full_recompute_layer"]:
            raise ConfigError("recompute.full_recompute_layer", "mode is 'full' but full_recompute_layer is missing "
                              "or empty (MindFormers refuses it)")
        if rc["mode"] == "select" and not select:
            raise ConfigError("recompute.select_module", "mode is 'select' but select_module is missing or empty "
                              "(MindFormers refuses it)")
        if rc["full_recompute_layer"]:
            full = _ranges(rc["full_recompute_layer"], "recompute.full_recompute_layer", total_layers)
        elif rc["mode"] == "select":
            for key, ranges in select.items():
                _ranges(ranges, join("recompute.select_module", key), total_layers)
    if comm["enable"]:
        select = comm["select_module"]
        if not isinstance(select, dict) or not select:
            raise ConfigError("recompute_comm.select_module", "enable is True but select_module is missing, empty "
                              "or not a mapping (MindFormers refuses it)")
        for key, ranges in select.items():
            _ranges(ranges, join("recompute_comm.select_module", key), total_layers)
    return full


def select_modules(cfg: dict, total_layers: int, full: set[int], style: str,
                   ledger: Ledger) -> dict[int, tuple[str, ...]]:
    """mode: select -> {layer id: HF module paths recomputed}: each select_module key is a regular expression over
    the layer's module paths (activation_checkpoint.py `_expand_select_module`), mapped to the HF layer's modules
    through the mcore names (translators/recompute_ops.py); layers recomputed whole take no select list, as in
    `_clean_and_parse_config`. MindFormers checks the select ranges only when full_recompute_layer is empty; with it,
    ids past the model are skipped."""
    rc = cfg["recompute"]
    if rc["mode"] != "select":
        return {}
    found: dict[int, set[str]] = {}
    for key, ranges in rc["select_module"].items():
        path = join("recompute.select_module", key)
        ids = _ranges(ranges, path, total_layers, strict=not rc["full_recompute_layer"])
        paths, note = recompute_ops.module_targets(str(key), style)
        if note:
            ledger.differs(path, note)
            continue
        for i in sorted(ids - full):
            found.setdefault(i, set()).update(paths)
        where = spans(ids - full) if ids - full else "none (recomputed whole)" if ids else \
            "none (its ids lie past the model: skipped, as MindFormers skips them)"
        ledger.runtime(path, f"layers {where}: {', '.join(paths)} recomputed one by one (plan.layers)")
    return {i: tuple(sorted(p for p in paths if not any(p.startswith(q + ".") for q in paths)))
            for i, paths in found.items()}


def _ranges(specs: Any, path: str, total: int, strict: bool = True) -> set[int]:
    """activation_checkpoint.py `_validate_layer_specs`: 'lo-hi' or 'n', ascending, within the layers. Not `strict`:
    `_parse_layer_ids` alone (a spec it cannot read still stops MindFormers; ids past the model are skipped)."""
    if not isinstance(specs, (list, tuple)):
        specs = [specs]
    layers: set[int] = set()
    previous = -1
    for i, spec in enumerate(specs):
        match = _LAYER_SPEC.match(str(spec).strip())
        if not match:
            raise ConfigError(join(path, i), f"invalid layer spec {spec!r}: expected a layer id or 'start-end' "
                              "(MindFormers refuses it)")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if not strict:
            layers.update(range(low, min(high, total - 1) + 1))
            continue
        if low > high:
            raise ConfigError(join(path, i), f"range start must be <= end, got {spec!r} (MindFormers refuses it)")
        if high >= total:
            raise ConfigError(join(path, i), f"layer id {high} out of range [0, {total - 1}] (num_layers plus the "
                              f"MTP layers), got {spec!r} (MindFormers refuses it)")
        if low <= previous:
            raise ConfigError(join(path, i), f"layer specs must be strictly ascending: {spec!r} starts at {low}, "
                              f"the previous one ends at {previous} (MindFormers refuses it)")
        previous = high
        layers.update(range(low, high + 1))
    return layers


def check_context_parallel(p: dict, model: dict, version: str) -> None:
    """What MindFormers checks when cp > 1: context_parallel.py `_validate_cp_method`, the mask type, and
    `apply_context_parallel_model_io`'s rule that context parallelism needs the model's compressed attention mask
    (2.1.0: unless its attention is DSA). `model`: the model config MindFormers builds."""
    cp, method, ulysses = p["context_parallel"], (p["context_parallel_method"] or "colossal").lower(), \
        p["ulysses_degree_in_cp"]
    if cp <= 1:
        return
    if method not in ("colossal", "ulysses", "hybrid"):
        raise ConfigError("parallelism.context_parallel_method", f"expected 'colossal', 'ulysses' or 'hybrid', got "
                          f"{show(p['context_parallel_method'])} (MindFormers: NotImplementedError: Unsupported "
                          "context_parallel_method)")
    if method == "ulysses" and ulysses is not None and ulysses != cp:
        raise ConfigError("parallelism.ulysses_degree_in_cp", f"Ulysses CP requires ulysses_degree_in_cp == "
                          f"context_parallel {cp}, got {ulysses} (MindFormers refuses it)")
    if method == "hybrid" and (ulysses is None or not 1 < ulysses < cp or cp % ulysses):
        raise ConfigError("parallelism.ulysses_degree_in_cp", f"hybrid CP requires 1 < ulysses_degree_in_cp < "
                          f"context_parallel {cp} dividing it, got {show(ulysses)} (MindFormers refuses it)")
    if (p["context_parallel_mask_type"] or "causal").lower() != "causal":
        raise ConfigError("parallelism.context_parallel_mask_type", f"context parallel supports only the causal mask, "
                          f"got {show(p['context_parallel_mask_type'])} (MindFormers: NotImplementedError)")
    dsa = version != "2.0.0" and model.get("experimental_attention_variant") == "dsa"
    if not (model.get("use_attn_mask_compression") or model.get("use_eod_attn_mask_compression") or dsa):
        raise ConfigError("parallelism.context_parallel", f"{cp} needs the model's compressed attention mask: "
                          "MindFormers stops with \"Context parallel (context_parallel > 1) requires a compressed "
                          "attention mask. Please enable use_attn_mask_compression for non-eod data, or "
                          "create_compressed_eod_mask for eod data.\"")


def spans(layers: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2, 5'."""
    out, ordered = [], sorted(layers)
    start = prev = ordered[0]
    for i in ordered[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
