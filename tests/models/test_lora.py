"""LoRA injection, adapter export, merging and the reference-by-disabled-adapters, each checked
against PEFT's own ``PeftModel`` / a plain base model on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.lora import (
    LoraSettings,
    adapter_config,
    adapter_tensors,
    adapters_disabled,
    apply_lora,
    merged_tensors,
    write_adapter,
)

SETTINGS = LoraSettings(rank=4, alpha=8.0)
IDS = torch.tensor([[1, 10, 11, 12, 30, 31, 5]])


def trained_lora_model(model_dir, settings: LoraSettings = SETTINGS, seed: int = 0, scale: float = 0.2):
    """A model with LoRA injected and its B factors moved off zero (a stand-in for training)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    apply_lora(model, settings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_only_adapters_train_and_the_exported_adapter_is_what_peft_loads(arch, request, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    model = trained_lora_model(model_dir)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers  # q k v o gate up down

    tensors = adapter_tensors(model.named_parameters())
    assert set(tensors) == {"base_model.model." + n.replace(".default.", ".") for n in trainable}
    out = write_adapter(tmp_path / "adapter", tensors, adapter_config(SETTINGS, arch, str(model_dir)))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    ours, theirs = _logits(model), _logits(peft_model)
    assert (ours - theirs).abs().max().item() < 1e-5
    with peft_model.disable_adapter():
        plain = _logits(peft_model)
    assert (ours - plain).abs().max().item() > 1e-2  # the adapter changes the model


def test_merged_weights_and_disabled_adapters_against_plain_models(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = trained_lora_model(tiny_llama_dir)
    merged = dict(merged_tensors(model.named_parameters(), SETTINGS.scaling))
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    base_logits = _logits(plain)
    with adapters_disabled(model):  # the reference policy of a LoRA run
        assert (_logits(model) - base_logits).abs().max().item() < 1e-6
    plain.load_state_dict(merged)
    # W + (alpha/r) B A, by hand for one module, then the whole model's logits
    a = model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    b = model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    w = model.model.layers[0].self_attn.q_proj.base_layer.weight
    hand = w + 2.0 * (b @ a)
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], hand, atol=1e-6)
    assert (_logits(plain) - _logits(model)).abs().max().item() < 1e-4


def test_unknown_target_module_names_the_model_layers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"model.lora.target_modules/modules_to_save: llama has no module named \[.qkv.\]"
    ):
        apply_lora(model, LoraSettings(rank=4, target_modules=["qkv"]))


def test_merged_weights_of_a_conv1d_model_equal_peft(tmp_path):
    """GPT-2 stores its projections as Conv1D ``[in, out]`` (PEFT's fan_in_fan_out): the merge
    must add ``(B @ A).T``. Without it a non-square layer (c_attn, 64 -> 192) cannot be merged and a
    square one (attn.c_proj, 64 -> 64) is merged silently wrong. For such a model the merged sync
    is the only way to the engine, so its merged weights must give PEFT's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GPT2Config

    from rlhf.models.lora import adapter_config, adapter_tensors, default_targets, transposed_modules

    cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    settings = LoraSettings(rank=4, alpha=8.0)
    assert default_targets("gpt2") == ["c_attn", "c_proj", "c_fc"]
    model = trained_lora_model(tmp_path / "gpt2", settings)
    assert "transformer.h.0.attn.c_attn" in transposed_modules(model)
    merged = dict(merged_tensors(model.named_parameters(), settings.scaling, transposed_modules(model)))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2"), dtype=torch.float32).eval()
    plain.load_state_dict(merged, strict=False)  # lm_head is tied to wte
    # the reference: PEFT's own model over the exported adapter
    out = write_adapter(
        tmp_path / "adapter",
        adapter_tensors(model.named_parameters()),
        adapter_config(settings, "gpt2", str(tmp_path / "gpt2")),
    )
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2"), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    ours = torch.log_softmax(_logits(plain), -1)
    theirs = torch.log_softmax(_logits(peft_model), -1)
    assert (ours - theirs).abs().max().item() < 1e-4
    with peft_model.disable_adapter():
        assert (torch.log_softmax(_logits(peft_model), -1) - theirs).abs().max().item() > 1e-2
