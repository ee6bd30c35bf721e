"""mf_ds.fused_loss: carried into the Plan as run.fused_loss with a runtime note (mf_ds/loss_model.py reads it), in
both schemas; unset it is None (on where exact); a bad value is one line naming the key."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, ROOT
from translators.errors import ConfigError
from translators.plan import translate_file

PYNATIVE = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek3_pynative.yaml"


@pytest.mark.parametrize("path", [CONFIGS / "tiny_llama.yaml", PYNATIVE], ids=["graph", "pynative"])
@pytest.mark.parametrize("value", [True, False])
def test_carried_with_a_runtime_note(path, value):
    result = translate_file(str(path), [f"mf_ds.fused_loss={str(value).lower()}"])
    assert result.plan.run.fused_loss is value
    notes = [n for n in result.plan.notes if n.key == "mf_ds.fused_loss"]
    assert [(n.kind, n.message) for n in notes] == [("runtime", f"run.fused_loss = {value} (mf_ds/loss_model.py)")]


def test_unset_is_auto_and_bad_values_name_the_key():
    result = translate_file(str(CONFIGS / "tiny_llama.yaml"), [])
    assert result.plan.run.fused_loss is None
    assert not [n for n in result.plan.notes if n.key == "mf_ds.fused_loss"]
    with pytest.raises(ConfigError, match="mf_ds.fused_loss"):
        translate_file(str(CONFIGS / "tiny_llama.yaml"), ["mf_ds.fused_loss=maybe"])
