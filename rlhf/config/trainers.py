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
    # A JSONL or .parquet file, or hf:NAME_OR_DIR[:SPLIT] (rlhf.data.chat documents the rows), or
    # "toy:count" (the bundled toy task, experiment=toy_chat). Required: no default data.
    path: str = ""
    # Columns: SFT reads messages_key, else prompt_key + completion_key; DPO/RM read prompt_key,
    # chosen_key and rejected_key.
    messages_key: str = "messages"
    prompt_key: str = "prompt"  # the prompt column (SFT with completion_key; DPO/RM)
    completion_key: str = "completion"  # SFT: the completion column (with prompt_key)
    chosen_key: str = "chosen"  # DPO/RM: the preferred response's column
    rejected_key: str = "rejected"  # DPO/RM: the other response's column
    max_len: int = 128  # tokens per sample (each of chosen and rejected for pairs)
    overlong: str = "error"  # error | skip (skipped rows are counted in the log)
    num_toy: int = 256  # rows of the toy task
    # samples (SFT) or pairs (DPO/RM) held out, evaluated before training and after every epoch
    eval_size: int = 0
    seed: int = 0  # toy rows, held-out split and shuffling

    def __post_init__(self) -> None:
        _one_of("data.overlong", self.overlong, ("error", "skip"))
        _check(self.max_len > 1, f"data.max_len must be > 1, got {self.max_len}")
        _check(self.num_toy >= 1, f"data.num_toy must be >= 1, got {self.num_toy}")
        _check(self.eval_size >= 0, f"data.eval_size must be >= 0, got {self.eval_size}")


@dataclass
class SupervisedTrainConfig(RunConfig):
    epochs: int = 1  # passes over the training rows
    max_steps: int = 0  # cap on optimizer steps; 0 = run every epoch to the end
    batch_size: int = 16  # samples (SFT) or pairs (DPO/RM) per optimizer step
    max_tokens_per_microbatch: int = 1024  # packing budget of one micro-batch row
    # null: what a real model survives, by trainer and by full weights / LoRA adapters
    # (DEFAULT_LR below: SFT and RM 1e-5 / 1e-4, DPO 1e-6 / 1e-5)
    lr: float | None = None
    lr_schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.0  # cosine: the last step's lr as a share of lr
    output_dir: str = "runs/sft"  # the trained model lands in <output_dir>/final

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.epochs >= 1, f"train.epochs must be >= 1, got {self.epochs}")
        _check(self.max_steps >= 0, f"train.max_steps must be >= 0 (0 = no cap), got {self.max_steps}")
        _check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        _check(self.max_tokens_per_microbatch >= 16, "train.max_tokens_per_microbatch must be >= 16")
        _check(self.lr is None or self.lr > 0, f"train.lr must be > 0, got {self.lr}")
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


# train.lr when unset: (full fine-tuning, LoRA adapters). Full-weight values are TRL's and
# OpenRLHF's defaults for 0.5-8B models; adapters take a ~10x larger step.
DEFAULT_LR: dict[str, tuple[float, float]] = {"sft": (1e-5, 1e-4), "dpo": (1e-6, 1e-5), "rm": (1e-5, 1e-4)}


# The cluster ranks each supervised trainer starts model groups on.
_RANKS = {"sft": ("actor_ranks",), "dpo": ("actor_ranks", "ref_ranks"), "rm": ("reward_ranks",)}


def _resolve(cfg, trainer: str, pairs: bool) -> None:
    """The checks every supervised config shares, and ``train.lr``'s default."""
    _check_fits(cfg.data.max_len, cfg.train.max_tokens_per_microbatch, 2 if pairs else 1)
    cfg.model.check_sequence_parallel_ranks(
        {f"cluster.{n}": getattr(cfg.cluster, n) for n in _RANKS[trainer]}
    )
    check_offload_device(cfg.train, cfg.cluster)
    if cfg.train.lr is None:
        cfg.train.lr = DEFAULT_LR[trainer][1 if cfg.model.lora.rank > 0 else 0]


def _check_data(data: ChatDataConfig, trainer: str) -> None:
    rows = (
        "chats (JSONL/Parquet rows with a messages column, or prompt and completion)"
        if trainer == "sft"
        else "preference pairs (JSONL/Parquet rows with prompt, chosen and rejected columns)"
    )
    _check(
        bool(data.path),
        f"data.path is not set: give your {rows}, e.g. data.path=path/to/train.jsonl (columns under other "
        "names: data.prompt_key=...), or run the bundled toy task with experiment=toy_chat",
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

    def check_required(self) -> None:
        """What no default may stand in for (the data); ``rlhf.config.to_object`` calls it."""
        _check_data(self.data, "sft")

    def __post_init__(self) -> None:
        _resolve(self, "sft", pairs=False)


@dataclass
class DPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: ChatDataConfig = field(default_factory=ChatDataConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    dpo: DPOParams = field(default_factory=DPOParams)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def check_required(self) -> None:
        """What no default may stand in for (the data); ``rlhf.config.to_object`` calls it."""
        _check_data(self.data, "dpo")

    def __post_init__(self) -> None:
        _resolve(self, "dpo", pairs=True)


@dataclass
class RMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: ChatDataConfig = field(default_factory=ChatDataConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def check_required(self) -> None:
        """What no default may stand in for (the data); ``rlhf.config.to_object`` calls it."""
        _check_data(self.data, "rm")

    def __post_init__(self) -> None:
        _resolve(self, "rm", pairs=True)


register_schema("sft_schema", SFTConfig)
register_schema("dpo_schema", DPOConfig)
register_schema("rm_schema", RMConfig)
