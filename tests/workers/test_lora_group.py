"""LoRA on a DeepSpeed actor group (real Ray + DeepSpeed CPU, ZeRO-2 and ZeRO-3, 2 ranks):
only the adapters train, the adapters-off forward is the reference model's, the synced
adapter is what PEFT loads, merged weights fold it in, and a checkpoint resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.models.lora import LoraSettings, adapter_config, write_adapter
from rlhf.trainer.objectives import SFTObjective
from rlhf.workers.deepspeed_worker import DeepSpeedSettings
from rlhf.workers.group import ModelGroup

from .test_deepspeed_group import BUDGET, DS, _hf_lm, _hf_logprobs, _max_diff, _samples

pytestmark = pytest.mark.e2e
LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def lora_actor(request, ray_session, tiny_llama_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp(f"lora_ckpt_zero{request.param}")
    group = ModelGroup(
        "actor",
        str(tiny_llama_dir),
        2,
        DeepSpeedSettings(**{**DS, "zero_stage": request.param, "weight_decay": 0.0}),
        seed=0,
        lora=LORA,
    )
    group.save_checkpoint(str(ckpt), tag="init")
    group.init_ckpt = str(ckpt)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size


def _peft_logprobs(
    model_dir: Path, adapter: dict[str, torch.Tensor], samples, tmp: Path
) -> list[torch.Tensor]:
    """Per-sample logprobs of PEFT's own PeftModel loaded from the synced adapter tensors."""
    from peft import PeftModel

    path = write_adapter(tmp, adapter, adapter_config(LORA, "llama", str(model_dir)))
    model = PeftModel.from_pretrained(_hf_lm(model_dir), str(path)).eval()
    with torch.no_grad():
        return [_hf_logprobs(model, s) for s in samples]


def test_adapters_train_and_the_synced_adapter_is_the_trained_policy(
    lora_actor, tiny_llama_dir, vocab, tmp_path
):
    lora_actor.load_checkpoint(lora_actor.init_ckpt, tag="init")
    samples = _samples(vocab)
    info = lora_actor.info()[0]
    # optimizer and gradients hold the adapters only: 2 layers x 7 projections x (A + B)
    assert info["trainable_params"] == 2 * (
        4 * (128 + 128) + 4 * (128 + 64) * 2 + 4 * (128 + 128) + 3 * 4 * (128 + 256)
    )
    for _ in range(2):
        lora_actor.train(samples, SFTObjective(), BUDGET)
    adapter = lora_actor.get_weights()
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if ".lora_B." in k) > 0  # trained
    ours = lora_actor.forward(samples, BUDGET)
    theirs = _peft_logprobs(tiny_llama_dir, adapter, samples, tmp_path / "adapter")
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_reference_is_the_actor_without_adapters(lora_actor, ray_session, tiny_llama_dir, vocab):
    lora_actor.load_checkpoint(lora_actor.init_ckpt, tag="init")
    samples = _samples(vocab, seed=4)
    lora_actor.train(samples, SFTObjective(), BUDGET)
    reference = ModelGroup("reference", str(tiny_llama_dir), 1, DeepSpeedSettings(lr=0.0), seed=0)
    try:
        separate = reference.forward(samples, BUDGET)
    finally:
        reference.shutdown()
    disabled = lora_actor.without_adapters().forward(samples, BUDGET)
    enabled = lora_actor.forward(samples, BUDGET)
    gap = max((a - b).abs().max().item() for a, b in zip(disabled, separate, strict=True))
    assert gap < 1e-5, gap
    assert max((a - b).abs().max().item() for a, b in zip(enabled, separate, strict=True)) > 1e-3


def test_checkpoint_holds_the_adapter_and_resumes_exactly(lora_actor, tiny_llama_dir, vocab, tmp_path):
    lora_actor.load_checkpoint(lora_actor.init_ckpt, tag="init")
    a, b = _samples(vocab, seed=2), _samples(vocab, seed=3)
    lora_actor.train(a, SFTObjective(), BUDGET)
    lora_actor.save_checkpoint(str(tmp_path))
    lora_actor.train(b, SFTObjective(), BUDGET)
    uninterrupted = lora_actor.get_weights()
    lora_actor.load_checkpoint(lora_actor.init_ckpt, tag="init")
    lora_actor.load_checkpoint(str(tmp_path))
    lora_actor.train(b, SFTObjective(), BUDGET)
    assert _max_diff(lora_actor.get_weights(), uninterrupted) < 1e-7
    # the checkpoint holds the adapter (and its optimizer state), not the frozen base: smaller
    # than the base model's weights alone, and any module state in it is adapter tensors only
    files = list(tmp_path.glob("*/*.pt"))
    base_bytes = (tiny_llama_dir / "model.safetensors").stat().st_size
    assert sum(f.stat().st_size for f in files) < base_bytes
    for f in files:
        module = torch.load(f, weights_only=False, map_location="cpu").get("module") or {}
        assert all(".lora_" in k for k in module), sorted(module)[:3]


def test_merged_sync_and_saved_models(ray_session, tiny_llama_dir, vocab, tmp_path):
    from peft import PeftModel

    group = ModelGroup(
        "actor", str(tiny_llama_dir), 1, DeepSpeedSettings(**DS), seed=0, lora=LORA, lora_sync="merged"
    )
    try:
        samples = _samples(vocab, seed=5)
        group.train(samples, SFTObjective(), BUDGET)
        merged = group.get_weights()
        group.save_hf(str(tmp_path / "adapter"))
        group.save_hf(str(tmp_path / "merged"), merged=True)
        logprobs = group.forward(samples, BUDGET)
    finally:
        group.shutdown()
    plain = _hf_lm(tiny_llama_dir).state_dict()
    assert list(merged) == list(plain)  # full HF names, no PEFT layers
    peft_model = PeftModel.from_pretrained(_hf_lm(tiny_llama_dir), str(tmp_path / "adapter")).eval()
    saved_merged = _hf_lm(tmp_path / "merged")
    assert _max_diff(saved_merged.state_dict(), merged) == 0.0
    with torch.no_grad():
        for s, ours in zip(samples, logprobs, strict=True):
            assert (_hf_logprobs(peft_model, s) - ours).abs().max().item() < 1e-4
            assert (_hf_logprobs(saved_merged, s) - ours).abs().max().item() < 1e-4
