"""mf_ds/muon.py against MindFormers 2.1.0's Muon transcribed into numpy (tests/mf_ds/muon_reference.py): golden
steps on an MLA-shaped parameter set (per-head split q_b / kv_b / kv_a, stacked experts, AdamW part), segmented and
flat coefficient schedules, adamw_include, torch.optim.Muon where it computes the same, exact resume."""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mf_ds.muon import Muon, build_muon, merge, mindformers_name, schedule_of, split, split_rule, uses_muon
from tests.mf_ds import muon_reference as ref
from translators.plan_types import MuonOptimizer, from_json

# a tiny MLA layer as transformers' DeepseekV3 names it
CONFIG = SimpleNamespace(num_attention_heads=2, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                         kv_lora_rank=6, q_lora_rank=6, hidden_size=12)
E, I_ = 3, 5
SHAPES = {
    "model.embed_tokens.weight": (20, 12),
    "model.layers.0.self_attn.q_a_proj.weight": (6, 12),
    "model.layers.0.self_attn.q_b_proj.weight": (2 * (4 + 2), 6),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (6 + 2, 12),
    "model.layers.0.self_attn.kv_b_proj.weight": (2 * (4 + 4), 6),
    "model.layers.0.self_attn.o_proj.weight": (12, 8),
    "model.layers.0.mlp.experts.gate_up_proj": (E, 2 * I_, 12),
    "model.layers.0.mlp.experts.down_proj": (E, 12, I_),
    "model.layers.0.input_layernorm.weight": (12,),
    "lm_head.weight": (20, 12),
}
# each HF parameter as MindFormers holds it (orientation) and the split kind its schema gives it (G make_model_muon_fns)
REFERENCE = {
    "model.layers.0.self_attn.q_b_proj.weight": ("periodic", (4, 2, 2), None),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("periodic", (6, 2, 1), None),
    "model.layers.0.self_attn.kv_b_proj.weight": ("periodic", (4, 4, 2), None),
    "model.layers.0.mlp.experts.gate_up_proj": ("reshape_concat", (E, 12, 2 * I_), (0, 2, 1)),  # weight1 [E, H, 2I]
    "model.layers.0.mlp.experts.down_proj": ("whole", None, (0, 2, 1)),  # weight2 [E, I, H]
}
SEGMENTED = [[[3.4445, -4.7750, 2.0315], 3], [[2.0, -1.5, 0.5], 2]]


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.config = CONFIG
        gen = torch.Generator().manual_seed(seed)
        self.names = list(SHAPES)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5)
                                             for s in SHAPES.values())

    def named_parameters(self, *args, **kwargs):
        return iter(zip(self.names, self.params, strict=True))


def typed(s: dict) -> MuonOptimizer:
    """The Plan's run.optimizer for these settings (what translators/muon.py writes)."""
    return from_json(MuonOptimizer, {"type": "Muon", **s}, "run.optimizer", partial=True)


def spec(**over) -> dict:
    base = {"lr": 0.02, "weight_decay": 0.1, "matched_adamw_rms": 0.2, "momentum": 0.95, "nesterov": True,
            "ns_schedule": schedule_of(SEGMENTED, 5), "eps": 1e-7, "adamw_betas": [0.9, 0.95], "adamw_eps": 1e-8,
            "adamw_include": ["*word_embeddings*", "*output_layer*"]}
    return base | over


def grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def reference_run(model: Tiny, s: dict, steps: int, graph: bool = False) -> dict[str, np.ndarray]:
    """The transcription (PyNative, or `graph` mode's), each HF parameter turned into MindFormers' orientation and
    back."""
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    state: dict[str, dict] = {n: {} for n in params}
    for t in range(1, steps + 1):
        for name, g in grads(t).items():
            g = g.numpy()
            if uses_muon(name, torch.empty(SHAPES[name]), tuple(s["adamw_include"])):
                kind, parts, perm = REFERENCE.get(name, ("whole", None, None))
                w, gm = (params[name], g) if perm is None else (params[name].transpose(perm), g.transpose(perm))
                m = state[name].get("m", np.zeros_like(gm))
                if graph:
                    w, m = ref.graph_apply_muon_update(gm, m, s["momentum"], s["nesterov"], w, s["lr"],
                                                       s["weight_decay"], s["matched_adamw_rms"], kind, parts)
                else:
                    w, m = ref.apply_muon_update(gm, m, s["momentum"], s["nesterov"], w, s["lr"], s["weight_decay"],
                                                 s["matched_adamw_rms"], kind, parts, s["eps"],
                                                 len(s["ns_schedule"]), s["ns_schedule"])
                params[name] = w if perm is None else w.transpose(perm)
                state[name]["m"] = m
            else:
                wd = s["weight_decay"] if g.ndim > 1 else 0.0
                st = state[name]
                params[name], st["m"], st["v"] = ref.run_adamw(*s["adamw_betas"], s["adamw_eps"], s["lr"], wd,
                                                               params[name], g, st.get("m", np.zeros_like(g)),
                                                               st.get("v", np.zeros_like(g)), t)
    return params


