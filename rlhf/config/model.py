"""The ``model`` section of every trainer's config: the model directory, attention, the tiny
model built when there is none, and LoRA (``model.lora``). Re-exported by ``rlhf.config.schema``."""

from __future__ import annotations

from dataclasses import dataclass, field

ATTN_IMPLS = (
    "auto",
    "packed_sdpa",
    "packed_varlen",
    "sdpa",
    "eager",
    "flash_attention_2",
    "flash_attention_3",
)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{name}={value!r} is not valid; use one of {', '.join(allowed)}")


@dataclass
class TinyModelConfig:
    """Random-init model built at run time when ``model.path`` is empty."""

    arch: str = "llama"  # llama | qwen2 (layout of the random-init model)
    hidden_size: int = 128  # hidden width
    num_layers: int = 2  # decoder layers
    num_heads: int = 2  # attention heads
    num_kv_heads: int = 1  # key/value heads (grouped-query attention when < num_heads)
    intermediate_size: int = 256  # MLP width
    seed: int = 0  # weight init

    def __post_init__(self) -> None:
        _one_of("model.tiny.arch", self.arch, ("llama", "qwen2"))


# vLLM 0.32's LoRAConfig.max_lora_rank accepts these values only (rlhf.workers.lora_rollout).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT) on every trained model; ``rank`` 0 = full fine-tuning."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning
    alpha: float = 16.0  # scale alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input
    target_modules: list[str] = field(default_factory=list)  # [] = the architecture's projections
    modules_to_save: list[str] = field(default_factory=list)  # also trained in full (e.g. lm_head)

    def __post_init__(self) -> None:
        _check(self.rank >= 0, f"model.lora.rank must be >= 0 (0 = off), got {self.rank}")
        _check(self.alpha > 0, f"model.lora.alpha must be > 0, got {self.alpha}")
        _check(0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ModelConfig:
    path: str = ""  # HF model dir (actor/reference init); "" = build model.tiny at run time
    critic_path: str = ""  # "" = critic from model.path with a fresh value head
    # packed attention path (docs/gpu.md); auto = flash-attn, else varlen, else packed_sdpa
    attn_impl: str = "auto"
    # Ranks that split each packed row along the sequence (Ulysses, docs/long-context.md); it
    # must divide every model group's ranks and the model's attention heads. 1 = off.
    sequence_parallel_size: int = 1
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _one_of("model.attn_impl", self.attn_impl, ATTN_IMPLS)
        k = self.sequence_parallel_size
        _check(k >= 1, f"model.sequence_parallel_size must be >= 1 (1 = off), got {k}")
        _check(
            k == 1 or self.attn_impl not in ("sdpa", "eager"),
            f"model.sequence_parallel_size={k} needs a packed attention path: model.attn_impl={self.attn_impl} "
            "attends across the split row; use auto, packed_sdpa, packed_varlen or flash_attention_2",
        )

    def check_sequence_parallel_ranks(self, ranks: dict[str, int]) -> None:
        """Every model group's ranks (``{"cluster.actor_ranks": n, ...}``) split into whole groups."""
        k = self.sequence_parallel_size
        for name, n in ranks.items():
            _check(
                n % k == 0,
                f"model.sequence_parallel_size={k} must divide {name}={n} (each group of {k} ranks splits "
                f"one row); set {name} to a multiple of {k}",
            )
