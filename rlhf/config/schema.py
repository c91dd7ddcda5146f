"""Typed Hydra config: dataclass schemas registered in Hydra's ConfigStore.

YAML groups in ``conf/`` fill these schemas; an unknown key or a value of the wrong type
fails when Hydra composes the config, and ``__post_init__`` checks run when
``rlhf.config.to_object`` turns the composed config into these dataclasses, each naming the
field and the fix. Where things run (``cluster``) is separate from what they do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADVANTAGES = ("gae", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo")
# Estimators that compare the samples of one prompt (they need n_samples_per_prompt >= 2).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
KL_KINDS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
ATTN_IMPLS = ("auto", "packed_sdpa", "sdpa", "eager", "flash_attention_2", "flash_attention_3")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{name}={value!r} is not valid; use one of {', '.join(allowed)}")


@dataclass
class TinyModelConfig:
    """Random-init model built at run time when ``model.path`` is empty."""

    arch: str = "llama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("model.tiny.arch", self.arch, ("llama", "qwen2"))


@dataclass
class ModelConfig:
    path: str = ""  # HF model dir (actor/reference init); "" = build model.tiny at run time
    critic_path: str = ""  # "" = critic from model.path with a fresh value head
    attn_impl: str = "auto"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _one_of("model.attn_impl", self.attn_impl, ATTN_IMPLS)


@dataclass
class DataConfig:
    # "toy:count" = bundled toy task; otherwise a JSONL file with one prompt per row.
    prompts: str = "toy:count"
    prompt_key: str = "prompt"
    num_toy_prompts: int = 256
    max_prompt_len: int = 64
    overlong_prompts: str = "error"  # error | skip (skipped prompts are counted in metrics)
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("data.overlong_prompts", self.overlong_prompts, ("error", "skip"))
        _check(self.max_prompt_len > 0, "data.max_prompt_len must be > 0")


@dataclass
class RolloutConfig:
    num_engines: int = 1
    max_model_len: int = 128
    max_new_tokens: int = 16
    n_samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    max_restarts: int = 1  # engine restarts per generate call before a step fails

    def __post_init__(self) -> None:
        _check(self.num_engines >= 1, "rollout.num_engines must be >= 1")
        _check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _check(
            self.temperature > 0,
            "rollout.temperature must be > 0 for RL (sampling), got "
            f"{self.temperature}; greedy rollouts give no exploration",
        )
        _check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")


@dataclass
class RewardConfig:
    type: str = "function"  # function | model
    function: str = "rlhf.rewards.toy:count_reward"  # "module:fn" or "path/to/file.py:fn"
    model_path: str = ""  # sequence-classification dir when type=model
    non_finite: str = "error"  # error | drop: what a NaN/inf score does
    clip: float = 10.0  # |score| clip after validation (0 = off)

    def __post_init__(self) -> None:
        _one_of("reward.type", self.type, ("function", "model"))
        _one_of("reward.non_finite", self.non_finite, ("error", "drop"))
        if self.type == "function":
            _check(
                ":" in self.function,
                f"reward.function={self.function!r} must look like 'module:fn' or 'path/to/file.py:fn'",
            )
        else:
            _check(
                bool(self.model_path),
                "reward.type=model needs reward.model_path (a reward-model dir "
                "trained with `python -m rlhf.rm`)",
            )


@dataclass
class EnvConfig:
    """Multi-turn environment; ``name`` empty = single-turn generation."""

    name: str = ""  # "module:Class" implementing rlhf.envs.base.Env
    max_turns: int = 3
    max_observation_tokens: int = 32


@dataclass
class AlgorithmConfig:
    advantage: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.01
    kl_kind: str = "k1"
    kl_in_reward: bool = True  # False = KL as a loss term (GRPO style)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0  # 0 = off; else e.g. 3.0
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    loss_aggregation: str = "token_mean"
    normalize_advantages: bool = True

    def __post_init__(self) -> None:
        _one_of("algorithm.advantage", self.advantage, ADVANTAGES)
        _one_of("algorithm.kl_kind", self.kl_kind, KL_KINDS)
        _one_of("algorithm.loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        _check(
            0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma and algorithm.lam must be in [0, 1]"
        )
        _check(self.dual_clip == 0 or self.dual_clip > 1, "algorithm.dual_clip must be 0 (off) or > 1")

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"


@dataclass
class TrainConfig:
    num_steps: int = 20
    rollout_batch_size: int = 8  # prompts per step (x n_samples_per_prompt samples)
    ppo_epochs: int = 1
    num_minibatches: int = 1  # optimizer steps per epoch
    max_tokens_per_microbatch: int = 2048
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    zero_stage: int = 2
    bf16: bool = False
    gradient_checkpointing: bool = False  # recompute activations in backward (long rows on GPU)
    seed: int = 0
    save_every: int = 0  # 0 = only at the end
    output_dir: str = "runs/ppo"
    resume: bool = False  # True = continue from output_dir/checkpoints/latest when present
    tensorboard: bool = True
    wandb_project: str = ""  # "" = wandb off

    def __post_init__(self) -> None:
        _check(self.zero_stage in (0, 1, 2, 3), "train.zero_stage must be 0, 1, 2 or 3")
        _check(self.num_steps >= 1, "train.num_steps must be >= 1")
        _check(self.rollout_batch_size >= 1, "train.rollout_batch_size must be >= 1")
        _check(self.max_tokens_per_microbatch >= 16, "train.max_tokens_per_microbatch must be >= 16")


@dataclass
class ClusterConfig:
    """Where things run: Ray address, device, ranks and placement."""

    address: str = ""  # "" = start a local Ray; "auto" = join the running cluster
    num_cpus: int = 8  # logical CPUs for a local Ray (may exceed physical cores)
    device: str = "cpu"  # cpu | cuda
    actor_ranks: int = 1
    critic_ranks: int = 1
    ref_ranks: int = 1
    reward_ranks: int = 1
    colocate: bool = True  # all training roles share one placement group's bundles
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0

    def __post_init__(self) -> None:
        _one_of("cluster.device", self.device, ("cpu", "cuda"))
        for name in ("actor_ranks", "critic_ranks", "ref_ranks", "reward_ranks"):
            _check(getattr(self, name) >= 1, f"cluster.{name} must be >= 1")


@dataclass
class PPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        if self.algorithm.advantage in GROUP_ESTIMATORS:
            _check(
                self.rollout.n_samples_per_prompt >= 2,
                f"algorithm.advantage={self.algorithm.advantage} compares samples of the same prompt: "
                "set rollout.n_samples_per_prompt >= 2",
            )
        _check(
            self.data.max_prompt_len < self.rollout.max_model_len,
            f"data.max_prompt_len ({self.data.max_prompt_len}) must be < rollout.max_model_len "
            f"({self.rollout.max_model_len}) to leave room for a response",
        )
        longest = self.rollout.max_model_len
        _check(
            self.train.max_tokens_per_microbatch >= longest,
            f"train.max_tokens_per_microbatch ({self.train.max_tokens_per_microbatch}) must be >= "
            f"rollout.max_model_len ({longest}) so every sample fits one micro-batch",
        )
