"""mf_ds.patch with plan.kernels fused_rope / fused_swiglu on tiny from_config models of every family: the same logits
and gradients as the unpatched model (fp32), a report naming each replaced function and module, state-dict keys
unchanged, `revert` restoring everything; the bytes a fused-SwiGLU MLP keeps for backward; the same checks with
every op forced onto its Triton kernel (Triton's interpreter on CPU), and with the compiled CPU SwiGLU backward, for
two models; ZeRO-3 training unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import weakref

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (dispatch.on_device copes either way)

import pytest  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from mf_ds import patch  # noqa: E402
from mf_ds.families.deepseek import rope_deepseek_v3_interleave  # noqa: E402
from mf_ds.families.llama import rope_split_half  # noqa: E402
from mf_ds.patch import PatchError, kernels  # noqa: E402
from mf_ds.patch.recompute import apply_recompute, revert_recompute  # noqa: E402
from tests.conftest import ROOT, free_port  # noqa: E402
from translators.plan_types import Kernels, Layer, Plan  # noqa: E402

B, S = 2, 5
H, FF, NH, KVH, D = 32, 48, 4, 2, 8  # hidden, MLP width, heads, key/value heads (GQA), head dim
TINY = dict(hidden_size=H, intermediate_size=FF, num_attention_heads=NH, num_key_value_heads=KVH, head_dim=D,
            vocab_size=64, num_hidden_layers=2, attn_implementation="eager")
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
           num_key_value_heads=NH)  # MLA: every head reads the shared latent
FAMILIES = {  # model type, config overrides, the dense SwiGLU MLPs (layer paths)
    "llama": ("llama", {}, ["model.layers.0.mlp", "model.layers.1.mlp"]),
    "qwen2": ("qwen2", {}, ["model.layers.0.mlp", "model.layers.1.mlp"]),
    "qwen3": ("qwen3", {}, ["model.layers.0.mlp", "model.layers.1.mlp"]),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), []),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24, mlp_only_layers=[0]),
                  ["model.layers.0.mlp", "model.layers.1.mlp.shared_expert"]),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    mlp_only_layers=[0]), ["model.layers.0.mlp"]),
    "deepseek_v2": ("deepseek_v2", dict(MLA, n_group=1, topk_group=1),
                    ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]),
    "deepseek_v3": ("deepseek_v3", dict(MLA, n_group=2, topk_group=1),
                    ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]),
    "deepseek_v3_split_half": ("deepseek_v3", dict(MLA, n_group=2, topk_group=1, rope_interleave=False),
                               ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]),
    "glm": ("glm", dict(pad_token_id=0), ["model.layers.0.mlp", "model.layers.1.mlp"]),  # partial rotary, gate_up_proj
}
ROPE_FUNCTION = {"deepseek_v2": "apply_rotary_emb", "deepseek_v3": "apply_rotary_pos_emb_interleave"}
EXPERTS = {"mixtral": "MixtralExperts", "qwen2_moe": "Qwen2MoeExperts", "qwen3_moe": "Qwen3MoeExperts",
           "deepseek_v2": "DeepseekV2Experts", "deepseek_v3": "DeepseekV3Experts",
           "deepseek_v3_split_half": "DeepseekV3Experts"}


def plan(rope=True, swiglu=True, layers=()) -> Plan:
    return Plan(kernels=Kernels(fused_rope=rope, fused_swiglu=swiglu), layers=tuple(layers))


def build(model_type, **overrides):
    torch.manual_seed(0)
    kwargs = dict(TINY, **overrides)
    if model_type == "gpt2":
        kwargs = dict(n_embd=H, n_layer=2, n_head=NH, vocab_size=64, attn_implementation="eager")
    config = AutoConfig.for_model(model_type, **kwargs)
    return AutoModelForCausalLM.from_config(config).train()


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(base, got, tol):
    assert_close(got[0], base[0], atol=tol, rtol=tol)
    assert got[1].keys() == base[1].keys()
    for name, grad in base[1].items():
        assert_close(got[1][name], grad, atol=tol, rtol=tol, msg=name)


def untouched(model, modeling, name, original) -> bool:
    return getattr(modeling, name) is original and not any("forward" in m.__dict__ for m in model.modules())


IDS = torch.randint(1, 64, (B, S), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_family(family):
    model_type, overrides, mlps = FAMILIES[family]
    model = build(model_type, **overrides)
    modeling = importlib.import_module(kernels.FAMILIES[model_type].module)
    name = ROPE_FUNCTION.get(family, "apply_rotary_pos_emb")
    original = getattr(modeling, name)
    keys = list(model.state_dict())
    base = forward_backward(model, IDS)

    report = patch.apply(model, plan())
    try:
        assert getattr(modeling, name) is not original
        got = forward_backward(model, IDS)
        model.eval()
        with torch.no_grad():  # eval: no checkpoint, the fused ops alone
            assert_close(model(input_ids=IDS, use_cache=False).logits, base[0], atol=1e-5, rtol=1e-5)
        model.train()
        assert list(model.state_dict()) == keys
    finally:
        patch.revert(model)
    assert_same(base, got, 1e-5)
    assert untouched(model, modeling, name, original)
    assert_same(base, forward_backward(model, IDS), 0)

    assert report[0].startswith(f"{modeling.__name__}.{name} -> mf_ds.families.")
    mlp_lines = [line for line in report[1:] if ".forward -> fused SwiGLU" in line]
    assert [line.split(":")[0] for line in mlp_lines] == mlps
    assert len(report) == 1 + len(mlps) + (family in EXPERTS)
    if family in EXPERTS:
        assert report[-1].startswith(f"{len(model.model.layers) - (family != 'mixtral')} {EXPERTS[family]} ")
        assert report[-1].endswith("not fused by this patch: the experts' SwiGLU is fused by the mf-ds MoE layer "
                                   "(plan.moe) where it replaces them")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_family_forced_triton(family, monkeypatch):
    """Every mf_ds op on its Triton kernel (CPU: the interpreter): the whole model still matches HF."""
    model_type, overrides, _ = FAMILIES[family]
    model = build(model_type, **overrides)
    base = forward_backward(model, IDS)
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    patch.apply(model, plan())
    try:
        got = forward_backward(model, IDS)
    finally:
        patch.revert(model)
    assert_same(base, got, 1e-5)


@pytest.mark.parametrize("family", ["llama", "glm"])  # gate and up apart; packed gate_up_proj halves
def test_family_compiled_cpu_backward(family, monkeypatch):
    """The fused SwiGLU's compiled CPU backward (taken at any size here): the whole model still matches HF."""
    from mf_ds.ops import swiglu

    model_type, overrides, _ = FAMILIES[family]
    model = build(model_type, **overrides)
    base = forward_backward(model, IDS)
    monkeypatch.setenv("MF_DS_CPU_COMPILE", "1")
    monkeypatch.setattr(swiglu._cpu_bwd, "min_elements", 0)
    calls = swiglu._cpu_bwd.compiled_calls
    patch.apply(model, plan(rope=False))
    try:
        got = forward_backward(model, IDS)
    finally:
        patch.revert(model)
    assert swiglu._cpu_bwd.failed is None and swiglu._cpu_bwd.compiled_calls - calls == 2  # one per dense MLP
    assert_same(base, got, 1e-5)


