"""Typed Hydra config: dataclass schemas registered in Hydra's ConfigStore.

YAML groups in ``conf/`` fill these schemas; an unknown key or a value of the wrong type
fails when Hydra composes the config, and ``__post_init__`` checks run when
``rlhf.config.to_object`` turns the composed config into these dataclasses, each naming the
field and the fix. Where things run (``cluster``) is separate from what they do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.algorithms.correction import CORRECTION_LEVELS, CORRECTION_MODES
from rlhf.algorithms.registry import ESTIMATORS, POLICY_LOSSES

# The model section lives in rlhf/config/model.py; re-exported here with the other sections.
from rlhf.config.env import EnvConfig  # noqa: F401
from rlhf.config.model import (  # noqa: F401
    ATTN_IMPLS,
    VLLM_LORA_RANKS,
    LoraConfig,
    ModelConfig,
    TinyModelConfig,
    _check,
    _one_of,
)
from rlhf.config.modes import (  # noqa: F401
    GPU_ONLY_SYNC_MODES,
    WEIGHT_SYNC_MODES,
    check_old_logprobs,
    check_streaming,
    check_weight_sync,
    resolve_weight_sync,
)

KL_KINDS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
ROLLOUT_BACKENDS = ("vllm", "hf")
PLACEMENT_STRATEGIES = ("pack", "spread", "strict_spread")


@dataclass
class DataConfig:
    # A JSONL or .parquet file, or hf:NAME_OR_DIR[:SPLIT] (a datasets hub name or save_to_disk
    # dir), or "toy:count" (the bundled toy task, experiment=toy_count). Required: no default
    # data stands in for the user's. Other columns reach the reward as info[...].
    prompts: str = ""
    prompt_key: str = "prompt"  # the prompt column: a string, or a list of chat messages
    label_key: str = ""  # a column every row must have (e.g. "answer"); "" = no check
    num_toy_prompts: int = 256  # rows of the toy task (data.prompts=toy:count)
    max_prompt_len: int = 64  # tokens; longer prompts follow overlong_prompts
    overlong_prompts: str = "error"  # error | skip (the number skipped is logged at start-up)
    seed: int = 0  # toy rows and prompt order

    def __post_init__(self) -> None:
        _one_of("data.overlong_prompts", self.overlong_prompts, ("error", "skip"))
        _check(self.max_prompt_len > 0, "data.max_prompt_len must be > 0")


@dataclass
class RolloutConfig:
    # vllm | hf: what samples (rlhf.workers.rollout / rlhf.workers.hf_rollout); hf is faster for
    # tiny models on CPU, where vLLM's per-step scheduling outweighs the model, and needs no vLLM
    backend: str = "vllm"
    num_engines: int = 1  # rollout engine actors (vLLM or hf), each with the whole model
    max_model_len: int = 128  # prompt + response tokens per sequence (all turns of a trajectory)
    max_new_tokens: int = 16  # tokens per response (per turn in multi-turn runs)
    n_samples_per_prompt: int = 4  # responses per prompt (a group, for grpo/rloo)
    temperature: float = 1.0  # sampling temperature (logprobs are of the tempered distribution)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = -1  # -1 = off
    dtype: str = "float32"  # engine weights: float32 | bfloat16 (GPU)
    gpu_memory_utilization: float = 0.5  # vLLM's share of the GPU memory (weights + KV cache)
    enforce_eager: bool = True  # true = no CUDA graphs (faster start; false for speed on GPU)
    max_restarts: int = 1  # engine restarts per generate call before a step fails
    # auto | object_store | nccl | ipc: how the actor's weights reach the engines (rlhf.workers.weight_sync)
    weight_sync: str = "auto"
    sync_bucket_mb: int = 256  # gathered (ZeRO-3) and sent per bucket, never one call per tensor
    sleep_level: int = 1  # colocated engines: 1 = weights to CPU + drop KV, 2 = drop both
    # model.lora: adapter = engines serve the frozen base + the synced adapter (vLLM LoRA);
    # merged = the adapter folded into full weights, synced like full fine-tuning
    lora_sync: str = "adapter"
    # train.mode=streaming: most prompt groups generating at once (0 = as many as
    # train.max_staleness admits: rollout_batch_size x (max_staleness + 1))
    max_in_flight: int = 0
    # train.mode=streaming: new weights reach the engines between two engine steps, requests in
    # flight included (their later tokens sampled under the new version); false = a request
    # finishes under the weights it started with (the update waits for it)
    inflight_updates: bool = True
    # train.mode=streaming with inflight_updates=false: a weight update aborts the requests in
    # flight and continues each with its tokens so far as a new prompt under the new weights
    # (that prefix computed again; the prefix cache stays on) instead of waiting for them:
    # verl's partial rollouts
    partial_rollouts: bool = False

    def __post_init__(self) -> None:
        _check(self.max_in_flight >= 0, f"rollout.max_in_flight must be >= 0, got {self.max_in_flight}")
        _check(self.num_engines >= 1, "rollout.num_engines must be >= 1")
        _check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _check(
            self.temperature > 0,
            "rollout.temperature must be > 0 for RL (sampling), got "
            f"{self.temperature}; greedy rollouts give no exploration",
        )
        _check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _one_of("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        _one_of("rollout.lora_sync", self.lora_sync, ("adapter", "merged"))
        _one_of("rollout.weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        _check(self.sync_bucket_mb > 0, f"rollout.sync_bucket_mb must be > 0, got {self.sync_bucket_mb}")
        _check(
            self.sleep_level in (1, 2), f"rollout.sleep_level={self.sleep_level!r} is not valid; use 1 or 2"
        )


@dataclass
class RewardConfig:
    type: str = "function"  # function | model
    # "module:fn" or "path/to/file.py:fn"; "" = none (then a reward model or an env reward must score)
    function: str = ""
    # Several functions summed with weights (each logged as reward/<fn>); either this or `function`.
    functions: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # [] = 1 each
    timeout_s: float = 60.0  # longest one reward call (one sample, or one batch) may take
    # math_verify_reward: one check's budget; past it the check is stopped (its process killed),
    # the sample scores 0 and counts in reward/verify_timeouts
    verify_timeout_s: float = 5.0
    model_path: str = ""  # sequence-classification dir when type=model
    non_finite: str = "error"  # error | drop: what a NaN/inf score does
    # fail | zero | drop: what a reward call that raises does (zero and drop count in reward/errors)
    on_error: str = "fail"
    # the column the built-in verifiers read the label from; "" = data.label_key, else "answer"
    label_key: str = ""
    clip: float = 10.0  # |score| clip after validation (0 = off)

    def __post_init__(self) -> None:
        _one_of("reward.type", self.type, ("function", "model"))
        _one_of("reward.non_finite", self.non_finite, ("error", "drop"))
        _one_of("reward.on_error", self.on_error, ("fail", "zero", "drop"))
        _check(self.timeout_s > 0, f"reward.timeout_s must be > 0, got {self.timeout_s}")
        _check(
            0 < self.verify_timeout_s < self.timeout_s,
            f"reward.verify_timeout_s={self.verify_timeout_s:g} must be > 0 and below reward.timeout_s="
            f"{self.timeout_s:g}: a math-verify check past its budget scores 0, a reward call past "
            "reward.timeout_s fails the step",
        )
        _check(
            not self.weights or len(self.weights) == len(self.functions),
            f"reward.weights has {len(self.weights)} entries for {len(self.functions)} reward.functions",
        )
        _check(
            not (self.function and self.functions),
            f"reward.function={self.function!r} and reward.functions={list(self.functions)} are both set, and "
            "only one can score the run: put every function in reward.functions (with reward.weights), or "
            "clear the list with reward.functions=[] to use reward.function alone",
        )
        if self.type == "function":
            for spec in self.specs:
                _check(
                    ":" in spec,
                    f"reward.function={spec!r} must look like 'module:fn' or 'path/to/file.py:fn'",
                )
        else:
            _check(
                bool(self.model_path),
                "reward.type=model needs reward.model_path (a reward-model dir "
                "trained with `python -m rlhf.rm`)",
            )

    @property
    def specs(self) -> list[str]:
        """The reward functions that score the run (``functions``, else ``function``; [] = none)."""
        return list(self.functions) or ([self.function] if self.function else [])


@dataclass
class EvalConfig:
    """Held-out evaluation on the rollout engines (rlhf.trainer.evaluation)."""

    prompts: str = ""  # same formats as data.prompts; "" = off
    prompt_key: str = ""  # the prompt column of eval.prompts; "" = data.prompt_key
    label_key: str = ""  # a column every eval row must have; "" = data.label_key
    every: int = 0  # also every N steps (0 = only before the first step and after the last)
    n_samples: int = 1  # samples per prompt at the rollout temperature for pass@k (1 = greedy only)
    success_threshold: float = 1.0  # a response whose reward is >= this counts as correct
    max_prompts: int = 0  # evaluate on the first N prompts only (0 = all)

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every must be >= 0 (0 = before the first step and after the last)")
        _check(self.n_samples >= 1, "eval.n_samples must be >= 1")
        _check(self.max_prompts >= 0, "eval.max_prompts must be >= 0 (0 = all)")


@dataclass
class AlgorithmConfig:
    """What the RL step computes. Estimators and policy losses are the rows of
    ``rlhf.algorithms.registry``; conventions are in docs/algorithms.md."""

    advantage: str = "gae"  # a name in rlhf.algorithms.registry.ESTIMATORS
    policy_loss: str = "ppo"  # ppo | gspo (rlhf.algorithms.registry.POLICY_LOSSES)
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.01  # weight of KL(pi || ref); 0 = no reference model
    kl_kind: str = "k1"  # k1 | k2 | k3 estimator of the KL (Schulman's)
    kl_in_reward: bool = True  # False = KL as a loss term (GRPO style)
    kl_clamp: float = 10.0  # |KL estimate| per token is clamped to this (verl/OpenRLHF); 0 = off
    clip_eps_low: float = 0.2  # PPO ratio clip below 1 - clip_eps_low
    clip_eps_high: float = 0.2  # above 1 + clip_eps_high (DAPO's clip-higher: 0.28)
    dual_clip: float = 0.0  # 0 = off; else e.g. 3.0
    value_clip: float = 0.2  # critic value clip around the old values; 0 = off
    entropy_coef: float = 0.0  # entropy bonus weight; 0 = entropy only logged
    loss_aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum
    normalize_advantages: bool = True  # whiten advantages over the batch's action tokens
    # Training-inference mismatch: none | tis (truncate pi_old/pi_rollout at tis_cap) |
    # mis (weight 0 where it leaves [mis_low, mis_high]); per token, sequence or geometric mean.
    rollout_correction: str = "none"
    rollout_correction_level: str = "token"  # token | sequence | geometric
    tis_cap: float = 2.0  # tis: importance weights above this are truncated
    mis_low: float = 0.5  # mis: tokens whose weight is below this get none
    mis_high: float = 2.0  # mis: tokens whose weight is above this get none
    # DAPO dynamic sampling: drop groups whose scores are all equal and generate more prompts,
    # at most dynamic_sampling_max_rounds generation rounds per step (then train on what there is).
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 10  # generation rounds per step at most
    # DAPO overlong shaping: a linear penalty up to -overlong_penalty over the last
    # overlong_buffer_frac * rollout.max_new_tokens tokens (0 = off; DAPO: 4096 of 20480 = 0.2).
    overlong_buffer_frac: float = 0.0
    overlong_penalty: float = 1.0  # the penalty at the very last token
    overlong_filter: bool = False  # True = samples cut by max_new_tokens get no policy loss

    def __post_init__(self) -> None:
        _one_of("algorithm.advantage", self.advantage, tuple(ESTIMATORS))
        _one_of("algorithm.policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        _one_of("algorithm.kl_kind", self.kl_kind, KL_KINDS)
        _one_of("algorithm.loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        _one_of("algorithm.rollout_correction", self.rollout_correction, CORRECTION_MODES)
        _one_of("algorithm.rollout_correction_level", self.rollout_correction_level, CORRECTION_LEVELS)
        _check(
            0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma and algorithm.lam must be in [0, 1]"
        )
        _check(self.dual_clip == 0 or self.dual_clip > 1, "algorithm.dual_clip must be 0 (off) or > 1")
        _check(
            self.dual_clip == 0 or POLICY_LOSSES[self.policy_loss].supports_dual_clip,
            f"algorithm.policy_loss={self.policy_loss} has no dual clip: set algorithm.dual_clip=0",
        )
        _check(
            self.clip_eps_low >= 0 and self.clip_eps_high >= 0 and self.clip_eps_low < 1,
            "algorithm.clip_eps_low must be in [0, 1) and algorithm.clip_eps_high >= 0",
        )
        _check(self.kl_clamp >= 0, "algorithm.kl_clamp must be >= 0 (0 = no clamp)")
        _check(self.tis_cap >= 1, f"algorithm.tis_cap must be >= 1, got {self.tis_cap}")
        _check(
            0 <= self.mis_low < 1 < self.mis_high,
            f"algorithm.mis_low/mis_high must satisfy 0 <= mis_low < 1 < mis_high, got "
            f"{self.mis_low}/{self.mis_high}",
        )
        _check(self.dynamic_sampling_max_rounds >= 1, "algorithm.dynamic_sampling_max_rounds must be >= 1")
        _check(
            0 <= self.overlong_buffer_frac <= 1,
            f"algorithm.overlong_buffer_frac must be in [0, 1] (0 = off), got {self.overlong_buffer_frac}",
        )

    def overlong_buffer_len(self, max_new_tokens: int) -> int:
        """Tokens of the overlong penalty ramp (0 = shaping off)."""
        if self.overlong_buffer_frac == 0:
            return 0
        return max(1, round(self.overlong_buffer_frac * max_new_tokens))

    @property
    def estimator(self):
        return ESTIMATORS[self.advantage]

    @property
    def uses_critic(self) -> bool:
        return self.estimator.uses_critic


@dataclass
class DeepSpeedConfig:
    """The ``train.*`` DeepSpeed fields every trainer shares (PPO, SFT, DPO, RM); the run
    assembly (``rlhf.trainer.setup.deepspeed_settings``) hands them to each model group as
    ``rlhf.workers.deepspeed_worker.DeepSpeedSettings``, a subclass of this one."""

    zero_stage: int = 2  # 0 | 1 | 2 | 3 (DeepSpeed ZeRO)
    bf16: bool = False  # bfloat16 training (GPU); false = fp32
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # 0 = no clipping
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr
    gradient_checkpointing: bool = False  # recompute activations in backward (long rows on GPU)
    offload_optimizer: bool = False  # ZeRO >= 1: optimizer state in CPU memory (GPU runs)
    offload_param: bool = False  # ZeRO-3: parameters in CPU memory (GPU runs)
    zero3_init: bool = True  # ZeRO-3: build the model partitioned (deepspeed.zero.Init)
    # ZeRO-3: parameters with fewer elements stay whole on every rank (DeepSpeed's default 1e5).
    zero3_persistence_threshold: int = 100_000

    def __post_init__(self) -> None:
        _check(self.zero_stage in (0, 1, 2, 3), "train.zero_stage must be 0, 1, 2 or 3")
        _check(self.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = no clipping)")
        _check(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _check(
            not self.offload_optimizer or self.zero_stage >= 1,
            "train.offload_optimizer needs train.zero_stage >= 1",
        )
        _check(not self.offload_param or self.zero_stage == 3, "train.offload_param needs train.zero_stage=3")
        _check(self.zero3_persistence_threshold >= 0, "train.zero3_persistence_threshold must be >= 0")


def check_offload_device(train: DeepSpeedConfig, cluster: ClusterConfig) -> None:
    """Offload moves state from GPU memory to CPU memory: on a CPU run it would do nothing."""
    _check(
        cluster.device == "cuda" or not (train.offload_optimizer or train.offload_param),
        "train.offload_optimizer/offload_param move state off the GPU; with cluster.device=cpu set them to false",
    )


RESUME_MODES = ("auto", "true", "false")


@dataclass
class RunConfig(DeepSpeedConfig):
    """What every trainer's run shares besides DeepSpeed: where it writes, checkpoints,
    resuming and stopping (``rlhf.trainer.run_control``)."""

    seed: int = 0  # sampling seeds, shuffling and init derive from it
    # checkpoints, final model, metrics.jsonl, logs/; or a storage URI (s3://...)
    output_dir: str = "runs/ppo"
    # auto = continue from <output_dir>/checkpoints/latest when there is one (a restarted job
    # resumes); true = there must be one; false = start at step 0 (an earlier run's
    # checkpoints stay on disk, no longer `latest`).
    resume: str = "auto"
    save_every: int = 0  # also checkpoint every N steps (0 = off)
    save_every_min: float = 5.0  # also checkpoint when this many minutes passed since the last (0 = off)
    keep_checkpoints: int = 3  # newest checkpoints kept on disk (0 = all)
    # SIGTERM/SIGINT: finish or set aside the step in flight, checkpoint and exit within this
    # many seconds (Kubernetes kills a pod 30 s after SIGTERM by default).
    stop_grace_s: float = 25.0
    tensorboard: bool = True  # write <output_dir>/tensorboard
    wandb_project: str = ""  # "" = wandb off
    save_merged: bool = False  # model.lora: also write <output_dir>/final_merged (adapter folded in)

    def __post_init__(self) -> None:
        super().__post_init__()
        # YAML/CLI `true`/`false` arrive here as "True"/"False".
        self.resume = str(self.resume).lower()
        _one_of("train.resume", self.resume, RESUME_MODES)
        _check(bool(self.output_dir), "train.output_dir must not be empty")
        _check(self.save_every >= 0, "train.save_every must be >= 0 (0 = off)")
        _check(self.save_every_min >= 0, "train.save_every_min must be >= 0 (0 = off)")
        _check(self.keep_checkpoints >= 0, "train.keep_checkpoints must be >= 0 (0 = keep all)")
        _check(self.stop_grace_s > 0, f"train.stop_grace_s must be > 0, got {self.stop_grace_s}")


@dataclass
class TrainConfig(RunConfig):
    num_steps: int = 20  # RL steps (one rollout batch and its updates each)
    rollout_batch_size: int = 8  # prompts per step (x n_samples_per_prompt samples)
    ppo_epochs: int = 1  # passes over each rollout batch
    num_minibatches: int = 1  # optimizer steps per epoch
    max_tokens_per_microbatch: int = 2048  # packing budget: tokens per packed row of one forward
    actor_lr: float = 1e-3  # policy learning rate (constant after warmup)
    critic_lr: float = 1e-3  # value model learning rate (gae)
    # 0 = synchronous; k >= 1 = the engines generate up to k steps ahead of the trainer
    # (one-step-off for k=1): their weights are at most k versions old, nothing is discarded.
    max_staleness: int = 0
    # batch: each step generates (or, with max_staleness >= 1, has generated ahead) a whole
    # batch; streaming: prompt groups stream through the engines and a step takes the next
    # finished ones (rlhf.trainer.streaming), staleness bounded by max_staleness
    mode: str = "batch"
    # false: where the PPO ratio needs a denominator the train step cannot take from its own
    # forward (max_staleness >= 1, ppo_epochs or num_minibatches > 1), use the engines' sampling
    # log-probs of every sample (the behaviour policy, as PipelineRL and slime do) instead of a
    # scoring forward of the actor: one forward less per step. Needs
    # algorithm.rollout_correction=none and no KL in the reward (both read the actor's log-probs).
    recompute_old_logprobs: bool = True
    rollout_timeout_s: float = 3600.0  # longest wait for a rollout batch or for the engines
    # A model group or engine whose process died (killed, OOM-killed, node lost): rebuild all
    # workers and continue from the last checkpoint, at most this many times per run.
    max_recoveries: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.num_steps >= 1, "train.num_steps must be >= 1")
        _check(
            self.max_staleness >= 0,
            f"train.max_staleness must be >= 0 (0 = synchronous), got {self.max_staleness}",
        )
        _check(self.rollout_timeout_s > 0, "train.rollout_timeout_s must be > 0")
        _one_of("train.mode", self.mode, ("batch", "streaming"))
        _check(self.rollout_batch_size >= 1, "train.rollout_batch_size must be >= 1")
        _check(self.max_tokens_per_microbatch >= 16, "train.max_tokens_per_microbatch must be >= 16")
        _check(self.max_recoveries >= 0, f"train.max_recoveries must be >= 0, got {self.max_recoveries}")


# The cluster field holding each model role's number of ranks.
RANK_FIELDS = {
    "actor": "actor_ranks",
    "reference": "ref_ranks",
    "critic": "critic_ranks",
    "reward": "reward_ranks",
}


@dataclass
class ClusterConfig:
    """Where things run: Ray address, device, ranks and placement."""

    address: str = ""  # "" = start a local Ray; "auto" = join the running cluster
    num_cpus: int = 8  # logical CPUs for a local Ray (may exceed physical cores)
    device: str = "cpu"  # cpu | cuda
    actor_ranks: int = 1  # DeepSpeed ranks (processes) of the policy
    critic_ranks: int = 1  # ranks of the critic (gae)
    ref_ranks: int = 1  # ranks of the reference model (KL)
    reward_ranks: int = 1  # ranks of the reward model (reward.type=model)
    colocate: bool = True  # all training roles share one placement group's bundles
    # Engines on the training GPUs (engine i on bundle i), sleeping while the trainer runs. GPU only.
    colocate_engines: bool = False
    cpus_per_worker: float = 1.0  # Ray CPUs per DeepSpeed rank
    gpus_per_worker: float = 0.0  # Ray GPUs per DeepSpeed rank
    cpus_per_engine: float = 1.0  # Ray CPUs per rollout engine
    gpus_per_engine: float = 0.0  # Ray GPUs per rollout engine (a fraction shares a GPU)
    # Longest wait for the cluster to grant the run's CPUs/GPUs and for engines and ranks to start.
    startup_timeout_s: float = 300.0
    # pack | spread | strict_spread: how the bundles of each model group's placement group lie
    # over the nodes (pack = as few nodes as possible; strict_spread = one rank per node)
    placement_strategy: str = "pack"
    engine_placement_strategy: str = ""  # the rollout engines' placement group; "" = placement_strategy
    # A local Ray (address ""): start attempts go on this long (at least one retry), since Ray
    # gives its own processes a fixed 30 s to come up and a loaded machine can miss that.
    ray_start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _one_of("cluster.device", self.device, ("cpu", "cuda"))
        for name in ("actor_ranks", "critic_ranks", "ref_ranks", "reward_ranks"):
            _check(getattr(self, name) >= 1, f"cluster.{name} must be >= 1")
        _check(self.startup_timeout_s > 0, "cluster.startup_timeout_s must be > 0")
        _check(self.ray_start_timeout_s > 0, "cluster.ray_start_timeout_s must be > 0")
        _one_of("cluster.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.engine_placement_strategy:
            _one_of("cluster.engine_placement_strategy", self.engine_placement_strategy, PLACEMENT_STRATEGIES)

    def strategy(self, group: str) -> str:
        """Ray's name of the placement strategy for ``group`` (a role, ``all`` or ``engines``)."""
        s = self.engine_placement_strategy if group == "engines" else ""
        return (s or self.placement_strategy).upper()


