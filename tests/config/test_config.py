import pytest
from hydra.errors import ConfigCompositionException

from rlhf.config import ConfigError, compose
from rlhf.config.schema import PPOConfig


def test_default_ppo_config_composes_typed():
    cfg = compose("ppo", ["experiment=toy_count"])
    assert isinstance(cfg, PPOConfig)
    assert cfg.algorithm.advantage == "gae"
    assert cfg.reward.function == "rlhf.rewards.toy:count_reward"
    assert cfg.cluster.device == "cpu"


def test_cli_overrides_switch_groups_and_values():
    cfg = compose(
        "ppo", ["experiment=toy_count", "algorithm=grpo", "rollout.num_engines=2", "train.num_steps=3"]
    )
    assert cfg.algorithm.advantage == "grpo"
    assert cfg.algorithm.kl_in_reward is False
    assert cfg.rollout.num_engines == 2
    assert cfg.train.num_steps == 3


@pytest.mark.parametrize("algo", ["gae", "grpo", "reinforce_pp", "rloo"])
def test_every_algorithm_group_composes(algo):
    assert compose("ppo", ["experiment=toy_count", f"algorithm={algo}"]).algorithm.advantage == algo


def test_dapo_and_gspo_presets_carry_the_papers_defaults():
    dapo = compose("ppo", ["experiment=toy_count", "algorithm=dapo"]).algorithm
    assert (dapo.advantage, dapo.policy_loss, dapo.clip_eps_low, dapo.clip_eps_high) == (
        "grpo",
        "ppo",
        0.2,
        0.28,
    )
    assert dapo.dynamic_sampling and dapo.loss_aggregation == "token_mean" and dapo.kl_coef == 0
    assert dapo.overlong_buffer_len(20480) == 4096
    gspo = compose("ppo", ["experiment=toy_count", "algorithm=gspo"]).algorithm
    assert (gspo.policy_loss, gspo.clip_eps_low, gspo.clip_eps_high) == ("gspo", 3e-4, 4e-4)
    assert gspo.loss_aggregation == "seq_mean_token_mean"


def test_unknown_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="algorithm.no_such_key"):
        compose("ppo", ["experiment=toy_count", "algorithm.no_such_key=1"])


def test_ill_typed_value_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="rollout.num_engines"):
        compose("ppo", ["experiment=toy_count", "rollout.num_engines=many"])


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
        (["algorithm.policy_loss=trpo"], "algorithm.policy_loss"),
        (["algorithm.rollout_correction=is"], "algorithm.rollout_correction"),
        (["algorithm.rollout_correction_level=turn"], "algorithm.rollout_correction_level"),
        (["algorithm.tis_cap=0.5"], "algorithm.tis_cap"),
        (["algorithm.mis_low=1.5"], "algorithm.mis_low"),
        (["algorithm.kl_clamp=-1"], "algorithm.kl_clamp"),
        (["algorithm.dynamic_sampling_max_rounds=0"], "algorithm.dynamic_sampling_max_rounds"),
        (["algorithm=dapo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
        (["algorithm.overlong_buffer_frac=1.5"], "algorithm.overlong_buffer_frac"),
        (["algorithm.overlong_buffer_frac=1.0"], "algorithm.overlong_buffer_frac"),
        (["algorithm=gspo", "algorithm.dual_clip=3"], "algorithm.dual_clip"),
        (["rollout.partial_rollouts=true"], "train.mode=streaming"),
        (["train.mode=streaming", "rollout.partial_rollouts=true"], "rollout.inflight_updates=false"),
        (
            ["algorithm=grpo", "train.recompute_old_logprobs=false", "algorithm.rollout_correction=tis"],
            "algorithm.rollout_correction=none",
        ),
        # the default (gae) puts the KL into the reward, from the actor's log-probs before the update
        (["train.recompute_old_logprobs=false"], "algorithm.kl_in_reward=false"),
        (["model.sequence_parallel_size=0"], "model.sequence_parallel_size"),
        (["model.sequence_parallel_size=2", "model.attn_impl=sdpa"], "model.attn_impl=sdpa"),
        # gae with KL: the actor's 2 ranks split, the reference's 1 cannot
        (["model.sequence_parallel_size=2", "cluster.actor_ranks=2"], "cluster.ref_ranks=1"),
        (
            ["model.sequence_parallel_size=2", "algorithm=grpo", "cluster.actor_ranks=3"],
            "cluster.actor_ranks=3",
        ),
    ],
)
def test_semantic_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        compose("ppo", overrides)


def test_old_logprobs_are_current_only_for_one_step_on_fresh_samples():
    assert compose("ppo", ["experiment=toy_count", "algorithm=grpo"]).old_logprobs_are_current
    for extra in (
        [],  # gae: the KL goes into the reward, computed before the update from the old logprobs
        ["algorithm=grpo", "train.ppo_epochs=2"],
        ["algorithm=grpo", "train.num_minibatches=2"],
        ["algorithm=grpo", "train.max_staleness=1"],
        ["algorithm=grpo", "algorithm.rollout_correction=tis"],
    ):
        assert not compose("ppo", ["experiment=toy_count", *extra]).old_logprobs_are_current, extra


