"""Schemas of the SFT, DPO and reward-model entry points (``conf/sft.yaml``, ``dpo.yaml``, ``rm.yaml``).

They share the ``model`` and ``cluster`` sections (and YAML groups) with PPO; ``data`` and
``train`` are their own: chat or preference rows instead of prompts, epochs over a fixed
data set instead of RL steps. Ranks: SFT and DPO train on ``cluster.actor_ranks`` (the DPO
reference runs once on ``cluster.ref_ranks``), the reward model on ``cluster.reward_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config import register_schema
from rlhf.config.schema import (
    AGGREGATIONS,
    ClusterConfig,
    ModelConfig,
    RunConfig,
    _check,
    _one_of,
    check_offload_device,
)


@dataclass
class ChatDataConfig:
    # "toy:count" = bundled toy task; otherwise a JSONL file (rlhf.data.chat documents the rows).
    path: str = "toy:count"
    max_len: int = 128  # tokens per sample (each of chosen and rejected for pairs)
    overlong: str = "error"  # error | skip (skipped rows are counted in the log)
    num_toy: int = 256  # rows of the toy task
    eval_size: int = 0  # samples (SFT) or pairs (DPO/RM) held out and evaluated after every epoch
    seed: int = 0  # toy rows, held-out split and shuffling

    def __post_init__(self) -> None:
        _check(bool(self.path), "data.path must be 'toy:count' or a JSONL file")
        _one_of("data.overlong", self.overlong, ("error", "skip"))
        _check(self.max_len > 1, f"data.max_len must be > 1, got {self.max_len}")
        _check(self.num_toy >= 1, f"data.num_toy must be >= 1, got {self.num_toy}")
        _check(self.eval_size >= 0, f"data.eval_size must be >= 0, got {self.eval_size}")


@dataclass
class SupervisedTrainConfig(RunConfig):
    epochs: int = 1
    max_steps: int = 0  # cap on optimizer steps; 0 = run every epoch to the end
    batch_size: int = 16  # samples (SFT) or pairs (DPO/RM) per optimizer step
    max_tokens_per_microbatch: int = 1024  # packing budget of one micro-batch row
    lr: float = 1e-4
    lr_schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.0
    output_dir: str = "runs/sft"  # the trained model lands in <output_dir>/final

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.epochs >= 1, f"train.epochs must be >= 1, got {self.epochs}")
        _check(self.max_steps >= 0, f"train.max_steps must be >= 0 (0 = no cap), got {self.max_steps}")
        _check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        _check(self.max_tokens_per_microbatch >= 16, "train.max_tokens_per_microbatch must be >= 16")
        _check(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _one_of("train.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _check(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class SFTParams:
    aggregation: str = "token_mean"  # how token losses are averaged over the mini-batch

    def __post_init__(self) -> None:
        _one_of("sft.aggregation", self.aggregation, AGGREGATIONS)


@dataclass
class DPOParams:
    beta: float = 0.1  # inverse temperature of the implicit reward
    label_smoothing: float = 0.0  # cDPO: assumed probability that a preference label is flipped
    ref_path: str = ""  # reference model dir; "" = the initial policy (model.path or the tiny model)

    def __post_init__(self) -> None:
        _check(self.beta > 0, f"dpo.beta must be > 0, got {self.beta}")
        _check(
            0.0 <= self.label_smoothing <= 0.5,
            f"dpo.label_smoothing must be in [0, 0.5], got {self.label_smoothing}",
        )


def _check_fits(max_len: int, budget: int, per_unit: int) -> None:
    what = "one sample" if per_unit == 1 else "a (chosen, rejected) pair"
    _check(
        budget >= per_unit * max_len,
        f"train.max_tokens_per_microbatch ({budget}) must be >= {per_unit} x data.max_len ({max_len}) "
        f"so that {what} always fits one micro-batch",
    )


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: ChatDataConfig = field(default_factory=ChatDataConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    sft: SFTParams = field(default_factory=SFTParams)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _check_fits(self.data.max_len, self.train.max_tokens_per_microbatch, 1)
        check_offload_device(self.train, self.cluster)


@dataclass
class DPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: ChatDataConfig = field(default_factory=ChatDataConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    dpo: DPOParams = field(default_factory=DPOParams)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _check_fits(self.data.max_len, self.train.max_tokens_per_microbatch, 2)
        check_offload_device(self.train, self.cluster)


@dataclass
class RMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: ChatDataConfig = field(default_factory=ChatDataConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _check_fits(self.data.max_len, self.train.max_tokens_per_microbatch, 2)
        check_offload_device(self.train, self.cluster)


register_schema("sft_schema", SFTConfig)
register_schema("dpo_schema", DPOConfig)
register_schema("rm_schema", RMConfig)
