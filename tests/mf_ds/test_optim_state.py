"""Resume from a Checkpoint 2.0 with its optimizer state, and save one (mf_ds/checkpoint/optim_state.py,
sharded_run.py).

The reference is MindFormers 2.0.0's own code (tests/fixtures/make_checkpoint2_fixtures.py): `single/` is a tiny mcore
Qwen3 and its AdamW state written by its save_checkpoint (global_step 5); adamw_step.safetensors is one update of its
own AdamW resumed from it by its own load_checkpoint; tests/mf_ds/mindformers_adamw.py transcribes that update in
numpy. mfds_written/ is what mf-ds writes after that update, and mfds_written_loaded.safetensors what MindFormers'
load_checkpoint read back from it into a network and its AdamW.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mf_ds.checkpoint import optim_state, sharded, sharded_run
from mf_ds.checkpoint.mindspore_ckpt import load_into
from mf_ds.checkpoint.sharded import Checkpoint2
from mf_ds.errors import RunError
from mf_ds.weights import layout_of
from tests.conftest import CONFIGS, CPU_ENV, ROOT, ds_launch
from tests.mf_ds.mindformers_adamw import adamw_step
from tests.mf_ds.test_convert import mcore_plan
from tests.mf_ds.test_mindspore_ckpt import MF
from tests.mf_ds.test_zero import one_rank  # noqa: F401  (a one-rank gloo group for in-process DeepSpeed)

CK2 = MF / "checkpoint2"
HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # the generator's ADAMW_STEP
STEP = load_file(str(CK2 / "adamw_step.safetensors"))


def _plan_model():
    from mf_ds.convert import _family
    from mf_ds.model import hf_config

    plan = mcore_plan("qwen3")
    model = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32)
    load_into(model, CK2 / "single", _family(plan), layout=layout_of(plan))
    return plan, _family(plan), model


def _engine(stage: int):
    import deepspeed

    plan, family, model = _plan_model()
    optimizer = torch.optim.AdamW(model.parameters(), **HP)  # one group: MindFormers' decays every parameter here
    keys = optim_state.state_keys(model, optimizer)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return plan, family, engine, keys


def _hf(named: dict[str, torch.Tensor], model, family, plan) -> dict[str, torch.Tensor]:
    """MindFormers-named tensors (weights' names) as the HF model's parameters, by the weights' conversion."""
    from mf_ds.weights import model_slot, to_hf

    out = {n: torch.empty_like(p) for n, p in model.named_parameters()}
    for name, tensor in named.items():
        for piece in to_hf(name, tensor, family, model.config, layout_of(plan)):
            param, index = model_slot(piece.name, out)
            whole = out[param][index] if index else out[param]
            (whole.reshape(piece.view)[piece.index] if piece.view else whole).copy_(piece.tensor)
    return out


def _mf(prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in STEP.items() if k.startswith(prefix) and "." in k[len(prefix):]
            and not k[len(prefix):].startswith(("adam_m.", "adam_v."))}


def test_the_transcription_is_mindformers_adamw():
    """The numpy transcription, from single/'s state and the generator's gradients, gives MindFormers' own update bit
    for bit (float32 throughout, as MindSpore computes it on CPU)."""
    ckpt = Checkpoint2(CK2 / "single")
    grads = _mf("grad.")
    assert len(grads) == 19 and ckpt.tensor("global_step").tolist() == [5]
    for name, g in grads.items():
        w, m, v, t = adamw_step(ckpt.tensor(name).numpy(), ckpt.tensor("adam_m." + name).numpy(),
                                ckpt.tensor("adam_v." + name).numpy(), g.numpy(), 5, **HP)
        assert t == int(STEP["after.global_step"][0]) == 6
        np.testing.assert_array_equal(w, STEP["after." + name].numpy(), err_msg=name)  # bit for bit
        np.testing.assert_array_equal(m, STEP["after.adam_m." + name].numpy(), err_msg=name)
        np.testing.assert_array_equal(v, STEP["after.adam_v." + name].numpy(), err_msg=name)


@pytest.mark.deepspeed
def test_one_step_after_resume_is_mindformers_step(one_rank, tmp_path):  # noqa: F811
    """ZeRO 0: the moments and global_step of MindFormers' checkpoint resume torch's AdamW (step 5 -> t = 6); one
    update with MindFormers' gradients gives MindFormers' weights and moments, to 2e-7 (torch's AdamW rounds its
    arithmetic differently: measured 6e-8, 9 of the 25 weights bit for bit; t off by one is off by 1.2e-3). The
    state saved as Checkpoint 2.0 then equals what the fixture mfds_written/ holds, which MindFormers' own
    load_checkpoint read back."""
    plan, family, engine, keys = _engine(0)
    model = engine.module
    state = optim_state.read(Checkpoint2(CK2 / "single"), model, family, layout_of(plan), keys)
    assert (state.step, state.trainer_step, state.notes) == (5, 5, [])
    optim_state.install(engine, state, keys)
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.AdamW) and all(float(opt.state[p]["step"]) == 5 for p in model.parameters())
    for name, g in _hf(_mf("grad."), model, family, plan).items():
        model.get_parameter(name).grad = g
    opt.step()
    want = _hf(_mf("after."), model, family, plan)
    want_m = _hf({k: STEP["after.adam_m." + k] for k in _mf("grad.")}, model, family, plan)
    want_v = _hf({k: STEP["after.adam_v." + k] for k in _mf("grad.")}, model, family, plan)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=0, atol=2e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], want_m[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], want_v[name], rtol=1e-6, atol=1e-7)
        assert float(opt.state[p]["step"]) == 6

    common = {"epoch_num": 1, "step_num": 6, "global_step": 6, "loss_scale": 1.0, "global_batch_size": 8}
    weights = {n: p.detach() for n, p in model.named_parameters()}
    sharded_run.save(engine, tmp_path, 6, keys, family, layout_of(plan), common, 1, weights)
    ours, fixture = Checkpoint2(tmp_path), Checkpoint2(CK2 / "mfds_written")
    assert sorted(ours.names()) == sorted(fixture.names()) and ours.common == fixture.common
    assert all(torch.equal(ours.tensor(n), fixture.tensor(n)) for n in ours.names())
    loaded = load_file(str(CK2 / "mfds_written_loaded.safetensors"))  # what MindFormers' loader read from it
    assert sorted(loaded) == sorted(n for n in ours.names() if n != "learning_rate")
    assert all(torch.equal(loaded[n].reshape(ours.tensor(n).shape), ours.tensor(n)) for n in loaded)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_install_and_gather_under_zero(one_rank, stage):  # noqa: F811
    """ZeRO 1/2/3: every parameter's moments written into the flat partitions read back whole, equal to the
    checkpoint's (through DeepSpeed's own fragment addresses), and the flat partitions' step is MindFormers' 5."""
    plan, family, engine, keys = _engine(stage)
    state = optim_state.read(Checkpoint2(CK2 / "tp2"), engine.module, family, layout_of(plan), keys)
    optim_state.install(engine, state, keys)
    back, step = optim_state.gather(engine, keys)
    assert step == 7
    for name, tensors in state.tensors.items():
        for key, value in tensors.items():
            assert torch.equal(back[name][key], value), (name, key)


