"""MindFormers 2.x Checkpoint 2.0 (mf_ds/checkpoint/sharded.py) on directories written by MindFormers 2.0.0's own
save_checkpoint (tests/fixtures/make_checkpoint2_fixtures.py): a tiny mcore Qwen3 and its AdamW state over 2 ranks
(tensor parallel), 4 ranks (dp x tp, weights split on both dimensions) and 1 rank. expected.safetensors is what
MindFormers' own load_checkpoint merges from them."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mf_ds.checkpoint import sharded
from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint, load_into
from mf_ds.checkpoint.sharded import Checkpoint2
from mf_ds.convert import cli, to_hf, to_mindformers
from mf_ds.errors import RunError
from tests.conftest import ROOT
from tests.mf_ds.test_convert import mcore_plan
from tests.mf_ds.test_mindspore_ckpt import MF, golden

CK2 = MF / "checkpoint2"
CASES = {"tp2": 7, "dp2tp2": 3, "single": 5}
MOMENTS = 2 * 19  # adam_m.* and adam_v.* of the 19 weights


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_equals_mindformers(case):
    """Every tensor, model and optimizer, equals MindFormers' own merge; the weights equal the source .ckpt."""
    ckpt = Checkpoint2(CK2 / case)
    assert ckpt.directory.name == f"iteration_{CASES[case]:08d}" and ckpt.iteration == CASES[case]
    assert ckpt.common["global_step"] == CASES[case]
    expected = load_file(str(CK2 / "expected.safetensors"))
    assert set(expected) <= set(ckpt.names()) and len(expected) == 19 + MOMENTS
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensor(name), tensor), name
    assert ckpt.tensor("global_step").tolist() == [CASES[case]]
    source = MindSporeCheckpoint(MF / "qwen3" / "model.ckpt")
    assert all(torch.equal(ckpt.tensor(n), source.tensor(n)) for n in source.names())
    if case != "single":  # the fixture really is sharded: a 2-D weight's chunks are halves / quarters
        meta = json.loads((ckpt.directory / "metadata.json").read_text())["state_dict_metadata"]
        chunks = meta["decoder.layers.0.self_attention.linear_proj.weight"]["chunk"]
        assert len(chunks) == {"tp2": 2, "dp2tp2": 4}[case] and chunks[0]["local_shape"] != [16, 32]


def test_sharded_loads_into_one_model():
    """The 2-rank directory loads into one HF model (build_model, as mf-train's load_checkpoint does): every
    parameter equal to the one-file checkpoint's, and the logits are the HF model's that the qwen3 fixture was
    converted from."""
    plan = mcore_plan("qwen3")
    from mf_ds.model import build_model, hf_config, is_mindformers_checkpoint

    assert is_mindformers_checkpoint(CK2 / "tp2") and is_mindformers_checkpoint(CK2 / "tp2" / "iteration_00000007")
    models = []
    for src in (CK2 / "tp2", MF / "qwen3" / "model.ckpt"):
        model = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # poison: a parameter left unwritten fails below
        counts = load_into(model, src, _family(plan))
        models.append((model, counts))
    (sharded, counts), (whole, _) = models
    built = build_model(plan, str(CK2 / "tp2"))
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), whole.state_dict().values(),
                                                 strict=True))
    assert counts == {"loaded": 25, "skipped": MOMENTS + 1}  # adam_m / adam_v / global_step read past
    for (name, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    _, arrays = golden("qwen3")
    with torch.no_grad():
        logits = sharded(torch.from_numpy(arrays["input_ids"].astype(np.int64))).logits
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=1e-5, rtol=0)


def _family(plan: dict) -> str:
    from mf_ds.convert import _family as family

    return family(plan)


