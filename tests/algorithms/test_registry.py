"""The estimator and policy-loss tables drive the config and the advantage step."""

import dataclasses

import pytest
import torch

from rlhf.algorithms import registry
from rlhf.algorithms.registry import ESTIMATORS, POLICY_LOSSES, AdvantageInputs, Estimator
from rlhf.config import ConfigError, compose
from rlhf.config.schema import AlgorithmConfig


def test_config_allows_exactly_the_registered_names():
    for name in ESTIMATORS:
        assert AlgorithmConfig(advantage=name).advantage == name
    for name in POLICY_LOSSES:
        assert AlgorithmConfig(policy_loss=name).policy_loss == name
    with pytest.raises(ValueError, match="use one of " + ", ".join(ESTIMATORS)):
        AlgorithmConfig(advantage="nope")


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_critic_and_group_rules_come_from_the_table(name):
    est = ESTIMATORS[name]
    assert AlgorithmConfig(advantage=name).uses_critic is est.uses_critic
    overrides = ["experiment=toy_count", f"algorithm.advantage={name}", "rollout.n_samples_per_prompt=1"]
    if est.compares_group:
        with pytest.raises(ConfigError, match="n_samples_per_prompt >= 2"):
            compose("ppo", overrides)
    else:
        assert compose("ppo", overrides).algorithm.advantage == name


def test_a_new_estimator_is_one_row(monkeypatch):
    """Registering a row is all it takes for the config and the advantage step to use it."""
    from rlhf.data.types import Sample
    from rlhf.trainer.advantage_step import advantage_step

    def score_everywhere(x: AdvantageInputs):
        ids = torch.repeat_interleave(torch.arange(len(x.scores)), x.cu_seqlens.diff().long())
        return torch.where(x.action_mask, x.scores[ids], torch.zeros(())), None

    row = Estimator("score", score_everywhere, uses_critic=False, compares_group=False, summary="raw score")
    monkeypatch.setitem(registry.ESTIMATORS, "score", row)
    cfg = dataclasses.replace(AlgorithmConfig(), advantage="score", normalize_advantages=False)
    samples = [
        Sample(torch.arange(4), torch.tensor([False, True, True, False]), score=0.5),
        Sample(torch.arange(3), torch.tensor([False, False, True]), score=-2.0),
    ]
    advantage_step(samples, cfg)
    assert samples[0].advantages.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert samples[1].advantages.tolist() == [0.0, 0.0, -2.0]