def test_fused_counter_and_batch_rescaling(tmp_path):
    """The fused AdamW's counter (common.json's global_step - 1), a consumed_samples that is not step x batch (2.1.0's
    dynamic batch) and a changed global batch size, as MindFormers reads them, each said in a note."""
    plan, family, model = _plan_model()
    keys = optim_state.state_keys(model, torch.optim.AdamW(model.parameters()))
    root = tmp_path / "c"
    shutil.copytree(CK2 / "single", root)
    common = root / "iteration_00000005" / "common.json"
    common.chmod(0o644)
    common.write_text(json.dumps({**json.loads(common.read_text()), "global_step": 6, "global_batch_size": 8,
                                  "consumed_samples": 40}))
    state = optim_state.read(Checkpoint2(root), model, family, layout_of(plan), keys, global_batch_size=16)
    assert (state.step, state.trainer_step) == (6, 3) and len(state.notes) == 3
    assert "fused AdamW" in state.notes[0] and "consumed_samples 40" in state.notes[1]
    assert "step 6 -> 3" in state.notes[2]


def test_unmapped_optimizer_states_say_why(tmp_path):
    plan, family, model = _plan_model()
    layout = layout_of(plan)
    with pytest.raises(optim_state.Unmapped, match="this run's optimizer is SGD"):
        optim_state.state_keys(model, torch.optim.SGD(model.parameters(), lr=0.1))
    keys = optim_state.state_keys(model, torch.optim.AdamW(model.parameters()))
    muon = {n: ("momentum_buffer",) for n in keys}
    with pytest.raises(optim_state.Unmapped, match=r"needs muon_m\.\* \(Muon's state\)"):
        optim_state.read(Checkpoint2(CK2 / "single"), model, family, layout, muon)
    weights_only = tmp_path / "w"
    shutil.copytree(CK2 / "single", weights_only)
    (weights_only / "iteration_00000005" / "opt-0000000-0000001.safetensors").unlink()
    with pytest.raises(optim_state.Unmapped, match="holds no optimizer state"):
        optim_state.read(Checkpoint2(weights_only), model, family, layout, keys)
    partial = tmp_path / "p"
    tensors = {n: Checkpoint2(CK2 / "single").tensor(n) for n in Checkpoint2(CK2 / "single").names()}
    kept = [(n, t) for n, t in tensors.items() if n.startswith(("adam_", "global_step"))
            and "linear_fc2" not in n]
    sharded.write(partial, ((n, t) for n, t in tensors.items() if not n.startswith(("adam_", "global_", "lear"))),
                      iteration=5, optimizer=iter(kept))
    with pytest.raises(optim_state.Unmapped) as info:
        optim_state.read(Checkpoint2(partial), model, family, layout, keys)
    assert "2 of 25 parameters have no (or no whole, or a non-finite) adam_m.* state" in str(info.value)
    assert "mlp.down_proj.weight" in str(info.value) and "\n" not in str(info.value)