@dataclass
class PPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def label_key(self) -> str:
        """The column the built-in verifiers read (``reward.label_key``, else ``data.label_key``,
        else ``answer``); eval rows carry their label (``eval.label_key``) under this name too."""
        return self.reward.label_key or self.data.label_key or "answer"

    @property
    def old_logprobs_are_current(self) -> bool:
        """One optimizer step per batch, on samples of the current weights, and nothing reads
        the old logprobs before it (no KL in the reward, no rollout correction): the PPO
        ratio's denominator is then the policy's own logprob in that step, so the actor's
        scoring forward is skipped (ratio 1 by construction, as TRL does with one iteration)."""
        a, t = self.algorithm, self.train
        return (
            t.ppo_epochs == 1
            and t.num_minibatches == 1
            and t.max_staleness == 0
            and a.rollout_correction == "none"
            and not (a.kl_in_reward and a.kl_coef > 0)
        )

    @property
    def old_logprobs_from_rollout(self) -> bool:
        """``train.recompute_old_logprobs=false`` where the actor's scoring forward would run:
        every sample's PPO denominator is then its engine log-probs (``rollout_logprobs``)."""
        return not self.train.recompute_old_logprobs and not self.old_logprobs_are_current

    @property
    def reference_is_actor_base(self) -> bool:
        """LoRA with a KL term: the reference log-probs come from the actor with its adapters off,
        so no reference group is built."""
        return self.model.lora.enabled and self.algorithm.kl_coef > 0

    @property
    def syncs_adapter(self) -> bool:
        """LoRA with adapter-only sync (``rollout.lora_sync=adapter``)."""
        return self.model.lora.enabled and self.rollout.lora_sync == "adapter"

    @property
    def weight_sync_mode(self) -> str:
        """The transport of every sync: ``rollout.weight_sync`` resolved, except that adapters
        always travel through the object store (vLLM's NCCL/IPC weight transfer carries full
        weights only; an adapter is a few MB)."""
        r, c = self.rollout, self.cluster
        if self.syncs_adapter:
            return "object_store"
        return resolve_weight_sync(r.weight_sync, c.device, c.colocate_engines, r.backend)

    def check_required(self) -> None:
        """What a run needs and no default may stand in for: the user's prompts and a reward.

        Not in ``__post_init__``: Hydra builds the schema's own defaults when it registers it.
        ``rlhf.config.to_object`` calls this on every composed config."""
        _check(
            bool(self.data.prompts),
            "data.prompts is not set: give your prompts (data.prompts=path/to/train.parquet or .jsonl, or "
            "hf:NAME[:SPLIT]) and their column (data.prompt_key), or run the bundled toy task with "
            "experiment=toy_count",
        )
        _check(
            self.reward.type == "model" or bool(self.reward.specs) or bool(self.env.name),
            "no reward: nothing would score the samples. Set reward.function=path/to/file.py:fn (fn(prompt, "
            "response, info) -> float; built-ins in rlhf.rewards.verifiers, e.g. "
            "rlhf.rewards.verifiers:math_verify_reward), or reward.functions=[...] with reward.weights=[...], "
            "or reward.type=model reward.model_path=DIR, or env.name=module:Class for an environment that "
            "returns the reward",
        )
        _check(
            not self.env.tools or self.reward.type == "model" or bool(self.reward.specs),
            "env.tools: the tool environment ends a trajectory at the final answer without a reward of its own; "
            "set reward.function (a verifier of that answer, e.g. rlhf.rewards.verifiers:math_verify_reward)",
        )

    def model_roles(self) -> list[str]:
        """The DeepSpeed model groups this run starts, actor first."""
        a = self.algorithm
        roles = ["actor"]
        if a.kl_coef > 0 and not self.reference_is_actor_base:
            roles.append("reference")
        if a.uses_critic:
            roles.append("critic")
        if self.reward.type == "model":
            roles.append("reward")
        return roles

    def __post_init__(self) -> None:
        check_offload_device(self.train, self.cluster)
        check_streaming(self)  # and rollout.weight_sync
        check_old_logprobs(self)
        r, c = self.rollout, self.cluster
        self.model.check_sequence_parallel_ranks(
            {f"cluster.{RANK_FIELDS[r]}": getattr(c, RANK_FIELDS[r]) for r in self.model_roles()}
        )
        if c.colocate_engines:
            _check(
                c.colocate,
                "cluster.colocate_engines=true puts engines on the shared training bundles: set cluster.colocate=true",
            )
            _check(
                r.num_engines <= max(c.actor_ranks, c.critic_ranks, c.ref_ranks, c.reward_ranks),
                f"cluster.colocate_engines=true puts engine i on training bundle i: rollout.num_engines "
                f"({r.num_engines}) must be <= the largest cluster.*_ranks",
            )
            _check(
                resolve_weight_sync(r.weight_sync, c.device, True, r.backend) != "ipc"
                or r.num_engines <= c.actor_ranks,
                f"rollout.weight_sync=ipc: engine i opens the CUDA IPC handles of actor rank i, on its own GPU, so "
                f"rollout.num_engines ({r.num_engines}) must be <= cluster.actor_ranks ({c.actor_ranks}); "
                "lower rollout.num_engines or raise cluster.actor_ranks",
            )
            _check(
                self.train.max_staleness == 0,
                "cluster.colocate_engines=true: engines sleep while the trainer uses their GPUs, so they cannot "
                "generate ahead; set train.max_staleness=0 (or cluster.colocate_engines=false)",
            )
        if self.syncs_adapter:
            _check(
                r.backend == "vllm",
                "rollout.lora_sync=adapter needs vLLM engines (their LoRA support); with rollout.backend=hf set "
                "rollout.lora_sync=merged (the adapter folded into full weights)",
            )
            _check(
                not self.model.lora.modules_to_save,
                "model.lora.modules_to_save trains whole modules that vLLM's LoRA cannot serve: "
                "set rollout.lora_sync=merged",
            )
            _check(
                self.model.lora.rank <= VLLM_LORA_RANKS[-1],
                f"model.lora.rank={self.model.lora.rank} is above the largest adapter rank vLLM serves "
                f"({VLLM_LORA_RANKS[-1]}): lower it, or set rollout.lora_sync=merged (full weights to the engines)",
            )
        a = self.algorithm
        if a.estimator.compares_group:
            _check(
                self.rollout.n_samples_per_prompt >= 2,
                f"algorithm.advantage={a.advantage} compares samples of the same prompt: "
                "set rollout.n_samples_per_prompt >= 2",
            )
        if a.dynamic_sampling:
            _check(
                self.rollout.n_samples_per_prompt >= 2,
                "algorithm.dynamic_sampling keeps groups whose scores differ: set rollout.n_samples_per_prompt >= 2",
            )
        if a.overlong_buffer_frac > 0:
            _check(
                a.overlong_buffer_len(self.rollout.max_new_tokens) < self.rollout.max_new_tokens,
                f"algorithm.overlong_buffer_frac={a.overlong_buffer_frac} leaves no unpenalised length "
                f"below rollout.max_new_tokens={self.rollout.max_new_tokens}: use a value below 1",
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
