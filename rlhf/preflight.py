"""What the model directories decide, checked on the driver before Ray or any worker starts.

The config alone is validated at compose time (``rlhf.config``); these checks need the model's
own files, and each mistake used to surface minutes later from inside a worker as a traceback:

- ``model.lora.target_modules`` naming no module of the model (checked on an empty "meta"
  instance built from ``config.json``: no weights are read);
- LoRA with adapter-only sync on an architecture vLLM serves no LoRA for (``rollout.lora_sync=merged``
  is the way there);
- ``reward.model_path`` or ``model.critic_path`` pointing at a PEFT adapter directory (a LoRA
  run's ``final``) instead of a full model (its ``final_merged``);
- ``model.sequence_parallel_size`` that does not divide the model's attention heads.

Each raises ``ConfigError`` with one message naming the field and the fix.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlhf.config import ConfigError

log = logging.getLogger("rlhf")

__all__ = [
    "check_adapter_dir",
    "check_lora_targets",
    "check_model_dirs",
    "check_sequence_parallel_heads",
    "check_vllm_lora",
]


def check_adapter_dir(field: str, path: str) -> None:
    """``path`` (a model dir a field names) must be a full model, not a bare PEFT adapter."""
    if not path or not Path(path).is_dir():
        return
    p = Path(path)
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        merged = p.parent / "final_merged"
        hint = f" ({merged} is there)" if (merged / "config.json").is_file() else ""
        raise ConfigError(
            f"{field}={path!r} is a LoRA adapter (adapter_config.json, no config.json), not a model: use the run's "
            f"final_merged directory{hint}, the base model with the adapter merged in"
        )


def _module_names(model_dir: str) -> tuple[str, set[str], list[str]]:
    """The model type, the leaf names of its modules and of its linear layers, from an empty
    ("meta") instance: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {n.rpartition(".")[2] for n, _ in model.named_modules()}
    linear = sorted(
        {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    )
    return config.model_type, names, linear


def check_lora_targets(lora: Any, model_dir: str) -> None:
    """Every ``model.lora.target_modules`` / ``modules_to_save`` entry names a module of the model."""
    from rlhf.models.lora import default_targets

    if not lora.enabled:
        return
    model_type, names, linear = _module_names(model_dir)
    targets = list(lora.target_modules) or default_targets(model_type)
    missing = [t for t in [*targets, *lora.modules_to_save] if t not in names]
    if missing:
        which = (
            "model.lora.target_modules"
            if any(t in targets for t in missing)
            else "model.lora.modules_to_save"
        )
        raise ConfigError(
            f"{which}: {model_type} ({model_dir}) has no module named {missing}; its linear layers are {linear}"
        )


def check_vllm_lora(model_dir: str) -> None:
    """vLLM serves LoRA adapters for the model's architecture (adapter-only sync needs it)."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(model_dir).architectures or []
    try:
        from vllm.model_executor.models.interfaces import supports_lora
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:  # no vLLM on this machine (the engines' nodes have it): they will say
        return
    for arch in archs:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and not supports_lora(cls):
            raise ConfigError(
                f"rollout.lora_sync=adapter: vLLM serves no LoRA adapters for {arch} ({model_dir}); set "
                "rollout.lora_sync=merged (the adapter folded into full weights at each sync)"
            )


def check_sequence_parallel_heads(size: int, model_dir: str, source: str = "") -> None:
    """Ulysses gives each of ``size`` ranks ``heads / size`` attention heads.

    ``source``: what the message names as the model's origin (default: ``model_dir``)."""
    if size == 1:
        return
    from transformers import AutoConfig

    from rlhf.models.sequence_parallel import check_sequence_parallel

    try:
        check_sequence_parallel(AutoConfig.from_pretrained(model_dir), size)
    except ValueError as e:
        raise ConfigError(f"{source or model_dir}: {e}") from None


def check_model_dirs(cfg: Any, model_dir: str) -> None:
    """Every check above that applies to ``cfg`` (a PPO, SFT, DPO or RM config)."""
    check_lora_targets(cfg.model.lora, model_dir)
    # model.path "" = the tiny model built from model.tiny, in a temporary dir the user never named
    source = (
        f"model.path={cfg.model.path}"
        if cfg.model.path
        else f"model.tiny.num_heads={cfg.model.tiny.num_heads}"
    )
    check_sequence_parallel_heads(cfg.model.sequence_parallel_size, model_dir, source)
    if getattr(cfg, "syncs_adapter", False) and cfg.rollout.backend == "vllm":
        check_vllm_lora(model_dir)
    reward = getattr(cfg, "reward", None)
    if reward is not None and reward.type == "model":
        check_adapter_dir("reward.model_path", reward.model_path)
    check_adapter_dir("model.critic_path", cfg.model.critic_path)
    check_adapter_dir("model.path", cfg.model.path)
    dpo = getattr(cfg, "dpo", None)
    if dpo is not None:
        check_adapter_dir("dpo.ref_path", dpo.ref_path)
