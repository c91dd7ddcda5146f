"""LoRA adapters on a Hugging Face model, through PEFT, for every trainer (``model.lora``).

The adapters are injected in place (``peft.inject_adapter_in_model``): the model keeps its own
class and forward, so packing, the value head and DeepSpeed see the same module tree as in
full fine-tuning, with the frozen base under ``<module>.base_layer`` and the adapter under
``<module>.lora_A.default`` / ``lora_B.default``. Only the adapters (and ``modules_to_save``,
e.g. a value head) are trainable, so the optimizer holds only them.

Names, as PEFT saves them (``PeftModel.save_pretrained``) and vLLM loads them:
``base_model.model.<module>.lora_A.weight``. ``adapter_tensors`` turns a stream of the
trainer's parameters into exactly that; ``merged_tensors`` folds ``W + (alpha/r) B A`` into
the base weights under their plain HF names, for engines without LoRA (``rollout.lora_sync=merged``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_FILES",
    "LoraSettings",
    "adapter_config",
    "adapter_tensors",
    "adapters_disabled",
    "apply_lora",
    "default_targets",
    "merged_tensors",
    "transposed_modules",
    "write_adapter",
]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ADAPTER = "default"
_SAVED = f".modules_to_save.{_ADAPTER}."
_PEFT_PREFIX = "base_model.model."
# The attention and MLP projections of Llama-style decoders (Llama, Qwen2/3, Mistral, Gemma,
# Phi3 after its fused names, OLMo2, Granite): what PEFT's own default table and verl/OpenRLHF's
# `all-linear` choice train. GPT-NeoX-style models name theirs differently.
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_TARGETS_BY_TYPE = {
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D: PEFT sets fan_in_fan_out
}


@dataclass
class LoraSettings:
    """What ``model.lora`` says, as a worker needs it (see ``rlhf.config.schema.LoraConfig``)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)  # [] = default_targets(model type)
    modules_to_save: list[str] = field(default_factory=list)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def default_targets(model_type: str) -> list[str]:
    """The modules LoRA goes into when ``model.lora.target_modules`` is empty."""
    return list(_TARGETS_BY_TYPE.get(model_type, _PROJECTIONS))


def _peft_config(settings: LoraSettings, model_type: str, base_path: str = "") -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules) or default_targets(model_type),
        modules_to_save=list(settings.modules_to_save) or None,
        base_model_name_or_path=base_path or None,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> int:
    """Inject LoRA into ``model`` in place and freeze everything else; returns the trainable count.

    ``modules_to_save`` (e.g. a value model's fresh ``score`` head) are trained in full, as
    PEFT does: a trainable copy beside the frozen original. LoRA B starts at zero, so the
    model is unchanged.
    """
    from peft import inject_adapter_in_model

    cfg = _peft_config(settings, model.config.model_type)
    names = {n.rpartition(".")[2] for n, _ in model.named_modules()}
    missing = [t for t in [*cfg.target_modules, *(cfg.modules_to_save or [])] if t not in names]
    if missing:
        from transformers.pytorch_utils import Conv1D

        linear = sorted(
            {
                n.rpartition(".")[2]
                for n, m in model.named_modules()
                if isinstance(m, (torch.nn.Linear, Conv1D))
            }
        )
        raise ValueError(
            f"model.lora.target_modules/modules_to_save: {model.config.model_type} has no module named "
            f"{missing}; its linear layers: {linear}"
        )
    inject_adapter_in_model(cfg, model, adapter_name=_ADAPTER)
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name) or _SAVED in name)
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _plain_name(name: str) -> str:
    """A ``modules_to_save`` copy under its module's own name (``score.modules_to_save.default.weight``
    -> ``score.weight``), as PEFT saves it and as the merged model holds it."""
    return name.replace(_SAVED, ".")


def _peft_name(name: str) -> str:
    """``model.layers.0.q_proj.lora_A.default.weight`` -> PEFT's saved name."""
    return _PEFT_PREFIX + _plain_name(name).replace(f".{_ADAPTER}.", ".")


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter (and ``modules_to_save``) tensors of a stream of the trainer's parameters,
    copied to CPU, in PEFT's saved naming. Everything else in the stream is skipped."""
    return {
        _peft_name(name): tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in named
        if is_adapter_param(name) or _SAVED in name
    }


def transposed_modules(model: torch.nn.Module) -> frozenset[str]:
    """The LoRA layers whose base weight is stored ``[in, out]`` (PEFT's ``fan_in_fan_out``:
    GPT-2-style ``Conv1D``), where a merge adds ``(B @ A).T``."""
    return frozenset(
        n for n, m in model.named_modules() if hasattr(m, "lora_A") and getattr(m, "fan_in_fan_out", False)
    )


def merged_tensors(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float, transposed: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named weights with each adapter folded in: ``W + scaling * B @ A`` (transposed
    for the modules in ``transposed``, see ``transposed_modules``).

    The stream is consumed in the parameters' own order (base weight, then its ``lora_A``,
    then ``lora_B``): a base weight is held (copied) until its two factors have passed. Yielded
    tensors are CPU copies.
    """
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if ".base_layer." in name:
            module, _, leaf = name.partition(".base_layer.")
            if leaf == "weight":
                held.setdefault(module, {})["W"] = tensor.detach().to("cpu", copy=True)
                continue
            yield f"{module}.{leaf}", tensor.detach().to("cpu", copy=True)
            continue
        if is_adapter_param(name):
            module, _, rest = name.partition(".lora_")
            parts = held.setdefault(module, {})
            parts[rest[0]] = tensor.detach().to("cpu", copy=True)
            if {"W", "A", "B"} <= parts.keys():
                w, a, b = parts["W"], parts["A"], parts["B"]
                delta = b.float() @ a.float()
                merged = w.float() + scaling * (delta.T if module in transposed else delta)
                yield f"{module}.weight", merged.to(w.dtype)
                del held[module]
            continue
        if ".original_module." in name:  # the frozen twin of a modules_to_save copy
            continue
        yield _plain_name(name), tensor.detach().to("cpu", copy=True)
    if held:
        raise RuntimeError(f"merging LoRA: modules without both factors in the stream: {sorted(held)[:4]}")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module, disabled: bool = True) -> Iterator[None]:
    """Run the base model alone (the reference policy of a LoRA run); no-op without LoRA."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)] if disabled else []
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_config(settings: LoraSettings, model_type: str, base_path: str = "") -> dict[str, Any]:
    """``adapter_config.json`` as PEFT writes it (``PeftModel.from_pretrained`` and vLLM read it)."""
    cfg = _peft_config(settings, model_type, base_path).to_dict()
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def write_adapter(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