def saved_bytes(module, x) -> int:
    """Bytes autograd keeps for backward, by unique storage, parameters left out (as tests/mf_ds/test_recompute.py)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(weakref.ref(t)) or t, lambda t: t):
        out = module(x)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ref in packed
                if (t := ref()) is not None and t.untyped_storage().data_ptr() not in params}
    out.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("model_type", ["llama", "glm"])
@pytest.mark.parametrize("force", [False, True])
def test_mlp_keeps_2TI_fewer(model_type, force, monkeypatch):
    """HF's MLP keeps x, gate, silu(gate), up and the product; the fused one x, gate and up: 2 T I elements fewer."""
    if force:
        monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    model = build(model_type, **FAMILIES[model_type][1])
    mlp = model.model.layers[0].mlp
    x = torch.randn(B, S, H, requires_grad=True)
    base = saved_bytes(mlp, x)
    patch.apply(model, plan(rope=False))
    try:
        got = saved_bytes(mlp, x)
    finally:
        patch.revert(model)
    assert base - got == 2 * B * S * FF * 4  # fp32


def test_not_applicable_is_a_note():
    model = build("gpt2")
    report = patch.apply(model, plan())
    patch.revert(model)
    assert report == [
        "fused_rope: not applicable to gpt2: GPT-2 has learned absolute position embeddings (wpe), no rotary "
        "embedding; nothing replaced",
        "fused_swiglu: not applicable to gpt2: GPT-2's MLP is c_fc -> GELU -> c_proj, no gated unit; nothing replaced"]


