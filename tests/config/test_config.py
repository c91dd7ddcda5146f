import pytest
from hydra.errors import ConfigCompositionException

from rlhf.config import ConfigError, compose
from rlhf.config.schema import PPOConfig


def test_default_ppo_config_composes_typed():
    cfg = compose("ppo")
    assert isinstance(cfg, PPOConfig)
    assert cfg.algorithm.advantage == "gae"
    assert cfg.reward.function == "rlhf.rewards.toy:count_reward"
    assert cfg.cluster.device == "cpu"


def test_cli_overrides_switch_groups_and_values():
    cfg = compose("ppo", ["algorithm=grpo", "rollout.num_engines=2", "train.num_steps=3"])
    assert cfg.algorithm.advantage == "grpo"
    assert cfg.algorithm.kl_in_reward is False
    assert cfg.rollout.num_engines == 2
    assert cfg.train.num_steps == 3


@pytest.mark.parametrize("algo", ["gae", "grpo", "reinforce_pp", "rloo"])
def test_every_algorithm_group_composes(algo):
    assert compose("ppo", [f"algorithm={algo}"]).algorithm.advantage == algo


def test_unknown_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="algorithm.no_such_key"):
        compose("ppo", ["algorithm.no_such_key=1"])


def test_ill_typed_value_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="rollout.num_engines"):
        compose("ppo", ["rollout.num_engines=many"])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["algorithm.advantage=ppo2"], "algorithm.advantage"),
        (["algorithm=grpo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
        (["data.max_prompt_len=500"], "data.max_prompt_len"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["reward.function=no_colon"], "reward.function"),
        (["reward.type=model"], "reward.model_path"),
        (["train.max_tokens_per_microbatch=64"], "train.max_tokens_per_microbatch"),
        (["cluster.device=tpu"], "cluster.device"),
    ],
)
def test_semantic_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        compose("ppo", overrides)
