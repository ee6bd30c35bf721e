"""The stand-in's `wandb.sdk.lib.config_util` (transformers imports ConfigError from it)."""


class ConfigError(Exception):
    pass
