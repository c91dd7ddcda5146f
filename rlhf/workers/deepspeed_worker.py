"""One data-parallel rank of a DeepSpeed-managed model (actor, critic, reference or reward).

``ModelWorker`` is a plain class; ``rlhf.workers.group.ModelGroup`` starts one instance per
rank as a Ray actor. DeepSpeed and transformers are imported inside so that the driver,
which only packs samples and gathers results, never pays for them.

Gradient accumulation is ours, not DeepSpeed's: the engine is configured with
``train_micro_batch_size_per_gpu=1`` and ``gradient_accumulation_steps=1`` (so
``engine.backward`` does not rescale the loss), and every train call marks the accumulation
boundary by hand with ``engine.set_gradient_accumulation_boundary(i == last)`` before each
backward, then calls ``engine.step()`` once: exactly one optimizer step per call, however
many packed micro-batches this rank was dealt. Loss normalisation lives in the objective
(see ``rlhf.models.objective`` and ``rlhf.trainer.objectives``).

The HF model is wrapped in ``_Call``, a parameter-less module whose forward runs a given
function on the HF model. Every forward therefore goes through ``engine.forward``, which is
what installs DeepSpeed's backward prologue (ZeRO bookkeeping) on the outputs, whatever the
function does inside (``model(...)`` for logprobs, ``model.model`` + ``model.score`` for
values).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rlhf.config.schema import DeepSpeedConfig
from rlhf.data.packing import dummy_flat_batch
from rlhf.data.types import FlatBatch
from rlhf.models.lora import LoraSettings
from rlhf.models.objective import TrainObjective
from rlhf.storage import Store, staged_read, staged_write
from rlhf.workers.placement import use_cpu_share
from rlhf.workers.weight_sync import full_shape
from rlhf.workers.worker_weights import WorkerWeights

__all__ = ["ROLES", "DeepSpeedSettings", "ModelWorker", "build_ds_config"]

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference", "reward")
# Always trainable; "reward" is trainable only with lr > 0 (reward-model training, see ModelWorker).
TRAINABLE_ROLES = ("actor", "critic")


@dataclass
class DeepSpeedSettings(DeepSpeedConfig):
    """DeepSpeed and optimizer settings of one model group: the run's ``train.*`` DeepSpeed
    fields (``DeepSpeedConfig``, validated there) plus what differs per group."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    lr_schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at total_steps)
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    dist_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError("lr_schedule='cosine' needs total_steps > warmup_steps")


def build_ds_config(s: DeepSpeedSettings, world_size: int, train: bool) -> dict[str, Any]:
    """DeepSpeed JSON config: one sample row per micro-step, accumulation handled by the worker."""
    pin = torch.cuda.is_available()
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = s.zero3_persistence_threshold
    if train and s.offload_optimizer and s.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if s.offload_param and s.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": s.bf16},
        "gradient_clipping": s.grad_clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # A client torch AdamW: DeepSpeed's fused/CPU Adam compile C++/CUDA for minutes.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if train and s.bf16 and s.zero_stage > 0:
        # Accumulating many micro-batches in bf16 loses the small ones.
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _lr_lambda(s: DeepSpeedSettings) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class _Call(torch.nn.Module):
    """Parameter-less wrapper: ``engine(fn, *args)`` runs ``fn(hf_model, *args)`` inside engine.forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


def _holds_causal_lm(model_dir: str) -> bool:
    """True when the config's ``architectures`` are all ``*ForCausalLM`` (a base LM, no score head)."""
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(model_dir), "architectures", None) or []
    return bool(archs) and all(a.endswith("ForCausalLM") for a in archs)