def test_gelu_mlp_is_a_note():
    model = build("llama", hidden_act="gelu")
    report = patch.apply(model, plan(rope=False))
    patch.revert(model)
    assert report == [f"model.layers.{i}.mlp: LlamaMLP not fused: its activation is GELUActivation, not SiLU "
                      "(hidden_act), so it is no SwiGLU" for i in range(2)]


def test_unknown_family_raises():
    model = build("mistral")
    with pytest.raises(PatchError, match="fused_rope: no patch for model type 'mistral'"):
        patch.apply(model, plan())


def test_probe_refuses_a_different_function(monkeypatch):
    """A transformers whose apply_rotary_pos_emb computes something else: PatchError, nothing patched."""
    from transformers.models.llama import modeling_llama

    def other(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos.unsqueeze(1), k * cos.unsqueeze(1)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", other)
    model = build("llama")
    with pytest.raises(PatchError, match=r"modeling_llama\.apply_rotary_pos_emb in this transformers version does "
                                         "not compute what rope_split_half does"):
        patch.apply(model, plan())
    assert modeling_llama.apply_rotary_pos_emb is other and not any("forward" in m.__dict__ for m in model.modules())


def test_adapters_are_strict():
    q, k, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(TypeError):
        rope_split_half(q, k, cos, sin, 1, "extra")
    with pytest.raises(TypeError):
        rope_split_half(q, k, cos, sin, position_ids=None)
    with pytest.raises(ValueError, match="ignores position_ids"):
        rope_deepseek_v3_interleave(q, k, cos, sin, position_ids=torch.arange(3))
    with pytest.raises(ValueError, match="treats them as constants"):
        rope_split_half(q, k, cos.requires_grad_(), sin)


def test_deepcopy_rebinds():
    """A deepcopy of a patched model (as some trainers make) runs its own modules, not the original's."""
    import copy

    model = build("llama")
    patch.apply(model, plan(rope=False))
    try:
        twin = copy.deepcopy(model)
        mlp = twin.model.layers[0].mlp
        assert mlp.forward.mlp is mlp and mlp is not model.model.layers[0].mlp
        assert_close(twin(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=0, rtol=0)
    finally:
        patch.revert(model)


def test_with_recompute():
    """patch.apply puts the kernel patches first, then the recompute plan (act_fn + mul, recomputed through the same
    fused op): the same gradients, and one revert; the other order (recompute already on) is refused."""
    model = build("llama")
    base = forward_backward(model, IDS)
    layer = Layer(index=0, select_recompute=("mlp.act_fn", "mlp.mul"))
    report = patch.apply(model, plan(layers=[layer]))
    assert report[-1].startswith("recompute: model.layers.0.mlp: recompute act_fn, mul")
    try:
        assert_same(base, forward_backward(model, IDS), 1e-5)
    finally:
        patch.revert(model)
    assert "forward" not in model.model.layers[0].mlp.__dict__
    apply_recompute(model, [layer])
    try:
        with pytest.raises(PatchError, match="already has an instance forward"):
            patch.apply(model, plan(rope=False))
    finally:
        revert_recompute(model)


def zero3_losses() -> dict[str, list[float]]:
    """Three ZeRO-3 steps of a tiny Qwen2-MoE (dense MLP, shared expert, RoPE), plain and with both kernels: ZeRO-3
    gathers down_proj's weight again when the product is rebuilt in backward."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": B, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    losses = {}
    for name in ("plain", "fused"):
        model = build("qwen2_moe", **FAMILIES["qwen2_moe"][1])
        if name == "fused":
            patch.apply(model, plan())
        engine, *_ = deepspeed.initialize(model=model, config=config)
        losses[name] = []
        for _ in range(3):
            loss = engine(input_ids=IDS, labels=IDS, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
        if name == "fused":
            patch.revert(model)
    return losses


@pytest.mark.deepspeed
def test_deepspeed_zero3():
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # one thread: see CPU_ENV in tests/conftest.py
    script = ("import json; from tests.mf_ds.test_patch_kernels import zero3_losses; "
              "print(json.dumps(zero3_losses()))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert losses["fused"] == pytest.approx(losses["plain"], abs=1e-6, rel=0)


# --- with the mf-ds MoE layer: the experts' SwiGLU is fused there (issue 16 item 15) -------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_fused_kernels_on_moe_models_with_the_moe_layer(family):
    """Both fused switches on every MoE family with plan.moe: no PatchError where every MLP is an MoE block
    (Mixtral, and Qwen3-MoE here), a line saying the experts' SwiGLU runs fused in the MoE layer, the same logits
    and gradients as HF's model (fp32)."""
    from tests.moe import family_plan, grads, tiny_model

    hf = tiny_model(family)
    model = tiny_model(family)
    moe_plan = dataclasses.replace(family_plan(family), kernels=Kernels(fused_rope=True, fused_swiglu=True))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    base = hf(ids, labels=ids)
    base.loss.backward()
    report = patch.apply(model, moe_plan)
    try:
        got = model(ids, labels=ids)
        got.loss.backward()
        assert_close(got.logits, base.logits, atol=1e-5, rtol=1e-5)
        for name, grad in grads(hf).items():
            assert_close(grads(model)[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        patch.revert(model)
    moe_layers = len(moe_plan.moe.layers)
    assert f"{moe_layers} MFExperts (model.layers.{moe_plan.moe.layers[0]}.mlp.experts, ...): nothing to " \
           "replace: the experts' SwiGLU already runs fused inside the mf-ds MoE layer " \
           "(mf_ds.ops.swiglu.fused_swiglu_packed), where MindFormers fuses it too" in report
    assert not any("Experts (" in line and "not fused by this patch" in line for line in report)
    assert any(line.startswith(f"{kernels.FAMILIES[family].module}.") for line in report)  # RoPE


def test_non_silu_experts_are_a_note():
    from tests.moe import family_plan, tiny_model

    model = tiny_model("mixtral", hidden_act="gelu")
    moe_plan = dataclasses.replace(family_plan("mixtral"), kernels=Kernels(fused_swiglu=True))
    report = patch.apply(model, moe_plan)
    patch.revert(model)
    assert report[-1] == ("2 MFExperts (model.layers.0.mlp.experts, ...): not fused: the experts' activation is "
                          "GELUActivation, not SiLU (hidden_act), so it is no SwiGLU")


def test_a_mixtral_yaml_with_use_fused_swiglu_starts():
    """The r1.5.0 Mixtral 8x7B pretrain YAML, shrunk, with use_fused_swiglu and use_fused_rope: it used to stop with
    `PatchError: fused_swiglu: the mixtral patch matched nothing in MixtralForCausalLM`."""
    from mf_ds.model import build_model
    from tests.conftest import CORPUS
    from translators.loader import load_yaml
    from translators.plan import translate

    path = CORPUS / "r1.5.0__research__mixtral__mixtral_8x7b__pretrain_mixtral-8x7b.yaml"
    if not path.exists():
        pytest.skip(f"{path} is missing (../shared beside the repository)")
    tree = load_yaml(str(path))
    tree["model"]["model_config"].update(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                         n_kv_heads=2, vocab_size=64, seq_length=16, use_fused_swiglu=True,
                                         use_fused_rope=True, compute_dtype="float32", use_flash_attention=False)
    tree["parallel_config"].update(data_parallel=1, model_parallel=1, pipeline_stage=1, expert_parallel=1)
    tree.pop("recompute_config", None)
    plan = translate(tree, world_size=1).plan
    assert plan.kernels.fused_swiglu and plan.moe is not None
    model = build_model(plan)
    report = patch.apply(model, plan)
    patch.revert(model)
    assert any(line.startswith("2 MFExperts (model.layers.0.mlp.experts, ...): nothing to replace") for line in report)