def test_hostile_counters_are_one_line(tmp_path):
    plan, family, model = _plan_model()
    keys = optim_state.state_keys(model, torch.optim.AdamW(model.parameters()))
    root = tmp_path / "c"
    shutil.copytree(CK2 / "single", root)
    common = root / "iteration_00000005" / "common.json"
    common.chmod(0o644)
    common.write_text(json.dumps({"global_step": "5; rm -rf /"}))
    with pytest.raises(RunError) as info:
        optim_state.read(Checkpoint2(root), model, family, layout_of(plan), keys)
    assert str(info.value).startswith(str(common)) and "is not a step count" in str(info.value)


# --- end to end: mf-train saves Checkpoint 2.0 with its optimizer and resumes from it ---

CALLBACKS = ("callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 3, "
             "keep_checkpoint_max: 1, use_legacy_format: False}]")


def _train(out, *args, check=True, config="tiny_llama"):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / f"{config}.yaml"), "--output_dir", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage,dtype,config", [("1", "float32", "tiny_llama"), ("1", "bfloat16", "tiny_llama"),
                                                ("3", "bfloat16", "tiny_llama"), ("1", "float32", "tiny_deepseek_v3")])
def test_resume_from_checkpoint2_gives_the_same_losses(tmp_path, stage, dtype, config):
    """6 steps straight == 3 steps saved as Checkpoint 2.0 (weights, AdamW moments, global_step), a new process
    resumed from it, 3 more: the same losses, learning rates and weights (ZeRO-1 as the YAML says, and ZeRO-3; in
    bf16 the saved weights are DeepSpeed's fp32 masters, and the resume puts them back as the masters; DeepSeek-V3:
    MLA, stacked experts and the routers' topk_bias)."""
    sets = ["--set", CALLBACKS, "--set", f"mf_ds.zero_stage={stage}", "--set",
            f"model.model_config.compute_dtype={dtype}"]
    _train(tmp_path / "straight", "--max_steps", "6", *sets, config=config)
    _train(tmp_path / "split", "--max_steps", "3", *sets, config=config)
    saved = Checkpoint2(tmp_path / "split" / "checkpoint")
    assert saved.iteration == 3 and saved.common["global_step"] == 3 and saved.tensor("global_step").tolist() == [3]
    assert any(n.startswith("adam_m.") for n in saved.names()) and any(n.startswith("adam_v.") for n in saved.names())
    proc = _train(tmp_path / "split", "--max_steps", "6", "--resume_training", *sets, config=config)
    assert "(Checkpoint 2.0: weights, optimizer state, LR schedule) at step 3" in proc.stderr
    straight, split = _metrics(tmp_path / "straight"), _metrics(tmp_path / "split")
    assert [m["step"] for m in split] == [1, 2, 3, 4, 5, 6]
    assert [(m["loss"], m["lr"]) for m in split] == [(m["loss"], m["lr"]) for m in straight]
    a, b = (Checkpoint2(tmp_path / d / "checkpoint") for d in ("straight", "split"))
    assert a.iteration == b.iteration == 6 and sorted(a.names()) == sorted(b.names())
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoint").iterdir()) == [
        "iteration_00000006", "latest_checkpointed_iteration.txt"]  # keep_checkpoint_max 1 (save_max)
    for name in a.names():
        assert torch.equal(a.tensor(name), b.tensor(name)), name


