"""mf_ds.patch.recompute on tiny from_config models in fp32: the same loss and gradients as the untouched model, and the
bytes saved for backward drop by exactly what each form is documented to drop.

Saved bytes are counted with `saved_tensors_hooks`: every tensor autograd packs for backward, by unique storage
(so views and tensors saved twice count once), parameters left out (they live anyway). A checkpoint region's own
packs go to the checkpoint's inner hook, so only what the region really keeps (its inputs) is counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from mf_ds.patch.recompute import apply_recompute, revert_recompute, swiglu_recomputed
from tests.conftest import ROOT, free_port
from translators.plan_types import Layer

B, S = 2, 8  # batch, sequence
T = B * S  # tokens
H, FF, NH = 64, 128, 4  # hidden, MLP width (I in mf_ds/patch/recompute.py), attention heads (= key/value heads)
D = H // NH  # head dim
FP32 = 4
LAYER = FP32 * (10 * T * H + 2 * T + B * NH * S * S + 4 * T * FF)  # one Llama layer's own saved bytes, see below
NORM = FP32 * T * (H + 1)  # an RMSNorm's internals: x * rsqrt(var) (T x H) and rsqrt(var) (T x 1)
SWIGLU = FP32 * 2 * T * FF  # act(gate) and act(gate) * up
TINY = dict(hidden_size=H, intermediate_size=FF, num_attention_heads=NH, num_key_value_heads=NH, vocab_size=128,
            attn_implementation="eager")


@dataclass
class Run:
    loss: float
    grads: dict[str, torch.Tensor]
    saved: int  # bytes
    by_layer: dict[int | None, int]  # bytes by the decoder layer that first saved them (None: outside the layers)


def run(model, ids) -> Run:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where: list[int | None] = [None]  # the decoder layer running now
    packed: list[tuple[int | None, weakref.ref]] = []

    def pack(tensor):
        packed.append((where[0], weakref.ref(tensor)))
        return tensor

    hooks = [h for i, layer in enumerate(model.model.layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)),
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))]
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    for h in hooks:
        h.remove()
    # only what the graph still holds: a tensor saved in a dead branch is freed, and its address may be reused
    first: dict[int, tuple[int | None, int]] = {}
    for layer, ref in packed:
        if (tensor := ref()) is not None and tensor.untyped_storage().data_ptr() not in params:
            first.setdefault(tensor.untyped_storage().data_ptr(), (layer, tensor.untyped_storage().nbytes()))
    loss.backward()
    by_layer: dict[int | None, int] = {}
    for layer, nbytes in first.values():
        by_layer[layer] = by_layer.get(layer, 0) + nbytes
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Run(loss.item(), grads, sum(by_layer.values()), by_layer)


def entry(i, full=False, select=(), comm=(), mtp=False) -> Layer:
    return Layer(index=i, full_recompute=full, select_recompute=tuple(select), comm_recompute=tuple(comm), mtp=mtp)


def build(model_type: str, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **config)).train()
    return model, torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))


def assert_same(base: Run, got: Run):
    assert abs(got.loss - base.loss) <= 1e-6
    assert got.grads.keys() == base.grads.keys()
    for name, grad in base.grads.items():
        torch.testing.assert_close(got.grads[name], grad, atol=1e-6, rtol=0, msg=name)


def untouched(model) -> bool:
    """No instance forward, no per-layer checkpointing attribute, no embedding hook left."""
    layer_attrs = ("gradient_checkpointing", "_gradient_checkpointing_func")
    return (not any("forward" in m.__dict__ for m in model.modules())
            and not any(a in layer.__dict__ for layer in model.model.layers for a in layer_attrs)
            and not model.get_input_embeddings()._forward_hooks)


@pytest.fixture(scope="module")
def llama():
    model, ids = build("llama", num_hidden_layers=4)
    return model, ids, run(model, ids)


def test_saved_bytes_accounting(llama):
    """The counter itself: each Llama layer keeps exactly these tensors (fp32, eager attention, no dropout):
    input_layernorm: its input x, rsqrt(var) (T), x * rsqrt (TH); the norm output, kept by q/k/v_proj (TH);
    q and k after RoPE, kept by q @ k^T, and v, kept by probs @ v (3 TH; RoPE's muls keep cos/sin, not q or k);
    the softmax output (B NH S S); o_proj's input (TH); post_attention_layernorm: x, rsqrt, x * rsqrt (2 TH + T);
    its output (TH); gate, act(gate), up and the product (4 T FF). 10 TH + 2T + B NH S^2 + 4 T FF in all.
    Layer 0 is also the first to keep RoPE's cos and sin (S x D each)."""
    _, _, base = llama
    assert [base.by_layer[i] for i in range(4)] == [LAYER + 2 * FP32 * S * D] + [LAYER] * 3


FORMS = {
    # a fully recomputed layer keeps only its input (T x H) out of its LAYER bytes
    "full": ([entry(1, full=True), entry(3, full=True)], 2 * (LAYER - FP32 * T * H),
             ["model.layers.1: full recompute", "model.layers.3: full recompute"]),
    "select act_fn+mul": ([entry(0, select=["mlp.act_fn", "mlp.mul"]), entry(2, select=["mlp.act_fn", "mlp.mul"])],
                          2 * SWIGLU, ["model.layers.0.mlp: recompute act_fn, mul (SwiGLU); keeps the outputs of "
                                       "gate_proj, up_proj", "model.layers.2.mlp: recompute act_fn, mul (SwiGLU)"]),
    # act(gate) only: the product stays, down_proj needs it
    "select act_fn": ([entry(0, select=["mlp.act_fn"])], FP32 * T * FF, ["model.layers.0.mlp: recompute act_fn;"]),
    # the product only: act(gate) and up stay to rebuild it
    "select mul": ([entry(0, select=["mlp.mul"])], FP32 * T * FF,
                   ["model.layers.0.mlp: recompute mul; keeps the outputs of act_fn, up_proj"]),
    # gate_proj's output (T x FF) goes; its matmul reruns from the MLP input, which up_proj keeps anyway
    "select gate_proj": ([entry(1, select=["mlp.gate_proj"])], FP32 * T * FF,
                         ["model.layers.1.mlp: recompute gate_proj; keeps the MLP input"]),
    # q_proj's output is kept by nobody (RoPE keeps cos/sin) and its input is kept by k/v_proj: nothing to gain
    "select q_proj": ([entry(1, select=["self_attn.q_proj"])], 0, ["model.layers.1.self_attn.q_proj: recompute"]),
    "select norms": ([entry(i, select=["input_layernorm", "post_attention_layernorm"]) for i in range(4)], 8 * NORM,
                     [f"model.layers.{i}.{n}: recompute" for i in range(4)
                      for n in ("input_layernorm", "post_attention_layernorm")]),
    "comm": ([entry(i, comm=["input_layernorm", "post_attention_layernorm"]) for i in range(4)], 8 * NORM,
             [f"model.layers.{i}.{n}: recompute (keeps its input, drops its internals; its output stays saved where "
              "a reader needs it; comm recompute: no sequence-parallel communication" for i in range(4)
              for n in ("input_layernorm", "post_attention_layernorm")]),
    # layer 1's select is ignored (full wins), so: one full layer, one SwiGLU, one norm
    "mixed, full wins": ([entry(1, full=True, select=["mlp.act_fn", "mlp.mul"]),
                          entry(2, select=["mlp.act_fn", "mlp.mul"]), entry(3, comm=["input_layernorm"])],
                         LAYER - FP32 * T * H + SWIGLU + NORM,
                         ["model.layers.1: full recompute", "model.layers.1.mlp.act_fn: covered by the layer's full "
                          "recompute", "model.layers.1.mlp.mul: covered", "model.layers.2.mlp: recompute act_fn, mul",
                          "model.layers.3.input_layernorm: recompute"]),
}


@pytest.mark.parametrize("form", FORMS)
def test_llama_forms(llama, form):
    model, ids, base = llama
    plan, dropped, lines = FORMS[form]
    keys = list(model.state_dict())
    report = apply_recompute(model, plan)
    try:
        got = run(model, ids)
        full = {e.index for e in plan if e.full_recompute}
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [i in full for i in range(4)]
        assert list(model.state_dict()) == keys
    finally:
        revert_recompute(model)
    assert_same(base, got)
    assert base.saved - got.saved == dropped
    for line in lines:
        assert sum(r.startswith(line) for r in report) == 1, (line, report)
    assert len(report) == len(lines)
    assert untouched(model)
    assert run(model, ids).saved == base.saved


def test_swiglu_select_reruns_no_matmul(llama):
    """Early stop ends the rerun before down_proj's matmul; recomputing gate_proj reruns exactly its matmul."""
    model, ids, _ = llama

    def backward_flops():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    base = backward_flops()
    for select, extra in ((["mlp.act_fn", "mlp.mul"], 0), (["mlp.gate_proj"], 2 * T * H * FF)):
        apply_recompute(model, [entry(0, select=select)])
        try:
            assert backward_flops() == base + extra
        finally:
            revert_recompute(model)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 7), (2, 4, 33)])