def test_convert_both_ways(tmp_path):
    """mf-convert: the 4-rank directory -> HF equals the one-file checkpoint's HF directory; HF -> a one-card
    Checkpoint 2.0 directory (DST without a suffix) -> reads back to the source tensors, bit for bit."""
    plan = mcore_plan("qwen3")
    to_hf(plan, str(CK2 / "dp2tp2"), str(tmp_path / "hf"))
    to_hf(plan, str(MF / "qwen3" / "model.ckpt"), str(tmp_path / "ref"))
    ours, ref = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "ref"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)

    assert to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "out")) == 19
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "0"
    written = tmp_path / "out" / "iteration_00000000"
    assert sorted(p.name for p in written.iterdir()) == ["common.json", "model-0000000-0000001.safetensors"]
    back, source = Checkpoint2(tmp_path / "out"), MindSporeCheckpoint(MF / "qwen3" / "model.ckpt")
    assert set(back.names()) == set(source.names())
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in source.names())


def test_write_keeps_optimizer_and_common(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    opt = {"adam_m.w": torch.ones(2, 3), "global_step": torch.tensor([4], dtype=torch.int32)}
    sharded.write(tmp_path, iter(state.items()), iteration=4, common={"global_batch_size": 8},
                      optimizer=iter(opt.items()))
    ckpt = Checkpoint2(tmp_path)
    assert ckpt.iteration == 4 and ckpt.common["global_batch_size"] == 8 and ckpt.common["global_step"] == 4
    assert sorted(ckpt.names()) == ["adam_m.w", "global_step", "w"]
    assert torch.equal(ckpt.tensor("w"), state["w"])


def test_nothing_is_unpickled(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling while reading a Checkpoint 2.0 directory")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    ckpt = Checkpoint2(CK2 / "tp2")
    assert all(ckpt.tensor(n) is not None for n in ckpt.names())


def _copy(tmp_path, case="tp2"):
    shutil.copytree(CK2 / case, tmp_path / case)
    return tmp_path / case, tmp_path / case / f"iteration_{CASES[case]:08d}"


def _edit_meta(directory, change):
    path = directory / "metadata.json"
    data = json.loads(path.read_text())
    change(data["state_dict_metadata"], data["storage_data"])
    path.write_text(json.dumps(data))


PROJ = "decoder.layers.0.self_attention.linear_proj.weight"


def _chunks(m, s):
    return m[PROJ]["chunk"]


HOSTILE = {
    "offset out of range": (lambda m, s: _chunks(m, s)[1].update(global_offset=[5]), "metadata.json",
                            "out of range"),
    "offset per dimension": (lambda m, s: _chunks(m, s)[1].update(global_offset=[0, 16]), "metadata.json",
                             "out of range"),
    "overlapping chunks": (lambda m, s: _chunks(m, s)[1].update(global_offset=[0]), "metadata.json", "overlapping"),
    "missing chunk": (lambda m, s: _chunks(m, s).pop(), "metadata.json", "no chunk at global_offset [1]"),
    "shape does not divide": (lambda m, s: m[PROJ].update(global_shape=[16, 33]), "metadata.json",
                              "does not divide"),
    "local shape wrong": (lambda m, s: _chunks(m, s)[0].update(local_shape=[16, 32]), "metadata.json",
                          "local_shape [16, 32]"),
    "global shape larger than the files": (lambda m, s: [m[PROJ].update(global_shape=[32, 32])]
                                           + [c.update(local_shape=[32, 16]) for c in _chunks(m, s)],
                                           "model-0000000-0000002.safetensors", "metadata says F32[32, 16]"),
    "file outside": (lambda m, s: s[str((PROJ, (0,)))][0].update(file_name="../../x.safetensors"), "metadata.json",
                     "is not a .safetensors file of"),
    "absolute file": (lambda m, s: s[str((PROJ, (0,)))][0].update(file_name="/etc/passwd"), "metadata.json",
                      "is not a .safetensors file of"),
    "file missing": (lambda m, s: s[str((PROJ, (0,)))][0].update(file_name="model-0000009-0000010.safetensors"),
                     "model-0000009-0000010.safetensors", "missing (named by metadata.json)"),
    "another rank's slice": (lambda m, s: s[str((PROJ, (1,)))][0].update(storage_rank=0), "metadata.json",
                             "holds another slice"),
    "no storage": (lambda m, s: s.pop(str((PROJ, (1,)))), "metadata.json", "no storage_data for chunk [1]"),
    "tensor map outside": (lambda m, s: m[PROJ]["layout"].update(tensor_map=[-1, 3]), "metadata.json",
                           "outside device_matrix"),
    "rank list short": (lambda m, s: m[PROJ]["layout"].update(rank_list=[0]), "metadata.json", "distinct ranks"),
    "dtype unknown": (lambda m, s: m[PROJ]["properties"].update(dtype="Complex64"), "metadata.json",
                      "is not one mf-ds reads"),
    "dtype differs": (lambda m, s: m[PROJ]["properties"].update(dtype="Float16"), "model-0000000-0000002.safetensors",
                      "metadata says F16"),
    "shape not integers": (lambda m, s: m[PROJ].update(global_shape=["16", 32]), "metadata.json",
                           "list of integers"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_refused_in_one_line(tmp_path, capsys, case):
    change, file, words = HOSTILE[case]
    root, directory = _copy(tmp_path)
    _edit_meta(directory, change)
    with pytest.raises(RunError) as info:
        Checkpoint2(root)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(directory / file)) and words in message, message


@pytest.mark.parametrize("case,change,words", [
    ("tracker not a number", lambda root, d: (root / "latest_checkpointed_iteration.txt").write_text("seven"),
     "latest_checkpointed_iteration.txt: not an iteration number"),
    ("tracker names nothing", lambda root, d: (root / "latest_checkpointed_iteration.txt").write_text("8"),
     "names iteration 8, but iteration_00000008/ does not exist"),
    ("metadata not JSON", lambda root, d: (d / "metadata.json").write_text("{"), "metadata.json: not Checkpoint 2.0"),
    ("file truncated", lambda root, d: (d / "opt-0000001-0000002.safetensors").write_bytes(b"\x08\x00"),
     "opt-0000001-0000002.safetensors: not a readable safetensors file"),
    ("tensor missing from its file",
     lambda root, d: save_file({"x": torch.zeros(1)}, str(d / "model-0000001-0000002.safetensors")),
     "model-0000001-0000002.safetensors: lacks"),
])
def test_damaged_directory_is_refused_in_one_line(tmp_path, case, change, words):
    root, directory = _copy(tmp_path)
    (directory / "model-0000001-0000002.safetensors").chmod(0o644)
    (directory / "opt-0000001-0000002.safetensors").chmod(0o644)
    change(root, directory)
    with pytest.raises(RunError) as info:
        Checkpoint2(root)
    assert "\n" not in str(info.value) and words in str(info.value), str(info.value)


def test_root_without_tracker_names_its_iterations(tmp_path):
    root, _ = _copy(tmp_path)
    (root / "latest_checkpointed_iteration.txt").unlink()
    assert sharded.is_checkpoint2(root)
    with pytest.raises(RunError, match="latest_checkpointed_iteration.txt: missing; name one iteration_XXXXXXXX"):
        Checkpoint2(root)


def test_single_card_duplicate_names_refused(tmp_path):
    root, directory = _copy(tmp_path, "single")
    shutil.copy(directory / "model-0000000-0000001.safetensors", directory / "extra.safetensors")
    with pytest.raises(RunError, match="is also in"):
        Checkpoint2(root)


def test_cli_refuses_with_one_line(tmp_path, capsys):
    """mf-convert on a hostile directory: exit 2, one line naming the file, no traceback."""
    root, directory = _copy(tmp_path)
    _edit_meta(directory, HOSTILE["file outside"][0])
    assert cli(["--mf-config", str(ROOT / "configs" / "tiny_qwen3_moe.yaml"), str(root), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mf-convert: error: {directory / 'metadata.json'}: ")
    assert "Traceback" not in err