def test_resume_refusals_and_weights_only(tmp_path):
    """load_checkpoint a Checkpoint 2.0: with resume_training, from its iteration 3, the next steps are those of the
    run that wrote it; without, its weights only, and one line says the optimizer starts fresh; with it, a checkpoint
    without optimizer state, or an optimizer that does not map, is refused in one line (exit 2)."""
    _train(tmp_path / "src", "--max_steps", "6", "--set", CALLBACKS.replace("max: 1", "max: 2"))
    src = tmp_path / "src" / "checkpoint"
    # load_checkpoint naming an iteration directory, with resume_training: steps 4-6 as the run that wrote it
    proc = _train(tmp_path / "from3", "--max_steps", "6", "--load_checkpoint", str(src / "iteration_00000003"),
                  "--resume_training")
    assert f"resumed from {src / 'iteration_00000003'} (Checkpoint 2.0" in proc.stderr
    assert [(m["step"], m["loss"], m["lr"]) for m in _metrics(tmp_path / "from3")] == [
        (m["step"], m["loss"], m["lr"]) for m in _metrics(tmp_path / "src")][3:]
    shutil.rmtree(src / "iteration_00000003")
    proc = _train(tmp_path / "weights", "--max_steps", "1", "--load_checkpoint", str(src))
    assert "its optimizer state is not loaded (resume_training is False): weights only" in proc.stderr
    assert _metrics(tmp_path / "weights")[0]["step"] == 1
    proc = _train(tmp_path / "sgd", "--max_steps", "4", "--load_checkpoint", str(src), "--resume_training",
                  "--set", "optimizer={type: SGD, learning_rate: 0.01}", check=False)
    assert proc.returncode == 2 and "this run's optimizer is SGD" in proc.stderr and "Traceback" not in proc.stderr
    (next(src.glob("iteration_*")) / "opt-0000000-0000001.safetensors").unlink()
    proc = _train(tmp_path / "noopt", "--max_steps", "4", "--load_checkpoint", str(src), "--resume_training",
                  check=False)
    assert proc.returncode == 2 and "holds no optimizer state" in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line][0].count(str(src)) == 1


def test_hf_trainer_path_says_what_it_does_not_resume(tmp_path):
    from mf_ds.hf import _checkpoint2_notes
    from translators.plan import translate_file

    sets = [f"load_checkpoint={CK2 / 'single'}", "resume_training=True", CALLBACKS]
    notes = _checkpoint2_notes(translate_file(str(CONFIGS / "tiny_llama.yaml"), sets).plan.run)
    assert len(notes) == 2 and "loads its weights only" in notes[0] and "mf-train writes Checkpoint 2.0" in notes[1]
    assert _checkpoint2_notes(translate_file(str(CONFIGS / "tiny_llama.yaml")).plan.run) == []