def ours_run(model: Tiny, s: dict, steps: int, optimizer: Muon | None = None, first: int = 1) -> Muon:
    optimizer = optimizer or build_muon(model, typed(s))
    for t in range(first, first + steps):
        for (_, p), g in zip(model.named_parameters(), grads(t).values(), strict=True):
            p.grad = g.clone()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("schedule", ["segmented", "flat", "no_nesterov"])
def test_golden_steps(schedule):
    """Three steps of every kind of parameter equal the transcription. Measured here: the Muon weights bit for bit
    (torch's CPU bf16 matmul rounds as numpy's fp32 product rounded to bf16), the AdamW ones within 2e-6 of their
    step; the bound leaves room for another BLAS's summation order. Orthogonalizing the fused MLA / expert weights
    whole instead of per piece misses by a third of the step."""
    s = spec() if schedule == "segmented" else spec(ns_schedule=schedule_of([3.4445, -4.7750, 2.0315], 5)) \
        if schedule == "flat" else spec(nesterov=False)
    model = Tiny()
    want = reference_run(Tiny(), s, 3)
    ours_run(model, s, 3)
    start = {n: p.detach() for n, p in Tiny().named_parameters()}
    for name, p in model.named_parameters():
        got = p.detach().numpy()
        if uses_muon(name, p, tuple(s["adamw_include"])):
            moved = np.abs(want[name] - start[name].numpy()).max()
            assert moved > 1e-3, name  # the step did something
            np.testing.assert_allclose(got, want[name], atol=1e-3 * moved, rtol=0, err_msg=name)
        else:
            np.testing.assert_allclose(got, want[name], atol=1e-6, rtol=1e-6, err_msg=name)


def test_graph_mode_steps():
    """Graph-mode Muon (core/optim/muon.py; `mode: graph`) against the transcription of the graph-mode source,
    three steps: the Muon weights measured bit for bit here (the bound leaves room for another BLAS's summation
    order), the AdamW ones as PyNative's. The PyNative update on the same
    inputs misses by up to 5% of the step (its Newton-Schulz normalizes in fp32 and fuses the bf16 ops), and on the
    split q_b weight by more (each piece its own lr scale: sqrt(8) for the nope rows where graph mode takes the last
    piece's sqrt(6))."""
    s = spec(ns_schedule=schedule_of([3.4445, -4.7750, 2.0315], 5), mode="graph")
    want = reference_run(Tiny(), s, 3, graph=True)
    model, pynative = Tiny(), Tiny()
    ours_run(model, s, 3)
    ours_run(pynative, spec(ns_schedule=s["ns_schedule"]), 3)
    start = {n: p.detach().numpy() for n, p in Tiny().named_parameters()}
    for (name, p), (_, q) in zip(model.named_parameters(), pynative.named_parameters(), strict=True):
        got = p.detach().numpy()
        if not uses_muon(name, p, tuple(s["adamw_include"])):
            np.testing.assert_allclose(got, want[name], atol=1e-6, rtol=1e-6, err_msg=name)
            continue
        moved = np.abs(want[name] - start[name]).max()
        assert moved > 1e-3, name
        np.testing.assert_allclose(got, want[name], atol=1e-3 * moved, rtol=0, err_msg=name)
        off = np.abs(q.detach().numpy() - want[name]).max() / moved
        assert off > (0.07 if name.endswith("q_b_proj.weight") else 0.005), (name, off)


