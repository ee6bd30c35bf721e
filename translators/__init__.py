"""MindFormers YAML -> DeepSpeed config, HF model config and the mf-ds Plan. Pure Python (no torch import).

    from translators import translate_file
    result = translate_file("x.yaml", overrides=["runner_config.batch_size=2"], world_size=8)
    result.plan.deepspeed, result.plan.hf_config, result.plan.run.total_steps, result.formative, result.warnings
    result.json                                   # the Plan as `mf-translate --plan` writes it
"""

from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import Translation, translate, translate_file

__all__ = ["ConfigError", "Translation", "load_yaml", "translate", "translate_file"]