def _muon_engine(model):
    import deepspeed

    from mf_ds.optim import build_optimizer
    from tests.mf_ds.test_muon import spec, typed

    optimizer = build_optimizer(model, typed(spec(lr=0.01, adamw_betas=[0.9, 0.95])))
    keys = optim_state.state_keys(model, optimizer)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, keys


def _steps(engine, n):
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(n):
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.deepspeed
def test_muon_resumes_from_checkpoint2(one_rank, tmp_path):  # noqa: F811
    """MindFormers' Muon (mf_ds/muon.py) on a tiny DeepSeek-V3: 3 steps, saved as Checkpoint 2.0 (muon_m.* for the
    Muon weights, adam_m / adam_v for the AdamW part: embeddings, output layer, vectors), a new engine resumed from
    it: the next 3 losses and the weights equal an uninterrupted run's. (MindFormers' names of DeepSeek-V3 are its
    legacy ones here: mf-ds has no mcore DeepSeek-V3 name table, and Muon's state follows the weights' names.)"""
    from mf_ds.weights import DEFAULT_LAYOUT
    from tests.mf_ds.test_muon import tiny_deepseek

    family = "deepseek_v3"
    engine, keys = _muon_engine(tiny_deepseek())
    assert {"momentum_buffer"} < {k for ks in keys.values() for k in ks}
    straight = _steps(engine, 3)
    common = {"epoch_num": 1, "step_num": 3, "global_step": 3, "loss_scale": 1.0, "global_batch_size": 2}
    sharded_run.save(engine, tmp_path, 3, keys, family, DEFAULT_LAYOUT, common, 1, engine.module.state_dict())
    straight += _steps(engine, 3)
    final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    saved = Checkpoint2(tmp_path)
    muon = {n.split(".", 1)[1] for n in saved.names() if n.startswith("muon_m.")}
    adam = {n.split(".", 1)[1] for n in saved.names() if n.startswith("adam_m.")}
    assert "model.layers.0.attention.lkv2kv_v.weight" in muon and "model.tok_embeddings.embedding_weight" in adam
    assert not muon & adam and muon | adam == {n for n in saved.names() if not n.startswith(("muon_m.", "adam_"))
                                               and n != "global_step" and not n.endswith((".expert_load",
                                                                                          ".topk_bias"))}

    model = tiny_deepseek()
    load_into(model, tmp_path, family)
    engine, keys = _muon_engine(model)
    assert sharded_run.resume(engine, tmp_path, keys, family, DEFAULT_LAYOUT, 2, lambda line: None) == 3
    assert _steps(engine, 3) == straight[3:]
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), final[name]), name


@pytest.mark.deepspeed
def test_resume_unpickles_nothing(one_rank, monkeypatch):  # noqa: F811
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling while resuming from a Checkpoint 2.0 directory")

    plan, family, engine, keys = _engine(0)
    for target, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    assert sharded_run.resume(engine, CK2 / "dp2tp2", keys, family, layout_of(plan), 8, lambda line: None) == 3


@pytest.mark.parametrize("counter", [torch.tensor([], dtype=torch.int32), torch.tensor([5.0]),
                                     torch.tensor([[5, 5]], dtype=torch.int64)])
def test_a_counter_that_is_not_one_integer_is_one_line(tmp_path, counter):
    plan, family, model = _plan_model()
    keys = optim_state.state_keys(model, torch.optim.AdamW(model.parameters()))
    source = Checkpoint2(CK2 / "single")
    opt = [(n, source.tensor(n)) for n in source.names() if n.startswith("adam_")] + [("global_step", counter)]
    sharded.write(tmp_path, ((n, source.tensor(n)) for n in source.names() if not n.startswith(("adam_", "glo",
                                                                                                     "lear"))),
                      iteration=5, optimizer=iter(opt))
    with pytest.raises(RunError) as info:
        optim_state.read(Checkpoint2(tmp_path), model, family, layout_of(plan), keys)
    assert "opt-0000000-0000001.safetensors: global_step is" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.deepspeed