def test_parameter_split_and_include():
    """2-D / 3-D weights take Muon except MindFormers' word_embeddings / output_layer; adamw_include globs match the
    MindFormers names; the per-head split puts each head's rows back where they were."""
    model = Tiny()
    groups = {g["name"]: g for g in build_muon(model, typed(spec())).param_groups}
    muon_names = [n for n, p in model.named_parameters() if any(p is q for q in groups["muon"]["params"])]
    assert muon_names == [n for n in SHAPES if len(SHAPES[n]) > 1 and n not in ("model.embed_tokens.weight",
                                                                                 "lm_head.weight")]
    assert (mindformers_name("model.layers.0.self_attn.o_proj.weight")
            == "decoder.layers.0.self_attention.linear_proj.weight")
    narrowed = build_muon(Tiny(), typed(spec(adamw_include=["*word_embeddings*", "*output_layer*",
                                                              "*linear_proj*"])))
    assert len([g for g in narrowed.param_groups if g["muon"]][0]["params"]) == len(muon_names) - 1
    x = torch.arange(12 * 8.0).reshape(12, 8)
    rule = split_rule("model.layers.0.self_attn.q_b_proj.weight", CONFIG)
    nope, rope = split(x, rule)
    assert torch.equal(nope[:4], x[:4]) and torch.equal(rope[:2], x[4:6]) and torch.equal(nope[4:], x[6:10])
    assert torch.equal(merge([nope, rope], rule), x)
    ours = [t.numpy() for t in split(x, rule)]
    theirs = ref.split_fn("periodic", x.numpy(), (4, 2, 2))
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_schedules():
    assert schedule_of([1, 2, 3], 4) == ((1.0, 2.0, 3.0),) * 4
    assert schedule_of(SEGMENTED, 99) == ref.normalize_ns_schedule(SEGMENTED, 99)[0]
    assert len(schedule_of([[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]], 5)) == 10  # DeepSeek-V4's


