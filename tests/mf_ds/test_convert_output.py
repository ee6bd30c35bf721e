"""What `mf-convert` writes is complete and shareable (issue 33 item 5): the HF config.json names the architecture
(vLLM, TGI and the Hub read `architectures`) and the dtype of the tensors written, and the weight files take the
mode any new file gets (0666 less the umask), not safetensors' private 0600."""

from __future__ import annotations

import json
import os
import stat

from safetensors.torch import load_file

from tests.mf_ds.test_mindspore_ckpt import MF, TINY


def mf_convert(*args: str, umask: int = 0o022) -> None:
    """mf-convert as a user runs it, under that umask."""
    from mf_ds.convert import cli

    before = os.umask(umask)
    try:
        assert cli(["--mf-config", str(TINY), *args]) == 0
    finally:
        os.umask(before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_hf_directory_names_its_architecture_and_dtype(tmp_path):
    from transformers import AutoConfig

    mf_convert(str(MF / "llama" / "model_bf16.ckpt"), str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert {str(t.dtype) for t in load_file(str(tmp_path / "hf" / "model.safetensors")).values()} == {"torch.bfloat16"}
    assert str(AutoConfig.from_pretrained(str(tmp_path / "hf")).dtype) == "torch.bfloat16"
    mf_convert(str(MF / "llama" / "model.ckpt"), str(tmp_path / "fp32"))
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


def test_weight_files_are_not_private(tmp_path):
    mf_convert(str(MF / "llama" / "model.ckpt"), str(tmp_path / "hf"))
    assert mode(tmp_path / "hf" / "model.safetensors") == mode(tmp_path / "hf" / "config.json") == 0o644
    mf_convert(str(tmp_path / "hf"), str(tmp_path / "mf.safetensors"), umask=0o002)
    assert mode(tmp_path / "mf.safetensors") == 0o664
    mf_convert(str(tmp_path / "hf"), str(tmp_path / "c2"))
    files = list((tmp_path / "c2").rglob("*.safetensors"))
    assert files and {mode(f) for f in files} == {0o644}
    mf_convert(str(tmp_path / "hf"), str(tmp_path / "mf.ckpt"))
    assert mode(tmp_path / "mf.ckpt") == 0o644