def test_two_ranks_zero2_save_and_resume(tmp_path):
    """deepspeed mf_ds/train.py on 2 CPU ranks at ZeRO-2 (each rank holds half of every flat partition): the saved
    Checkpoint 2.0 gathers the moments whole, and a 2-rank run resumed from its iteration 3 repeats steps 4-6
    exactly."""
    import subprocess

    def launch(out, *args):
        cmd = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py"),
               "--mf-config", str(CONFIGS / "tiny_llama.yaml"), "--output_dir", str(out), "--set",
               CALLBACKS.replace("max: 1", "max: 2"), "--set", "mf_ds.zero_stage=2", *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    launch(tmp_path / "straight", "--max_steps", "6")
    saved = Checkpoint2(tmp_path / "straight" / "checkpoint" / "iteration_00000003")
    assert saved.tensor("global_step").tolist() == [3] and all(
        saved.tensor(n).abs().sum() > 0 for n in saved.names() if n.startswith("adam_v."))
    launch(tmp_path / "resumed", "--max_steps", "6", "--load_checkpoint", str(saved.directory), "--resume_training")
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [(m["step"], m["loss"], m["lr"]) for m in resumed] == [(m["step"], m["loss"], m["lr"]) for m in straight][3:]
    a, b = (Checkpoint2(tmp_path / d / "checkpoint") for d in ("straight", "resumed"))
    assert a.iteration == b.iteration == 6 and all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.names())


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [0, 2])
def test_pynative_bf16_masters_are_the_weights_resumed(one_rank, tmp_path, stage):  # noqa: F811
    """MindFormers' PyNative AdamW keeps fp32 masters of bf16 weights as main_param.<name> in the optimizer file
    (pynative/optimizer/adamw.py _init_main_params): resumed, they, not the bf16 weights, are the fp32 weights mf-ds
    trains on (ZeRO 0: the parameters; ZeRO 2: DeepSpeed's fp32 partitions); a weight without one keeps its own."""
    source = Checkpoint2(CK2 / "single")
    weights = {n: source.tensor(n) for n in source.names() if not n.startswith(("adam_", "global_step", "learning"))}
    mains = {n: w + 1e-3 for n, w in weights.items() if w.dim() == 2}  # off the bf16 grid: a master shows
    optimizer = [(n, source.tensor(n)) for n in source.names() if n.startswith(("adam_", "global_step"))]
    optimizer += [(f"main_param.{n}", m) for n, m in mains.items()]
    sharded.write(tmp_path, ((n, w.to(torch.bfloat16)) for n, w in weights.items()), iteration=5,
                      optimizer=iter(optimizer))
    plan, family, engine, keys = _engine(stage)
    assert sharded_run.resume(engine, tmp_path, keys, family, layout_of(plan), 8, lambda line: None) == 5
    got = optim_state.masters(engine, list(keys))
    want = _hf({n: mains.get(n, w.to(torch.bfloat16).float()) for n, w in weights.items()}, engine.module, family,
               plan)
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    assert not torch.equal(want["model.layers.0.mlp.down_proj.weight"],
                           want["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16).float())


def test_save_optimizer_that_does_not_map_is_refused_before_training(tmp_path):
    proc = _train(tmp_path / "sgd", "--max_steps", "2", "--set", CALLBACKS, "--set",
                  "optimizer={type: SGD, learning_rate: 0.01}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "sgd" / "metrics.jsonl").exists()
    assert "CheckpointMonitor.save_optimizer: this run's optimizer is SGD" in proc.stderr
    _train(tmp_path / "weights", "--max_steps", "2", "--set", CALLBACKS.replace("False}", "False, save_optimizer: "
                                                                               "False}"),
           "--set", "optimizer={type: SGD, learning_rate: 0.01}")
    saved = Checkpoint2(tmp_path / "weights" / "checkpoint")
    assert saved.iteration == 2 and not any(n.startswith(("adam_", "global_step")) for n in saved.names())