def test_torch_muon_agrees_on_a_plain_matrix():
    """On a 2-D weight MindFormers does not split, with one triple and matched_adamw_rms 0.2, torch.optim.Muon
    (adjust_lr_fn match_rms_adamw) gives the same step to bf16 rounding (it normalizes in bf16); its momentum is an
    EMA, MindFormers' m scaled by 1 - momentum, so the two states are not interchangeable."""
    w0 = torch.randn(12, 8, generator=torch.Generator().manual_seed(3))
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = Muon([{"params": [a], "muon": True, "rules": [("whole",)]}], lr=0.02, weight_decay=0.1,
                schedule=schedule_of([3.4445, -4.7750, 2.0315], 5))
    theirs = torch.optim.Muon([b], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                              adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        g = torch.randn(12, 8, generator=torch.Generator().manual_seed(10 + step))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    moved = (a.detach() - w0).abs().max()
    # 2% of the step: both run Newton-Schulz in bf16 (8-bit mantissa, ~4e-3 per rounding, over 5 iterations), torch
    # normalising in bf16 where MindFormers normalises in fp32; any other difference in the update is far larger
    torch.testing.assert_close(a.detach(), b.detach(), atol=2e-2 * moved, rtol=0)
    assert not torch.allclose(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"])
    torch.testing.assert_close(theirs.state[b]["momentum_buffer"], ours.state[a]["momentum_buffer"] * (1 - 0.95))


def test_resume_is_exact():
    """Two steps, the optimizer state saved and loaded into a fresh optimizer over a copy of the model, two more:
    bit for bit the four-step run (the state: Muon momentum, AdamW moments and step counts)."""
    straight = Tiny()
    ours_run(straight, spec(), 4)
    first = Tiny()
    opt = ours_run(first, spec(), 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed = copy.deepcopy(first)
    fresh = build_muon(resumed, typed(spec()))
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    ours_run(resumed, spec(), 2, optimizer=fresh, first=3)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def tiny_deepseek():
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8,
                              kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              n_group=1, topk_group=1, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def engine_run(steps_before: int, steps_after: int, root: str, resume: bool, qk_clip_threshold: float) -> dict:
    """The DeepSpeed engine (ZeRO 0) with MindFormers' Muon and QK-clip on a tiny DeepSeek-V3 (MLA, experts):
    losses, the weights after and the smallest QK-clip factor applied; `resume` loads the checkpoint saved after
    `steps_before` steps first."""
    from pathlib import Path

    import deepspeed

    from mf_ds.checkpoint import native
    from mf_ds.optim import build_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_deepseek()
    optimizer = build_optimizer(model, typed(spec(lr=0.01, adamw_betas=[0.9, 0.95],
                                                  qk_clip_threshold=qk_clip_threshold)))
    assert isinstance(optimizer, Muon) and any(g["muon"] for g in optimizer.param_groups)
    gammas = []
    scales = optimizer.qk_clip.scales
    optimizer.qk_clip.scales = lambda: (lambda g: gammas.append(float(g.min())) or g)(scales())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    if resume:
        native.load(engine, native.latest(Path(root)))
    for step in range(steps_after if resume else steps_before + steps_after):
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if not resume and step + 1 == steps_before:
            native.save(engine, Path(root), "muon", steps_before, {}, keep=1)
    return {"losses": losses, "weights": {n: p.detach().tolist() for n, p in engine.module.named_parameters()},
            "min_gamma": min(gammas)}


@pytest.mark.deepspeed
def test_deepspeed_engine_trains_and_resumes_exactly(tmp_path):
    """Under the DeepSpeed engine at ZeRO stage 0, with QK-clip at a threshold the tiny model's logits cross (~0.01 at
    its init): the loss falls over 6 steps, heads are clipped, and a run killed after 3 and resumed from its
    checkpoint (Muon momentum, AdamW moments and steps in the engine state; the max-logit statistic is zero at a step
    boundary) ends on the same weights."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port

    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}
    script = ("import json, sys; from tests.mf_ds.test_muon import engine_run; "
              f"print(json.dumps([engine_run(3, 3, {str(tmp_path)!r}, False, 0.01), "
              f"engine_run(3, 3, {str(tmp_path)!r}, True, 0.01)]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    straight, resumed = json.loads(done.stdout.strip().splitlines()[-1])
    assert straight["losses"][-1] < 0.8 * straight["losses"][0], straight["losses"]
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["weights"] == straight["weights"]
    assert straight["min_gamma"] < 0.9 and resumed["min_gamma"] < 0.9


# ---- DeepSeek-V4: transformers' DeepseekV4ForCausalLM against MindFormers' names, layout and schema
V4_YAML = "tests/fixtures/pynative/tiny_deepseek4_flash.yaml"
V4_PARAMS = "tests/fixtures/deepseek4/params.tiny.json"  # PyNativeDeepseekV4ForCausalLM's parameters, built on CPU
V4_KIND = {None: ("whole",), "reshape_only": ("whole",), "reshape_concat": ("halves",),
           "periodic": ("whole",)}  # periodic: the shared fc1's gate / up rows, which HF holds as two weights


@pytest.fixture(scope="module")
def v4():
    from mf_ds.model import build_model
    from tests.conftest import ROOT
    from translators.plan import translate_file

    plan = translate_file(str(ROOT / V4_YAML), world_size=1).plan
    c = build_model(plan).config
    schema = ref.model_muon_schema(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.head_dim,
                                   c.qk_rope_head_dim, c.num_attention_heads, None, c.head_dim, c.q_lora_rank)
    return plan, schema


def v4_counterparts(name: str) -> list[str]:
    """The MindFormers parameters an HF DeepSeek-V4 parameter holds (mHC `scale` [3]: alpha_pre / post / res)."""
    mf = mindformers_name(name, "deepseek_v4", 4)  # 4 decoder layers: model.layers.4 is the MTP block
    if mf.endswith(("attn_hc.scale", "ffn_hc.scale")):
        return [mf.replace(".scale", f".alpha_{part}") for part in ("pre", "post", "res")]
    return [mf]


def test_deepseek_v4_split_is_mindformers(v4):
    """Every trainable parameter of the tiny DeepSeek-V4 takes Muon or AdamW as its MindFormers counterpart does
    (P _build_muon_filter on the name PyNativeDeepseekV4ForCausalLM gives it, its shape there), and is cut as G's
    schema cuts that counterpart; every trainable 2-D / 3-D MindFormers weight, the MTP layer's among them, has an
    HF-side counterpart. build_muon on this model used to stop on V3's per-head rule (AttributeError:
    no qk_nope_head_dim)."""
    import json

    from mf_ds.model import build_model
    from tests.conftest import ROOT

    plan, schema = v4
    model = build_model(plan)
    mf = json.loads((ROOT / V4_PARAMS).read_text())["params"]
    optimizer = build_muon(model, plan.run.optimizer)
    on_muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    seen, kinds = set(), set()
    for name, p in model.named_parameters():
        for counterpart in v4_counterparts(name):
            shape, trainable, _ = mf[counterpart]
            assert trainable, counterpart
            seen.add(counterpart)
            assert (id(p) in on_muon) == ref.muon_filter(counterpart, shape), (name, counterpart)
            rule = ref.match_rule(counterpart, schema)
            assert split_rule(name, model.config) == V4_KIND[rule["kind"]], (name, rule)
            assert rule["kind"] != "periodic" or (".shared_experts.linear_fc1." in counterpart
                                                  and rule["parts"] == (1, 1))
            assert len(shape) != 3 or ref.is_expert_muon_weight(counterpart)  # MindFormers' 3-D refusal
            kinds.add(rule["kind"])
    assert kinds == {None, "reshape_concat", "reshape_only", "periodic"}
    wanted = {n for n, (shape, trainable, _) in mf.items() if trainable and len(shape) in (2, 3)}
    assert any(n.startswith("model.mtp.") for n in wanted)  # the MTP layer's too (mf_ds/mtp_v4.py builds it)
    assert wanted <= seen, sorted(wanted - seen)


def test_deepseek_v4_steps_equal_the_transcription(v4):
    """Two steps of MindFormers' Muon (the Flash YAML's 8 + 2 segmented schedule, its betas) on the tiny DeepSeek-V4
    equal the transcription run on MindFormers' layout: experts.weight1 [E, H, 2I] (reshape_concat), weight2
    [E, I, H] (reshape_only), the shared fc1 [2I, H] with gate / up rows interleaved (periodic 1, 1), the rest as HF
    holds them; each kind chosen by the transcribed schema, not by mf_ds. The AdamW part within 1e-6; the Muon
    weights within 2% of their step (measured: up to 0.8% on the widest, hc fn [24, 128]; bit for bit on the
    narrow ones): torch's fp32 Frobenius norm is one ulp off the correctly rounded one numpy gives here, which
    flips a few bf16 roundings that 10 Newton-Schulz steps carry (MindSpore's fp32 reduction order is its own)."""
    import dataclasses

    from mf_ds.model import build_model

    plan, schema = v4
    spec_ = dataclasses.replace(plan.run.optimizer, lr=0.02)
    model = build_model(plan)
    named = dict(model.named_parameters())
    start = {n: p.detach().numpy().copy() for n, p in named.items()}
    gen = torch.Generator().manual_seed(5)
    steps = [{n: torch.randn(p.shape, generator=gen) for n, p in named.items()} for _ in range(2)]
    optimizer = build_muon(model, spec_)
    on_muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    for g in steps:
        for n, p in named.items():
            p.grad = g[n].clone()
        optimizer.step()

    def to_mf(name: str, x: np.ndarray) -> np.ndarray:  # HF layout -> MindFormers' (mf_ds/weights.py's conversions)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return x.transpose(0, 2, 1)
        return x

    s = spec_
    params = {n: to_mf(n, x) for n, x in start.items()}
    fused = {}  # shared experts: MindFormers' linear_fc1 rows gate_0, up_0, gate_1, ...
    for n in list(params):
        if n.endswith("shared_experts.gate_proj.weight"):
            up = n.replace("gate_proj", "up_proj")
            fused[n] = np.stack([params.pop(n), params.pop(up)], axis=1).reshape(-1, start[n].shape[1])
    params.update(fused)
    state: dict[str, dict] = {n: {} for n in params}
    for t, g in enumerate(steps, start=1):
        grad = {n: to_mf(n, x.numpy()) for n, x in g.items()}
        for n in fused:
            up = n.replace("gate_proj", "up_proj")
            grad[n] = np.stack([grad.pop(n), grad.pop(up)], axis=1).reshape(-1, start[n].shape[1])
        for n, w in params.items():
            counterpart = v4_counterparts(n)[0]
            if id(named[n]) in on_muon:
                rule = ref.match_rule(counterpart, schema)
                parts = rule.get("parts") or rule.get("reshape")
                m = state[n].get("m", np.zeros_like(w))
                params[n], state[n]["m"] = ref.apply_muon_update(
                    grad[n], m, s.momentum, s.nesterov, w, s.lr, s.weight_decay, s.matched_adamw_rms, rule["kind"],
                    parts, s.eps, len(s.ns_schedule), s.ns_schedule)
            else:
                st = state[n]
                wd = s.weight_decay if w.ndim > 1 else 0.0
                params[n], st["m"], st["v"] = ref.run_adamw(*s.adamw_betas, s.adamw_eps, s.lr, wd, w, grad[n],
                                                            st.get("m", np.zeros_like(w)),
                                                            st.get("v", np.zeros_like(w)), t)
    for n in fused:
        up = n.replace("gate_proj", "up_proj")
        params[n], params[up] = params[n][0::2], params[n][1::2]
    for n, p in named.items():
        want = to_mf(n, params[n])  # the transpose is its own inverse
        moved = np.abs(want - start[n]).max()
        assert moved > 1e-3, n
        tol = 2e-2 * moved if id(p) in on_muon else 1e-6
        np.testing.assert_allclose(p.detach().numpy(), want, atol=tol, rtol=0 if id(p) in on_muon else 1e-6,
                                   err_msg=n)
