from .schema import ConfigError, TrainConfig, load_config, save_config, to_dict, validate

__all__ = ["ConfigError", "TrainConfig", "load_config", "save_config", "to_dict", "validate"]
