"""The MindFormers 2.x PyNative schema (translators/pynative.py) against MindFormers' own config code.

Golden files: tests/fixtures/pynative_golden/<version>.json, written by tests/fixtures/make_pynative_golden.py in
MindFormers 2.0.0 and 2.1.0: `TrainConfig.from_dict(tree).to_dict()` for every PyNative YAML of the wheels and for
mutations of the DeepSeek-V3 one, then what the PyNative Trainer derives at a world size (data parallel, gradient
accumulation, ParallelDims, recompute ranges, context-parallel method), or MindFormers' refusal.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.conftest import ROOT
from translators.cli import run
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate
from translators.pynative import is_pynative
from translators.pynative_schema import VERSIONS, effective

GOLDEN = {v: json.loads((ROOT / "tests" / "fixtures" / "pynative_golden" / f"{v}.json").read_text())
          for v in ("2.0.0", "2.1.0")}
WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels"
DS3 = "deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml"
DELETE = "<delete>"

# The key mf-translate names when it refuses a mutation MindFormers refuses (a prefix of the error's path).
REFUSED_KEY = {
    "gbs0": "training.global_batch_size", "lbs0": "training.local_batch_size", "gbs12": "training.global_batch_size",
    "no_training": "training.global_batch_size", "world16": "training.global_batch_size",
    "steps_str": "training.steps", "steps_float": "training.steps", "max_norm_str": "training.max_norm",
    "deterministic_int": "training.deterministic", "unknown_training_key": "training.stepz",
    "unknown_parallelism_key": "parallelism.data_parallel", "tp_bool": "parallelism.tensor_parallel",
    "betas_str": "optimizer.betas", "training_none": "training", "tp2_no_sp": "parallelism.sequence_parallel",
    "cp2_ulysses_degree1": "parallelism.ulysses_degree_in_cp", "cp2_ring": "parallelism.context_parallel_method",
    "cp4_hybrid_no_degree": "parallelism.ulysses_degree_in_cp", "cp2_ulysses": "parallelism.context_parallel",
    "cp2_colossal": "parallelism.context_parallel", "cp4_hybrid": "parallelism.context_parallel",
    "tp16": "parallelism.tensor_parallel",
    "ep3": "parallelism.expert_parallel", "deredundancy_ep1": "parallelism.moe_token_dispatcher_type",
    "recompute_full_out_of_range": "recompute.full_recompute_layer[0]",
    "recompute_full_reversed": "recompute.full_recompute_layer[0]",
    "recompute_full_unordered": "recompute.full_recompute_layer[1]",
    "recompute_full_bad_spec": "recompute.full_recompute_layer[0]",
    "recompute_full_empty": "recompute.full_recompute_layer", "recompute_bad_mode": "recompute.mode",
    "profiler_bad": "profiler.start_step", "rampup": "training.rampup_batch_size",
    "skip_on_nan": "training.use_skip_step_on_nan", "no_lr_scheduler": "lr_scheduler.type",
    "recompute_select_out_of_range": "recompute.select_module.self_attention[0]",
    "pp2": "parallelism.pipeline_parallel_layers_per_stage",
    "pp3_auto": "parallelism.pipeline_parallel_layers_per_stage",
    "pp2_explicit_short": "parallelism.pipeline_parallel_layers_per_stage",
    "pp2_explicit_reversed": "parallelism.pipeline_parallel_layers_per_stage[0]",
}
# Mutations MindFormers accepts and mf-ds refuses (what it cannot run), with the key it names.
MF_DS_REFUSES = {"rampup": "training.rampup_batch_size"}


def mutated(version: str, name: str) -> tuple[dict, int]:
    case = GOLDEN[version]["mutations"][name]
    tree = load_yaml(str(WHEELS / version / case["base"]))
    for dotted, value in case["set"]:
        node = tree
        keys = dotted.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value == DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = copy.deepcopy(value)
    return tree, case["world_size"]


def spans(specs: list[str]) -> set[int]:
    out = set()
    for spec in specs:
        low, _, high = spec.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def check_plan(plan, golden: dict, tree: dict) -> None:
    """The Plan against MindFormers' effective config and the Trainer's derived numbers."""
    eff, der = golden["effective"], golden["derived"]
    t, p = eff["training"], eff["parallelism"]
    run_ = plan.run
    assert run_.micro_batch_size == t["local_batch_size"]
    mf_global = der["gradient_accumulation_steps"] * der["data_parallel"] * t["local_batch_size"]
    assert run_.mindformers_global_batch_size == mf_global
    assert run_.global_batch_size == mf_global  # the global batch is kept on the ranks that run
    assert run_.gradient_accumulation_steps == mf_global // (t["local_batch_size"] * plan.parallel.data_parallel)
    if not plan.parallel.folded:  # every axis runs as written: the same data-parallel degree and accumulation
        assert plan.parallel.data_parallel == der["data_parallel"]
        assert run_.gradient_accumulation_steps == der["gradient_accumulation_steps"]
        assert plan.parallel.tensor_parallel == p["tensor_parallel"]
        assert plan.parallel.context_parallel == p["context_parallel"]
    assert plan.parallel.world_size == der["world_size"]
    assert plan.deepspeed["train_micro_batch_size_per_gpu"] == t["local_batch_size"]
    assert plan.deepspeed["gradient_accumulation_steps"] == run_.gradient_accumulation_steps
    assert run_.total_steps == t["steps"] and run_.stop_step == t["steps"]
    assert plan.deepspeed["gradient_clipping"] == (t["max_norm"] if t["max_norm"] > 0 else 0.0)
    lr = eff["lr_scheduler"]
    assert run_.lr_schedule["type"] == lr["type"]
    assert run_.lr_schedule["learning_rate"] == lr["learning_rate"]
    assert run_.lr_schedule["total_steps"] == t["steps"]  # _build_lr_scheduler passes training.steps
    from mf_ds.lr import schedule  # MindFormers' formulas (pure Python; tests/mf_ds/test_lr.py holds them to 1.7.0)
    from translators.lr import schedule_for

    rate = schedule(schedule_for(dict(run_.lr_schedule)))
    peak = max(der["lr"])
    assert [rate(step) for step in range(len(der["lr"]))] == pytest.approx(der["lr"], abs=1e-6 * peak)
    full = spans(der["full_recompute_layer"]) if eff["recompute"]["mode"] != "None" and \
        der["full_recompute_layer"] else set()
    assert {layer.index for layer in plan.layers if layer.full_recompute} == full
    model = tree["model"]
    assert len(plan.layers) == model["num_hidden_layers"] + model.get("num_nextn_predict_layers", 0)
    folded_ep = any(n.key == "parallelism.expert_parallel" and "folds into data parallel" in n.message
                    for n in plan.notes)  # DeepSeek-V4: HF's hash-routed blocks hold every expert
    if p["expert_parallel"] > 1 and "parallelism.expert_parallel" not in plan.parallel.folded and not folded_ep:
        assert plan.parallel.expert_parallel == p["expert_parallel"] == plan.moe.expert_parallel


@pytest.mark.parametrize("version", VERSIONS)
def test_every_wheel_yaml_has_mindformers_effective_config(version):
    """The schema's defaults and conversions are MindFormers' own, section by section."""
    for rel, golden in GOLDEN[version]["yamls"].items():
        tree = load_yaml(str(WHEELS / version / rel))
        assert is_pynative(tree)
        assert effective(tree, version) == golden["effective"], rel


@pytest.mark.parametrize("version", VERSIONS)
def test_wheel_yamls_translate_to_the_golden_numbers(version):
    """Every PyNative YAML of the wheel translates to MindFormers' numbers (DeepSeek-V4 Pro's narrower shared expert
    too: mf_ds/shared_expert.py). Flash's and Pro's Muon run under FSDP: ZeRO-3, without reduce_scatter
    (translators/muon.py)."""
    for rel, golden in GOLDEN[version]["yamls"].items():
        tree = load_yaml(str(WHEELS / version / rel))
        result = translate(tree, world_size=GOLDEN[version]["world_size"], mindformers_version=version)
        check_plan(result.plan, golden, tree)
        assert [n.line() for n in result.plan.notes if n.kind == "unknown"] == [], rel


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(GOLDEN["2.1.0"]["mutations"]))
def test_mutation_is_accepted_or_refused_as_mindformers_does(version, name, capsys, tmp_path):
    golden = GOLDEN[version]["mutations"][name]
    tree, world = mutated(version, name)
    if "error" in golden or name in MF_DS_REFUSES:
        with pytest.raises(ConfigError) as caught:
            translate(tree, world_size=world, mindformers_version=version)
        want = REFUSED_KEY[name] if "error" in golden else MF_DS_REFUSES[name]
        assert caught.value.path.startswith(want), (caught.value, golden.get("error"))
        # the CLI: one line naming the key, exit 2
        path = tmp_path / "x.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        code = run([str(path), "--world-size", str(world), "--mindformers-version", version])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"mf-translate: error: {want}"), err
        return
    result = translate(tree, world_size=world, mindformers_version=version)
    check_plan(result.plan, golden, tree)


def test_defaults_left_out_are_mindformers_defaults():
    """A YAML without optimizer / parallelism / checkpoint gets TrainConfig's defaults: AdamW betas 0.9/0.95, eps
    1e-8, weight decay 0.01; pure FSDP; no checkpoint saved? (enable_save defaults True: saved every 1000 steps)."""
    golden = GOLDEN["2.1.0"]["mutations"]
    tree, world = mutated("2.1.0", "no_optimizer")
    plan = translate(tree, world_size=world).plan
    opt = golden["no_optimizer"]["effective"]["optimizer"]
    assert plan.run.optimizer.betas == tuple(opt["betas"]) and plan.run.optimizer.eps == opt["eps"]
    assert plan.run.optimizer.weight_decay == opt["weight_decay"]
    tree, world = mutated("2.1.0", "no_checkpoint")
    ckpt = golden["no_checkpoint"]["effective"]["checkpoint"]
    saved = translate(tree, world_size=world).plan.run.callbacks.checkpoint
    assert ckpt["enable_save"] is True and saved is not None
    assert (saved.save_checkpoint_steps, saved.keep_checkpoint_max, saved.prefix) == \
        (ckpt["save_interleaved_steps"], ckpt["save_max"], ckpt["prefix"])
    tree, world = mutated("2.1.0", "no_max_norm")
    assert translate(tree, world_size=world).plan.deepspeed["gradient_clipping"] == \
        golden["no_max_norm"]["effective"]["training"]["max_norm"]


def test_gradient_accumulation_override():
    """--gradient_accumulation_steps (MindFormers' run-script override) wins; the global batch follows."""
    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    plan = translate(tree, world_size=8, gradient_accumulation_steps=4).plan
    assert plan.deepspeed["gradient_accumulation_steps"] == 4 and plan.run.global_batch_size == 32
    assert plan.run.mindformers_global_batch_size == 8
    with pytest.raises(ConfigError, match="^--gradient_accumulation_steps"):
        translate(tree, world_size=8, gradient_accumulation_steps=0)


def test_world_size_defaults_to_accumulation_one():
    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    plan = translate(tree).plan
    assert (plan.parallel.world_size, plan.run.gradient_accumulation_steps) == (8, 1)
    assert any("a PyNative YAML names none" in n.message for n in plan.notes if not n.key)


def test_data_parallel_shard_is_zero3_and_ep_takes_zero2():
    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    plan = translate(tree, world_size=8).plan
    assert plan.deepspeed["zero_optimization"]["stage"] == 3
    assert plan.notes_on("parallelism.reshard_after_forward_policy")
    tree["parallelism"]["expert_parallel"] = 8
    plan = translate(tree, world_size=8).plan
    assert plan.deepspeed["zero_optimization"]["stage"] == 2 and plan.moe.expert_parallel == 8
    tree["parallelism"].update(expert_parallel=1, data_parallel_shard=1)
    plan = translate(tree, world_size=8).plan
    assert plan.deepspeed["zero_optimization"]["stage"] == 1  # bf16: ZeRO-1 keeps the fp32 master weights
    tree["parallelism"].update(data_parallel_shard=-1, cpu_offload=True)
    zero = translate(tree, world_size=8).plan.deepspeed["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["offload_param"] == {"device": "cpu"}


def test_ulysses_maps_and_colossal_differs():
    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    tree["model"]["n_routed_experts"] = 1  # a dense model: MoE models fold context parallelism (translators/parallel)
    tree["model"]["first_k_dense_replace"] = 16
    tree["model"]["use_attn_mask_compression"] = True  # MindFormers' context parallelism needs it
    tree["parallelism"].update(context_parallel=2, context_parallel_method="ulysses")
    plan = translate(tree, world_size=8).plan
    assert plan.parallel.context_parallel == 2 and plan.deepspeed["sequence_parallel_size"] == 2
    assert [n.kind for n in plan.notes if n.key == "parallelism.context_parallel_method"] == ["mapped"]
    tree["parallelism"]["context_parallel_method"] = "colossal"
    plan = translate(tree, world_size=8).plan
    assert [n.kind for n in plan.notes if n.key == "parallelism.context_parallel_method"] == ["differs"]


PYNATIVE_WHEEL_YAMLS = sorted((str(p.relative_to(WHEELS)), version) for version in VERSIONS
                              for p in (WHEELS / version).rglob("*.yaml") if is_pynative(load_yaml(str(p))))


def test_the_wheels_pynative_yamls_are_all_here():
    """The issue's five PyNative YAMLs of the 2.1.0 wheel (and 2.0.0's one) are the ones the next test translates."""
    assert [rel for rel, version in PYNATIVE_WHEEL_YAMLS if version == "2.1.0"] == [
        "2.1.0/deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml", "2.1.0/deepseek4/pretrain_deepseek4_flash.yaml",
        "2.1.0/deepseek4/pretrain_deepseek4_flash_reduction.yaml", "2.1.0/deepseek4/pretrain_deepseek4_pro.yaml",
        "2.1.0/deepseek4/pretrain_deepseek4_pro_reduction.yaml"]


@pytest.mark.parametrize("rel, version", PYNATIVE_WHEEL_YAMLS)
def test_every_key_is_accounted(rel, version):
    """Every PyNative YAML of the wheels translates, and --explain gives every key a note that is not `unknown`."""
    result = translate(load_yaml(str(WHEELS / rel)), world_size=8, mindformers_version=version)
    assert not [n for n in result.plan.notes if n.kind == "unknown"]
    assert len(result.plan.notes) == len(set(result.plan.notes))  # each account once
    explained = {line.split(" = ", 1)[0] for line in result.ledger.explain() if " = " in line}
    assert set(result.ledger.values) <= explained


def test_graph_mode_tree_with_runner_config_is_not_pynative():
    assert not is_pynative({"training": {}, "runner_config": {}})
    assert is_pynative({"parallelism": {}})


TINY = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek3_pynative.yaml"
MUON = {"type": "Muon", "qk_clip_enabled": False,
        "ns_coefficients": [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]]}


def test_muon_goes_through_the_pynative_muon_path():
    """optimizer: Muon -> translators/muon.py with pynative=True: its segmented Newton-Schulz schedule, FSDP as ZeRO-3
    (DeepSpeed's ZeRO Muon with MindFormers' update, without reduce_scatter), and the eps / weight_decay MindFormers'
    _build_optimizer hands it from OptimizerConfig (1e-8, 0.01), not Muon's own."""
    tree = load_yaml(str(TINY))
    tree["optimizer"] = dict(MUON)
    plan = translate(tree, world_size=2).plan
    opt = plan.run.optimizer
    assert opt.type == "Muon" and len(opt.ns_schedule) == 10 and opt.ns_schedule[-1] == (2.0, -1.5, 0.5)
    assert (opt.eps, opt.weight_decay) == (1e-8, 0.01)
    assert plan.zero_stage == 3 and plan.deepspeed["zero_optimization"]["reduce_scatter"] is False
    assert [n.kind for n in plan.notes if n.key == "parallelism.data_parallel_shard"] == ["mapped"]
    bf16 = {**tree, "model": {**tree["model"], "compute_dtype": "bfloat16"}}
    assert translate(bf16, world_size=1).plan.zero_stage == 1  # bf16's fp32 masters: ZeRO-1, Muon included
    tree["optimizer"]["weight_decay"] = 0.1
    assert translate(tree, world_size=2).plan.run.optimizer.weight_decay == 0.1


@pytest.mark.parametrize("change, key", [
    # QK-clip (on by default) under ZeRO-1, which bf16 needs: translators/muon.py refuses it
    ({"optimizer": {"type": "Muon"}, "model": {"compute_dtype": "bfloat16"}}, "optimizer.qk_clip_enabled"),
    ({"optimizer": {"type": "Lion"}}, "optimizer.type"),
    ({"run_mode": "predict"}, "run_mode"),
    ({"training": {"rampup_batch_size": [1, 1, 10]}}, "training.rampup_batch_size"),
    ({"model": {"model_type": "deepseek_v9"}}, "model.model_type"),
    ({"training": {"steps": 0}}, "training.steps"),  # MindFormers would train nothing
])
def test_what_mf_ds_cannot_run_is_one_line(change, key):
    tree = load_yaml(str(TINY))
    for section, values in change.items():
        if isinstance(tree.get(section), dict) and section != "optimizer":
            tree[section].update(values)
        else:
            tree[section] = values
    with pytest.raises(ConfigError) as caught:
        translate(tree, world_size=1)
    assert caught.value.path == key, caught.value


def test_layout_and_memory_for_the_pynative_degrees(capsys):
    """mf-translate --layout: the PyNative YAML's degrees (tensor_parallel 2, expert_parallel 4 of 8 ranks) as the
    layout runs them, with what the YAML asked beside, and the memory per device."""
    from translators.planner import layout_report

    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    tree["parallelism"].update(tensor_parallel=2, expert_parallel=4, pipeline_parallel=2,
                               pipeline_parallel_layers_per_stage="auto")
    tree["training"]["global_batch_size"] = 16
    result = translate(tree, world_size=8)
    report = layout_report(result.plan, result.asked)
    assert report["degrees"] == {"data_parallel": 4, "tensor_parallel": 2, "context_parallel": 1,
                                 "expert_parallel": 4}
    # MindFormers: dp = 8 / (tp 2 x pp 2) = 2, accumulation 16 / (1 x 2) = 8; pp folds into data parallel here
    assert report["yaml"] == {"data_parallel": 2, "model_parallel": 2, "context_parallel": 1, "expert_parallel": 4,
                              "pipeline_stage": 2, "micro_batch_num": 8}
    assert report["data"]["global_batch"] == report["data"]["mindformers_global_batch"] == 16
    assert "parallelism.pipeline_parallel" in report["folded"]
    assert report["memory"]["zero_stage"] == 2 and report["memory"]["peak"] > 0  # EP: ZeRO-2
    path = WHEELS / "2.1.0" / DS3
    assert run([str(path), "--layout", "--world-size", "8", "--gpu-memory", "8GiB", "--json"]) == 0
    fixes = json.loads(capsys.readouterr().out)["memory"]["what_if"]
    settings = {s for fix in fixes for s in fix["set"]}  # what to change, in the PyNative schema's own keys
    assert "recompute={mode: full, full_recompute_layer: ['0-16']}" in settings
    assert not [s for s in settings if s.startswith(("recompute_config", "runner_config", "parallel_config"))]


def test_deepseek_v4_sections_are_accounted():
    """Every section of the DeepSeek-V4 Flash YAML but its model (which waits for the family record), on the shrunk
    DeepSeek-V3 model: no key unaccounted; lr_scheduler.total_steps -1 gives way to training.steps, as in
    MindFormers."""
    tree = load_yaml(str(TINY))
    flash = load_yaml(str(WHEELS / "2.1.0" / "deepseek4" / "pretrain_deepseek4_flash.yaml"))
    tree.update({k: v for k, v in flash.items() if k != "model"})
    tree["optimizer"]["qk_clip_enabled"] = False  # QK-clip: translators/muon.py
    tree["recompute"]["full_recompute_layer"] = ["0-3"]  # the shrunk model's 3 layers + MTP
    tree["train_dataset"]["dataloader"]["config"]["seq_length"] = 64
    plan = translate(tree, world_size=8).plan
    assert [n.line() for n in plan.notes if n.kind == "unknown"] == []
    assert plan.run.lr_schedule["total_steps"] == 300 == plan.run.stop_step
    assert plan.notes_on("lr_scheduler.total_steps") == ["MindFormers' PyNative trainer replaces it with "
                                                         "training.steps 300 (trainer/utils.py _build_lr_scheduler)"]
    assert plan.moe.expert_parallel == 8 and plan.run.optimizer.type == "Muon" and plan.zero_stage == 0
    assert all(layer.full_recompute for layer in plan.layers)


def test_select_recompute_maps_module_regexes_to_hf_modules():
    """select_module: regexes over the layer's module paths (MindFormers' _expand_select_module), through the mcore
    names to the HF layer's modules; layers recomputed whole take none; a regex that names nothing is a note."""
    tree = load_yaml(str(TINY))
    tree["recompute"] = {"mode": "select", "full_recompute_layer": ["0"],
                         "select_module": {"self_attention": ["0-3"], r"mlp\.shared_experts": ["1-2"],
                                           r"self_attention\.linear_qkv": ["5-9"], "no_such_module": ["1"]}}
    plan = translate(tree, world_size=1).plan
    assert [(layer.full_recompute, layer.select_recompute) for layer in plan.layers] == [
        (True, ()), (False, ("mlp.shared_experts", "self_attn")), (False, ("mlp.shared_experts", "self_attn")),
        (False, ("self_attn",))]  # ids 5-9 lie past the model: skipped, as MindFormers skips them
    assert [n.kind for n in plan.notes if n.key == "recompute.select_module.no_such_module"] == ["differs"]
    tree["recompute"] = {"mode": "select", "select_module": {"self_attention": ["0-9"]}}
    with pytest.raises(ConfigError, match=r"^recompute\.select_module\.self_attention\[0\]: layer id 9 out of"):
        translate(tree, world_size=1)  # without full_recompute_layer MindFormers checks the select ranges


def test_random_damage_is_one_line_never_a_traceback():
    """Random values at random keys of the DeepSeek-V3 PyNative YAML: translated, or refused with a ConfigError."""
    import random

    from translators.notes import leaves

    base = load_yaml(str(WHEELS / "2.1.0" / DS3))
    values = [None, True, False, 0, -1, 1, 2, 3, 8, 16, 1.5, -0.5, "", "x", "0-3", "ulysses", "hybrid", [], ["0-2"],
              [1, 2], {}, {"a": 1}, "None", "full", "select", 1e30, float("nan")]
    keys = list(leaves(base)) + ["training.rampup_batch_size", "recompute.mode", "recompute.full_recompute_layer",
                                 "recompute.select_module", "recompute_comm.enable", "parallelism.ulysses_degree_in_cp",
                                 "optimizer.type", "checkpoint.load_path", "swap.enable", "callbacks",
                                 "mf_ds.zero_stage", "output_dir", "mindformers_version", "run_mode", "training",
                                 "model", "parallelism"]
    rng = random.Random(0)
    for _ in range(300):
        tree = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            *parents, last = rng.choice(keys).split(".")
            node = tree
            for name in parents:
                node = node.setdefault(name, {}) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node[last] = copy.deepcopy(rng.choice(values))
        try:
            translate(tree, world_size=rng.choice([None, 1, 2, 8, 16]))
        except ConfigError:
            pass


@pytest.mark.parametrize("no_load_optim, load_path, resumes", [(True, "/ckpt", False), (False, "/ckpt", True),
                                                                (False, "", False)])
def test_no_load_optim_false_resumes_the_optimizer(no_load_optim, load_path, resumes):
    """checkpoint.no_load_optim false with a load_path: MindFormers resumes the optimizer state and step of the
    Checkpoint 2.0 it loads, so the Plan asks mf_ds/loop.py for the same (run.resume_training)."""
    tree = load_yaml(str(WHEELS / "2.1.0" / DS3))
    tree["checkpoint"].update(no_load_optim=no_load_optim, load_path=load_path)
    result = translate(tree, world_size=8)
    assert result.plan.run.resume_training is resumes
    assert result.plan.run.load_checkpoint == (load_path or None)


def test_muon_qk_clip_reaches_the_plan():
    """PyNative Muon's QK-clip (qk_clip_enabled, on by default) on the MLA model: run.optimizer.qk_clip_threshold,
    which mf_ds/muon.py applies after each update (mf_ds/qk_clip.py); qk_clip_enabled false leaves it unset."""
    tree = load_yaml(str(TINY))
    tree["optimizer"] = {"type": "Muon"}
    assert translate(tree, world_size=1).plan.run.optimizer.qk_clip_threshold == 100.0
    tree["optimizer"] = {"type": "Muon", "qk_clip_enabled": True, "qk_clip_threshold": 30}
    result = translate(tree, world_size=1)
    assert result.plan.run.optimizer.qk_clip_threshold == 30
    assert [n.kind for n in result.plan.notes if n.key == "optimizer.qk_clip_enabled"] == ["runtime"]
    tree["optimizer"] = {"type": "Muon", "qk_clip_enabled": False}
    assert translate(tree, world_size=1).plan.run.optimizer.qk_clip_threshold is None
