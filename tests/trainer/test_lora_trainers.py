"""LoRA (``model.lora``) through the SFT, DPO and reward-model entry points: only the adapters
(and a value head) train, the loss falls, and ``final`` is a PEFT adapter dir that
``PeftModel.from_pretrained`` loads onto the base; ``train.save_merged`` adds the merged model."""

from __future__ import annotations

import json

import pytest
import torch

from ._helpers import tiny_trainer_cfg

pytestmark = pytest.mark.e2e


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_with_lora_trains_the_adapter_and_saves_peft_and_merged(ray_session, tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf import sft

    cfg = tiny_trainer_cfg(
        "sft", tmp_path, tiny_llama_dir, "model.lora.rank=8", "train.lr=0.01", "train.max_steps=6",
        "train.epochs=10", "train.save_merged=true",
    )  # fmt: skip
    history = sft.run(cfg)
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert losses[-1] < losses[0]
    final, merged = tmp_path / "final", tmp_path / "final_merged"
    assert sorted(p.name for p in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(final)).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    with torch.no_grad():
        assert (peft_model(ids).logits - plain(ids).logits).abs().max().item() < 1e-4
        with peft_model.disable_adapter():
            untouched = peft_model(ids).logits
        assert (untouched - plain(ids).logits).abs().max().item() > 1e-3  # the adapter learned something


@pytest.mark.parametrize("name", ["dpo", "rm"])
def test_dpo_and_reward_model_train_with_lora(ray_session, tmp_path, tiny_llama_dir, name):
    import importlib

    from safetensors.torch import load_file

    entry = importlib.import_module(f"rlhf.{name}")
    cfg = tiny_trainer_cfg(
        name, tmp_path, tiny_llama_dir, "model.lora.rank=4", "train.lr=0.01", "train.max_steps=3"
    )
    history = entry.run(cfg)
    assert [h["step"] for h in history] == [0, 1, 2, 3]  # 0: the eval before training
    tensors = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert tensors and all(".lora_" in k or (name == "rm" and ".score." in k) for k in tensors)
    if name == "rm":  # the reward head is trained in full and saved with the adapter
        assert "base_model.model.score.weight" in tensors
