"""What the model directories decide is refused on the driver before any worker starts, as one
message naming the field and the fix (each used to fail minutes later inside a worker)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rlhf.config import ConfigError, compose
from rlhf.preflight import check_adapter_dir, check_lora_targets, check_model_dirs, check_vllm_lora


def _gpt2(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    ).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


def test_lora_targets_that_name_no_module_list_the_models_linear_layers(tiny_llama_dir):
    cfg = compose(
        "ppo", ["experiment=toy_count", "model.lora.rank=8", "model.lora.target_modules=[qkv,o_proj]"]
    )
    with pytest.raises(
        ConfigError,
        match=r"model.lora.target_modules: llama .* has no module named \['qkv'\]; its linear layers are \[.*'q_proj'",
    ):
        check_lora_targets(cfg.model.lora, str(tiny_llama_dir))
    ok = compose("ppo", ["experiment=toy_count", "model.lora.rank=8"])
    check_lora_targets(ok.model.lora, str(tiny_llama_dir))  # the architecture's defaults exist


def test_an_architecture_vllm_serves_no_lora_for_suggests_merged_sync(tmp_path, tiny_llama_dir):
    with pytest.raises(
        ConfigError, match="vLLM serves no LoRA adapters for GPT2LMHeadModel.*rollout.lora_sync=merged"
    ):
        check_vllm_lora(_gpt2(tmp_path))
    check_vllm_lora(str(tiny_llama_dir))


def test_a_lora_rank_above_what_vllm_serves_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match="model.lora.rank=1024 is above the largest adapter rank vLLM serves .512.*lora_sync=merged",
    ):
        compose("ppo", ["experiment=toy_count", "model.lora.rank=1024"])
    compose("ppo", ["experiment=toy_count", "model.lora.rank=1024", "rollout.lora_sync=merged"])


def test_a_peft_adapter_dir_as_a_model_path_names_final_merged(tmp_path, tiny_llama_dir):
    run = tmp_path / "rm_run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text("{}")
    (run / "final_merged").mkdir()
    (run / "final_merged" / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"reward.model_path=.*final' is a LoRA adapter .*final_merged .*is there"
    ):
        check_adapter_dir("reward.model_path", str(run / "final"))
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            "reward.type=model",
            f"reward.model_path={run / 'final'}",
            "reward.function=",
        ],
    )
    with pytest.raises(ConfigError, match="reward.model_path"):
        check_model_dirs(cfg, str(tiny_llama_dir))
    check_adapter_dir("reward.model_path", str(run / "final_merged"))


def test_sequence_parallel_size_must_divide_the_models_heads(tiny_llama_dir):
    # The tiny Llama has 2 attention heads.
    cfg = compose("ppo", ["experiment=toy_count", "algorithm=grpo", "model.sequence_parallel_size=4",
                          "cluster.actor_ranks=4", "cluster.ref_ranks=4"])  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"sequence_parallel_size=4 must divide the model's 2 attention heads.*\[1, 2\]"
    ):
        check_model_dirs(cfg, str(tiny_llama_dir))
    ok = compose("ppo", ["experiment=toy_count", "algorithm=grpo", "model.sequence_parallel_size=2",
                         "cluster.actor_ranks=2", "cluster.ref_ranks=2"])  # fmt: skip
    check_model_dirs(ok, str(tiny_llama_dir))


def test_the_cli_refuses_them_before_ray_starts(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.ppo", "experiment=toy_count", f"train.output_dir={tmp_path}", "model.lora.rank=8",
         "model.lora.target_modules=[qkv]"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.lora.target_modules: llama" in proc.stderr and "Traceback" not in proc.stderr
    assert "Ray" not in proc.stderr and time.monotonic() - t0 < 60
