"""Hydra config: schemas (``schema.py``), registration, composition and validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from rlhf.config.schema import PPOConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
T = TypeVar("T")

# Schema name in the ConfigStore -> dataclass. Entry points put "<name>_schema" first in
# their defaults list so every YAML group merged on top is type-checked against it.
SCHEMAS: dict[str, type] = {"ppo_schema": PPOConfig}


class ConfigError(ValueError):
    """A composed config failed validation; the message names the field and the fix."""


def register_schema(name: str, node: type) -> None:
    SCHEMAS[name] = node


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    # Importing the trainer configs registers their schemas in SCHEMAS.
    import rlhf.config.trainers  # noqa: F401

    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)


def to_object(cfg: Any) -> Any:
    """Turn a composed DictConfig into its dataclass, running every ``__post_init__`` check."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        obj = OmegaConf.to_object(cfg)
        check = getattr(obj, "check_required", None)
        if check is not None:
            check()
        return obj
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
        raise ConfigError(f"invalid config: {cause}") from e
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from e


def compose(config_name: str, overrides: list[str] | None = None) -> Any:
    """Compose ``conf/<config_name>.yaml`` with CLI-style overrides (for tests and tools)."""
    return to_object(compose_raw(config_name, overrides))


def compose_raw(config_name: str, overrides: list[str] | None = None) -> Any:
    """The composed ``DictConfig``, before the dataclass checks (``to_object``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


__all__ = [
    "CONF_DIR",
    "ConfigError",
    "PPOConfig",
    "compose",
    "compose_raw",
    "register_configs",
    "register_schema",
    "to_object",
]