def test_old_logprobs_from_rollout_only_where_the_actor_would_score():
    off = ["experiment=toy_count", "algorithm=grpo", "train.recompute_old_logprobs=false"]
    for extra in (["train.max_staleness=1"], ["train.ppo_epochs=2"], ["train.num_minibatches=2"]):
        assert compose("ppo", [*off, *extra]).old_logprobs_from_rollout, extra
        # the default recomputes them with the actor
        assert not compose("ppo", [*off[:2], *extra]).old_logprobs_from_rollout, extra
    # one step on fresh samples: the train step's own forward is exact and wins
    cfg = compose("ppo", off)
    assert cfg.old_logprobs_are_current and not cfg.old_logprobs_from_rollout


def test_base_config_and_schema_agree_on_every_default():
    """conf/ppo.yaml with its default groups is the schema's defaults: nothing (a toy task, a
    toy reward, another prompt length) is applied without an experiment= that names it."""
    from rlhf.config.schema import DataConfig, PPOConfig, RewardConfig

    composed = compose("ppo", ["data.prompts=my.parquet", "reward.function=my_reward:score"])
    assert composed == PPOConfig(
        data=DataConfig(prompts="my.parquet"), reward=RewardConfig(function="my_reward:score")
    )
    toy = compose("ppo", ["experiment=toy_count"])
    assert (toy.data.prompts, toy.reward.function) == ("toy:count", "rlhf.rewards.toy:count_reward")


def test_eval_columns_default_to_the_datas():
    cfg = compose("ppo", ["experiment=rlvr_math", "eval.prompt_key=problem", "eval.label_key=solution"])
    assert (cfg.eval.prompt_key, cfg.eval.label_key, cfg.data.prompt_key) == (
        "problem",
        "solution",
        "question",
    )
    assert compose("ppo", ["experiment=rlvr_math"]).eval.prompt_key == ""  # "" = data.prompt_key


def test_placement_strategy_per_group_and_engines():
    cfg = compose("ppo", ["experiment=toy_count"])
    assert (cfg.cluster.strategy("actor"), cfg.cluster.strategy("engines")) == ("PACK", "PACK")
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            "cluster.placement_strategy=strict_spread",
            "cluster.engine_placement_strategy=spread",
        ],
    )
    assert (cfg.cluster.strategy("all"), cfg.cluster.strategy("engines")) == ("STRICT_SPREAD", "SPREAD")
    with pytest.raises(ConfigError, match=r"cluster\.placement_strategy='strict' is not valid"):
        compose("ppo", ["experiment=toy_count", "cluster.placement_strategy=strict"])


def test_lora_config_and_what_it_cannot_be_combined_with():
    cfg = compose(
        "ppo", ["experiment=toy_count", "model.lora.rank=16", "model.lora.target_modules=[q_proj,v_proj]"]
    )
    assert cfg.model.lora.enabled and cfg.rollout.lora_sync == "adapter"
    assert not compose("ppo", ["experiment=toy_count"]).model.lora.enabled  # full fine-tuning by default
    for overrides, field in (
        (["rollout.backend=hf"], "rollout.lora_sync=merged"),
        (["model.lora.modules_to_save=[lm_head]"], "model.lora.modules_to_save"),
        (["rollout.lora_sync=both"], "rollout.lora_sync"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            compose("ppo", ["experiment=toy_count", "model.lora.rank=8", *overrides])
    merged = compose(
        "ppo", ["experiment=toy_count", "model.lora.rank=8", "rollout.backend=hf", "rollout.lora_sync=merged"]
    )
    assert merged.rollout.lora_sync == "merged"
    with pytest.raises(ConfigError, match=r"model\.lora\.rank must be >= 0"):
        compose("ppo", ["experiment=toy_count", "model.lora.rank=-1"])


def test_sequence_parallel_ranks_are_checked_for_the_groups_a_run_starts():
    # GRPO without KL starts the actor alone: the other roles' ranks do not matter.
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            "algorithm=grpo",
            "algorithm.kl_coef=0",
            "model.sequence_parallel_size=2",
            "cluster.actor_ranks=2",
        ],  # fmt: skip
    )
    assert cfg.model_roles() == ["actor"]
    for trainer, field in (("sft", "actor_ranks=3"), ("dpo", "ref_ranks=1"), ("rm", "reward_ranks=1")):
        with pytest.raises(ConfigError, match=f"must divide cluster.{field}"):
            compose(
                trainer,
                [
                    "experiment=toy_chat",
                    "model.sequence_parallel_size=2",
                    f"cluster.actor_ranks={2 + (trainer == 'sft')}",
                ],
            )
    compose("sft", ["experiment=toy_chat", "model.sequence_parallel_size=2", "cluster.actor_ranks=2"])