def test_swiglu_recomputed(shape):
    gate, up = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu_recomputed(gate, up)
    assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr()]  # act(gate) is not kept
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=0, rtol=0)
    assert torch.autograd.gradcheck(swiglu_recomputed, (gate, up))


def test_qwen3_moe():
    """Layer 0 dense (mlp_only_layers), layer 1 MoE: SwiGLU paths are not applicable there, the MoE modules are."""
    model, ids = build("qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, head_dim=D, mlp_only_layers=[0])
    base = run(model, ids)
    swiglu = ["mlp.act_fn", "mlp.mul"]
    report = apply_recompute(model, [entry(0, select=swiglu), entry(1, select=swiglu)])
    got = run(model, ids)
    revert_recompute(model)
    assert_same(base, got)
    assert base.saved - got.saved == SWIGLU
    assert report[1:] == ["model.layers.1.mlp.act_fn: not applicable to this layer (Qwen3MoeSparseMoeBlock has no "
                          "act_fn)", "model.layers.1.mlp.mul: not applicable to this layer (Qwen3MoeSparseMoeBlock "
                          "has no mul)"]

    # q_norm / k_norm normalise each head: T x NH rows of D
    plan = [entry(0, select=["self_attn.q_norm", "self_attn.k_norm"]),
            entry(1, select=["mlp.experts", "mlp.gate"], comm=["input_layernorm"])]
    report = apply_recompute(model, plan)
    got = run(model, ids)
    revert_recompute(model)
    assert_same(base, got)
    head_norms, moe_layer_norm = 2 * FP32 * T * NH * (D + 1), NORM
    assert base.saved - got.saved > head_norms + moe_layer_norm  # the experts' and router's internals go too
    assert [line.split(":")[0] for line in report] == [f"model.layers.{p}" for p in (
        "0.self_attn.q_norm", "0.self_attn.k_norm", "1.mlp.experts", "1.mlp.gate", "1.input_layernorm")]
    assert run(model, ids).saved == base.saved


def test_deepseek_v3():
    """MindFormers' mcore defaults and comm norms on every layer, layer 2 fully recomputed, one MTP layer."""
    q_rank, kv_rank, shared_width = 32, 16, 32
    model, ids = build("deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=shared_width, n_shared_experts=1, n_group=2,
                       topk_group=1, q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16)
    base = run(model, ids)
    select = ["mlp.shared_experts.mul", "mlp.shared_experts.act_fn", "mlp.mul", "mlp.act_fn"]
    comm = ["input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"]
    plan = [entry(i, full=i == 2, select=select, comm=comm) for i in range(3)] + [entry(3, mtp=True)]
    report = apply_recompute(model, plan)
    got = run(model, ids)
    revert_recompute(model)
    assert_same(base, got)
    norms = 2 * NORM + FP32 * T * (q_rank + 1) + FP32 * T * (kv_rank + 1)
    expected = (SWIGLU + norms  # layer 0: dense MLP
                + FP32 * 2 * T * shared_width + norms  # layer 1: the shared experts' SwiGLU
                + base.by_layer[2] - FP32 * T * H)  # layer 2 keeps only its input
    assert base.saved - got.saved == expected
    assert "model.layers.0.mlp.shared_experts.act_fn: not applicable to this layer (DeepseekV3MLP has no " \
           "shared_experts)" in report
    assert "model.layers.1.mlp.act_fn: not applicable to this layer (DeepseekV3MoE has no act_fn)" in report
    assert "model.layers.1.mlp.shared_experts: recompute act_fn, mul (SwiGLU); keeps the outputs of gate_proj, " \
           "up_proj" in report
    assert "model.layers.2: full recompute" in report
    assert sum("covered by the layer's full recompute" in line for line in report) == len(select) + len(comm)
    assert report[-1] == "model.layers.3: MTP layer, not built by DeepseekV3ForCausalLM; its recompute plan is skipped"


def test_glm_fused_gate_up():
    """GLM's gate and up are halves of gate_up_proj; recomputing it drops its output (2 T FF) and act(gate) (T FF)."""
    model, ids = build("glm", num_hidden_layers=2, pad_token_id=0)
    base = run(model, ids)
    report = apply_recompute(model, [entry(0, select=["mlp.activation_fn", "mlp.mul"]),
                                     entry(1, select=["mlp.gate_up_proj"])])
    got = run(model, ids)
    revert_recompute(model)
    assert_same(base, got)
    assert base.saved - got.saved == SWIGLU + FP32 * 3 * T * FF
    assert report == ["model.layers.0.mlp: recompute activation_fn, mul (SwiGLU); keeps the outputs of gate_up_proj",
                      "model.layers.1.mlp: recompute gate_up_proj; keeps the MLP input"]


def test_errors(llama):
    model, _, _ = llama
    with pytest.raises(ValueError, match=r"'self_attn\.q_a_layernorm' exists in none of the layers it is planned "
                                         r"for \(model\.layers\.1\): model\.layers\.1\.self_attn\.q_a_layernorm: "
                                         r"LlamaAttention has no q_a_layernorm"):
        apply_recompute(model, [entry(0, select=["mlp.mul"]), entry(1, select=["self_attn.q_a_layernorm"])])
    with pytest.raises(ValueError, match="layer 4 does not exist: LlamaForCausalLM has 4 decoder layers"):
        apply_recompute(model, [entry(4, full=True)])
    with pytest.raises(ValueError, match="layer 1 is planned twice"):
        apply_recompute(model, [entry(1, full=True), entry(1)])
    assert untouched(model)  # a bad plan changes nothing

    apply_recompute(model, [entry(1, full=True)])
    with pytest.raises(ValueError, match="already applied"):
        apply_recompute(model, [entry(2, full=True)])
    revert_recompute(model)
    with pytest.raises(ValueError, match="not applied"):
        revert_recompute(model)

    model.activation_checkpointing_enable()
    try:
        with pytest.raises(ValueError, match="activation checkpointing is already on in model.layers.0"):
            apply_recompute(model, [entry(1, full=True)])
    finally:
        model.activation_checkpointing_disable()


def zero_losses(stage: int) -> dict[str, list[float]]:
    """Three ZeRO steps of the tiny Llama, plain and recomputed (DeepSpeed's checkpoint for full layers)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": B, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    plan = [entry(1, full=True), entry(2, select=["mlp.act_fn", "mlp.mul", "input_layernorm"]),
            entry(3, full=True)]
    losses = {}
    for name in ("plain", "recompute"):
        model, ids = build("llama", num_hidden_layers=4)
        if name == "recompute":
            apply_recompute(model, plan, checkpoint_fn=deepspeed.checkpointing.checkpoint)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        losses[name] = []
        for _ in range(3):
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
    return losses


@pytest.mark.deepspeed
def test_deepspeed_zero():
    """deepspeed.initialize (ZeRO 0 and 2) on a recomputed model trains exactly like the plain one."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # one thread: see CPU_ENV in tests/conftest.py
    script = ("import json; from tests.mf_ds.test_recompute import zero_losses; "
              "print(json.dumps([zero_losses(0), zero_losses(2)]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for losses in json.loads(done.stdout.strip().splitlines()[-1]):
        assert losses["recompute"] == pytest.approx(losses["plain"], abs=1e-6, rel=0)