def _sequence_parallel_group(rank: int, world_size: int, size: int) -> Any:
    """This rank's ``SequenceParallel``: ranks ``[g k, (g+1) k)`` split the same rows.

    Every rank creates every group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    from rlhf.models.sequence_parallel import SequenceParallel

    if size < 1 or world_size % size:
        raise ValueError(f"model.sequence_parallel_size={size} must divide the group's {world_size} ranks")
    if size == 1:
        return SequenceParallel(size=1, rank=0)
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = SequenceParallel(size=size, rank=rank - start, group=group)
    return mine


class ModelWorker(WorkerWeights):
    """One rank of a model group. All ranks of a group must receive the same calls in the same order.

    Roles and what trains: ``actor`` and ``critic`` always have an optimizer; ``reference`` is
    inference-only; ``reward`` is trainable when ``settings.lr > 0`` (reward-model training,
    ``rlhf.rm``) and inference-only with ``lr == 0`` (the PPO reward model, no optimizer).
    An inference-only role refuses ``train_step`` and the checkpoint calls.

    Args:
        role: ``actor``/``reference`` (causal LM, outputs logprobs), ``critic`` (value model,
            outputs per-token values; a causal-LM dir gets a fresh ``score`` head, any other
            dir, e.g. a trained reward model or critic, keeps its own) or ``reward`` (one
            score per sample: the head on its last token). ``reward`` loads a causal-LM dir
            (config ``architectures`` all ``*ForCausalLM``) with a fresh ``score`` head, the
            start of reward-model training, and any other dir (a trained
            ``*ForSequenceClassification``) with its own head.
        model_dir: HF model directory.
        rank, world_size: rank and number of ranks of this group (``world_size /
            sequence_parallel_size`` data-parallel shards).
        master_addr, master_port: rendezvous of this group's process group.
        settings: the group's ``DeepSpeedSettings``.
        attn_impl: passed to ``rlhf.models.forward.prepare_model_for_packing``.
        seed: torch seed (value-head init, dropout).
        sequence_parallel_size: ranks that split each packed row along the sequence
            (``rlhf.models.sequence_parallel``); consecutive ranks form a group and receive
            the same micro-batches.
        log_dir: where DeepSpeed's INFO lines go (``<role>-<rank>.log``); the console keeps
            warnings. None leaves its logging as it is.
    """

    def __init__(
        self,
        role: str,
        model_dir: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        settings: DeepSpeedSettings | None = None,
        attn_impl: str = "auto",
        seed: int = 0,
        log_dir: str | None = None,
        lora: LoraSettings | None = None,
        lora_sync: str = "adapter",
        sequence_parallel_size: int = 1,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        os.environ.update(
            MASTER_ADDR=str(master_addr),
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # Ray gives each actor only its own GPU(s), so the local device is always 0.
            LOCAL_RANK="0",
        )
        import deepspeed

        from rlhf.workers.logs import route_worker_logs

        self.log_file = log_dir and f"{log_dir}/{role}-{rank}.log"
        route_worker_logs(self.log_file)
        self.role, self.model_dir, self.rank, self.world_size = role, str(model_dir), rank, world_size
        self.settings = settings or DeepSpeedSettings()
        self.trainable = role in TRAINABLE_ROLES or (role == "reward" and self.settings.lr > 0)
        # LoRA on trained models only; get_weights then yields the adapter (or the merged weights).
        # A value model's fresh score head trains in full and is saved with the adapter.
        if lora is not None and self.trainable and role != "actor":
            lora = dataclasses.replace(lora, modules_to_save=[*lora.modules_to_save, "score"])
        self.lora, self.lora_sync = (lora if self.trainable else None), lora_sync
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # DeepSpeed prints "... op built successfully" on a CPU rank's start: the worker log's, not the console's
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            deepspeed.init_distributed(
                dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                auto_mpi_discovery=False,
                verbose=False,
                timeout=timedelta(seconds=self.settings.dist_timeout_s),
            )
        if printed.getvalue().strip():
            logger.info("%s", printed.getvalue().strip())
        self.sp = _sequence_parallel_group(rank, world_size, sequence_parallel_size)
        torch.manual_seed(seed)
        self.ds_config = build_ds_config(self.settings, world_size, train=self.trainable)
        self.zero3 = self.settings.zero_stage == 3
        self.hf_model = self._build_model(attn_impl)
        self.engine = self._build_engine()

    # ------------------------------------------------------------------ setup
    def _build_model(self, attn_impl: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from rlhf.models.forward import build_value_model, prepare_model_for_packing
        from rlhf.models.sequence_parallel import enable_sequence_parallel

        dtype = torch.bfloat16 if self.settings.bf16 else torch.float32
        if self.zero3 and self.settings.zero3_init:
            if importlib.util.find_spec("accelerate") is not None:
                from transformers.integrations import HfDeepSpeedConfig

                # Alive => from_pretrained builds the model under deepspeed.zero.Init, partitioned
                # from the start, instead of every rank materialising the full model first.
                self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
            elif self.rank == 0:
                logger.warning(
                    "ZeRO-3 without zero.Init (transformers needs `accelerate` for it): every "
                    "rank loads the full model before DeepSpeed partitions it"
                )
        if self.role in ("actor", "reference"):
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        elif self.role == "critic":
            # A causal-LM dir gets a fresh value head; a reward model / critic dir keeps its own
            # (OpenRLHF initialises the critic from the reward model).
            from_lm = _holds_causal_lm(self.model_dir)
            model = build_value_model(self.model_dir, init_from_causal_lm=from_lm, dtype=dtype)
        else:
            from_lm = _holds_causal_lm(self.model_dir)
            if from_lm and not self.trainable and self.rank == 0:
                logger.warning(
                    "reward model %s is a causal LM: its score head is new and untrained, "
                    "so its scores are random",
                    self.model_dir,
                )
            model = build_value_model(self.model_dir, init_from_causal_lm=from_lm, dtype=dtype)
        if not hasattr(next(model.parameters()), "ds_id"):
            # On its device first, so that attn_impl="auto" can pick flash-attn on a GPU.
            model.to(self.device)
        if self.lora is not None:
            from rlhf.models.lora import apply_lora

            n = apply_lora(model, self.lora)
            if self.rank == 0:
                logger.info("%s: LoRA rank %d, %d trainable parameters", self.role, self.lora.rank, n)
        prepare_model_for_packing(model, attn_impl=attn_impl)
        enable_sequence_parallel(model, self.sp)
        if self.trainable and self.settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.trainable:
            model.requires_grad_(False)
        return model

    def _optimizer_groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for p in self.hf_model.parameters():
            if p.requires_grad:
                # Biases and norm weights (1-D) are not decayed, as usual for transformers.
                (decay if len(full_shape(p)) >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def _build_engine(self) -> Any:
        import deepspeed

        wrapper = _Call(self.hf_model)
        if self.trainable:
            s = self.settings
            optim = torch.optim.AdamW(
                self._optimizer_groups(),
                lr=s.lr,
                betas=s.betas,
                eps=s.eps,
                fused=self.device.type == "cuda" and not s.offload_optimizer,
            )
            sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(s))
            engine, *_ = deepspeed.initialize(
                model=wrapper, optimizer=optim, lr_scheduler=sched, config=self.ds_config
            )
            return engine
        if self.zero3:
            engine, *_ = deepspeed.initialize(model=wrapper, config=self.ds_config)
            engine.eval()
            return engine
        # Inference-only without ZeRO-3 partitioning: DeepSpeed would add nothing.
        self.hf_model.to(self.device).eval()
        return None

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.engine is not None:
            return self.engine(fn, *args)
        return fn(self.hf_model, *args)

    def _set_train(self, mode: bool) -> None:
        (self.engine if self.engine is not None else self.hf_model).train(mode)

    def info(self) -> dict[str, Any]:
        """Rank, device, parameter count and optimizer steps taken (also a readiness probe)."""
        n = sum(math.prod(full_shape(p)) for p in self.hf_model.parameters())
        steps = int(self.engine.global_steps) if self.trainable else 0
        attn = self.hf_model.config._attn_implementation
        return {
            "role": self.role,
            "rank": self.rank,
            "device": str(self.device),
            "num_params": n,
            "trainable_params": sum(
                math.prod(full_shape(p)) for p in self.hf_model.parameters() if p.requires_grad
            ),
            "global_steps": steps,
            "attn_impl": attn,
        }

    # ---------------------------------------------------------------- compute
    def _forward_fn(self, temperature: float) -> Callable[[torch.nn.Module, FlatBatch], torch.Tensor]:
        from rlhf.models import forward as fwd

        if self.role in ("actor", "reference"):

            def fn(model: torch.nn.Module, mb: FlatBatch) -> torch.Tensor:
                return fwd.packed_logprobs(model, mb, temperature=temperature)[0]

            return fn
        if self.role == "critic":
            return fwd.packed_hidden_values
        return fwd.packed_sequence_scores

    def _use_cores(self, cpu_share: float) -> None:
        """On CPU, compute with ``cpu_share`` of this node's cores: the driver knows which
        processes run at the same time (one group training alone gets them all; several
        scoring at once split them), so no phase leaves cores idle or oversubscribes them."""
        if self.device.type == "cpu":
            use_cpu_share(cpu_share)

    @torch.no_grad()
    def forward(
        self,
        micro_batches: list[FlatBatch | None],
        temperature: float = 1.0,
        cpu_share: float = 1.0,
        adapters: bool = True,
    ) -> list[torch.Tensor | None]:
        """Per-token logprobs (actor/reference), values (critic) or per-sample scores (reward).

        ``None`` slots return None; under ZeRO-3 they still run a dummy forward because the
        parameter all-gathers are collective. ``adapters=False`` runs a LoRA model's frozen
        base alone: the reference policy of a LoRA run, without a reference model.
        """
        from rlhf.models.lora import adapters_disabled

        self._use_cores(cpu_share)
        self._set_train(False)
        fn = self._forward_fn(temperature)
        out: list[torch.Tensor | None] = []
        with adapters_disabled(self.hf_model, disabled=self.lora is not None and not adapters):
            for mb in micro_batches:
                if mb is None:
                    if self.zero3:
                        self._run(fn, dummy_flat_batch(device=self.device))
                    out.append(None)
                    continue
                out.append(self._run(fn, mb.to(self.device)).detach().float().cpu())
        return out

    def train_step(
        self,
        micro_batches: list[FlatBatch | None],
        objective: TrainObjective,
        loss_normalizer: float,
        cpu_share: float = 1.0,
    ) -> dict[str, float]:
        """Accumulate gradients over ``micro_batches`` and take exactly one optimizer step.

        Args:
            micro_batches: this rank's packed micro-batches; ``None`` slots (this rank got
                fewer than others) run ``objective.dummy_batch()`` at zero weight.
            objective: a ``rlhf.models.objective.TrainObjective``.
            loss_normalizer: sum of ``objective.loss_weight(mb)`` over every micro-batch of
                the mini-batch on every rank.
            cpu_share: the share of the node's cores to compute with (CPU only).

        Returns:
            Stats of this rank: each objective stat averaged with weights ``loss_weight``,
            ``_weight`` (their sum, for averaging over ranks), ``grad_norm`` and ``lr`` (the
            learning rate this step used).
        """
        if not self.trainable:
            raise RuntimeError(
                f"the {self.role} model is inference-only{self._why_inference_only()}; "
                "train_step needs actor, critic, or reward with lr > 0"
            )
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch slot (None for a dummy)")
        self._use_cores(cpu_share)
        self._set_train(True)
        engine = self.engine
        sums: dict[str, list[float]] = {}
        weights: list[float] = []
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            engine.set_gradient_accumulation_boundary(i == last)
            if mb is None:
                batch, weight = objective.dummy_batch().to(self.device), 0.0
            else:
                batch, weight = mb.to(self.device), float(objective.loss_weight(mb))
            # DeepSpeed divides the summed gradient by world_size; the scale undoes that.
            scale = weight / loss_normalizer * self.world_size if loss_normalizer > 0 else 0.0
            loss, stats = engine(objective, batch, scale)
            engine.backward(loss)
            if mb is not None:
                weights.append(weight)
                for k, v in stats.items():
                    sums.setdefault(k, []).append(float(v))
        lr = float(engine.optimizer.param_groups[0]["lr"])
        # Without ZeRO, DeepSpeed only computes the norm when clipping; the grads are already
        # all-reduced after the boundary backward, so compute it here.
        own_norm = self._grad_norm() if self.settings.zero_stage == 0 else None
        engine.step()
        total = sum(weights)
        w = weights if total > 0 else [1.0] * len(weights)
        out = {
            k: sum(a * b for a, b in zip(w, vals, strict=True)) / max(sum(w), 1e-30)
            for k, vals in sums.items()
        }
        grad_norm = engine.get_global_grad_norm()
        grad_norm = own_norm if grad_norm is None else grad_norm
        out.update(
            _weight=total,
            _count=float(len(weights)),
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        )
        return out

    def _grad_norm(self) -> float | None:
        grads = [p.grad.detach().float() for p in self.hf_model.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, tag: str | None = None) -> None:
        """Model + optimizer + LR scheduler (the run state lives in ``trainer_state.json``). Collective.

        With LoRA only the trainable tensors (adapter, modules_to_save) and their optimizer state:
        the frozen base is reloaded from ``model_dir``."""
        self._require_engine_with_optimizer("save_checkpoint")
        with staged_write(path, f"{self.role}-{self.rank}") as local:  # a URI: upload this rank's part
            self.engine.save_checkpoint(local, tag=tag, exclude_frozen_parameters=self.lora is not None)

    def load_checkpoint(self, path: str, tag: str | None = None) -> None:
        """Restore what ``save_checkpoint`` wrote (``tag`` None = the latest)."""
        self._require_engine_with_optimizer("load_checkpoint")
        with staged_read(path, f"{self.role}-{self.rank}") as local:
            load_path, _ = self.engine.load_checkpoint(
                local,
                tag=tag,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=self.lora is None,
            )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found under {path!r} (tag {tag!r})")

    def _require_engine_with_optimizer(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(
                f"{what}: the {self.role} model is inference-only{self._why_inference_only()}; "
                "reload it from its model dir"
            )

    def _why_inference_only(self) -> str:
        return (
            f" (reward with lr={self.settings.lr}; reward-model training needs lr > 0)"
            if self.role == "reward"
            else ""
        )

    def upload_log(self, output_dir: str) -> None:
        """Copy this rank's log file to ``<output_dir>/logs/`` (a URI: logs stay on their node)."""
        if self.log_file and os.path.isfile(self.log_file):
            Store(output_dir).upload(self.log_file, f"logs/{os.path.basename(self.log_file)}")

    def shutdown(self) -> None:
        """Leave the process group (lets the actor exit cleanly)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
