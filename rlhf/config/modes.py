"""Checks of how a run moves weights and samples (``rollout.weight_sync``, ``train.mode``),
which look at several config sections at once; ``rlhf.config.schema`` calls them at compose."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf.config.model import _check, _one_of

if TYPE_CHECKING:
    from rlhf.config.schema import PPOConfig

WEIGHT_SYNC_MODES = ("auto", "object_store", "nccl", "ipc")
GPU_ONLY_SYNC_MODES = ("nccl", "ipc")


def check_streaming(cfg: PPOConfig) -> None:
    """``rollout.weight_sync`` (``check_weight_sync``), and what ``train.mode=streaming`` needs:
    engines that serve many calls at once."""
    r, c = cfg.rollout, cfg.cluster
    check_weight_sync(r.weight_sync, c.device, c.colocate_engines, r.backend)
    if cfg.train.mode != "streaming":
        _check(
            not r.partial_rollouts,
            "rollout.partial_rollouts continues the requests a weight update interrupts, which only "
            "train.mode=streaming does (a batch run's update waits for its batch): set train.mode=streaming "
            "or rollout.partial_rollouts=false",
        )
        return
    _check(
        not (r.partial_rollouts and r.inflight_updates),
        "rollout.partial_rollouts=true and rollout.inflight_updates=true are two ways to land a weight update "
        "on requests in flight (recompute their prefix under the new weights, or keep its cache): set "
        "rollout.inflight_updates=false to use partial rollouts, or rollout.partial_rollouts=false",
    )
    _check(
        cfg.rollout.backend == "vllm",
        "train.mode=streaming runs many prompt groups on each engine at once, which the hf backend cannot "
        "(it serves one call at a time): set rollout.backend=vllm, or train.mode=batch",
    )
    _check(
        not cfg.cluster.colocate_engines,
        "train.mode=streaming keeps the engines generating while the trainer runs: set "
        "cluster.colocate_engines=false (or train.mode=batch)",
    )
    _check(
        cfg.env.loop != "lockstep",
        "env.loop=lockstep runs turns over a whole batch; train.mode=streaming runs each group's trajectories "
        "on their own: set env.loop=per_trajectory (or train.mode=batch)",
    )


def check_old_logprobs(cfg: PPOConfig) -> None:
    """``train.recompute_old_logprobs=false`` replaces the actor's log-probs before the update
    with the engines'; what reads the former cannot run without them."""
    if cfg.train.recompute_old_logprobs:
        return
    a = cfg.algorithm
    _check(
        a.rollout_correction == "none",
        f"algorithm.rollout_correction={a.rollout_correction} weighs the engines' log-probs against the actor's "
        "before the update, which train.recompute_old_logprobs=false no longer computes: set "
        "train.recompute_old_logprobs=true, or algorithm.rollout_correction=none",
    )
    _check(
        not (a.kl_in_reward and a.kl_coef > 0),
        "the KL penalty in the reward (algorithm.kl_in_reward with kl_coef > 0) reads the actor's log-probs "
        "before the update, which train.recompute_old_logprobs=false no longer computes: set "
        "train.recompute_old_logprobs=true, or algorithm.kl_in_reward=false (the KL as a loss term)",
    )


def check_weight_sync(mode: str, device: str, colocate_engines: bool, backend: str = "vllm") -> None:
    """Raise ValueError naming the config fields when ``mode`` cannot run on this cluster."""
    _one_of("rollout.weight_sync", mode, WEIGHT_SYNC_MODES)
    if backend == "hf" and (mode in GPU_ONLY_SYNC_MODES or colocate_engines):
        raise ValueError(
            f"rollout.backend=hf takes weights through the object store and cannot sleep, but rollout.weight_sync="
            f"{mode} and cluster.colocate_engines={str(colocate_engines).lower()}; set rollout.weight_sync=auto "
            "(or object_store) and cluster.colocate_engines=false, or use rollout.backend=vllm"
        )
    if device != "cuda" and mode in GPU_ONLY_SYNC_MODES:
        raise ValueError(
            f"rollout.weight_sync={mode} needs GPUs (NCCL / CUDA IPC) but cluster.device={device}; "
            "use rollout.weight_sync=object_store or auto"
        )
    if device != "cuda" and colocate_engines:
        raise ValueError(
            "cluster.colocate_engines=true needs cluster.device=cuda: colocated engines sleep (vLLM sleep "
            "mode, GPU only) while the trainer runs; set cluster.colocate_engines=false"
        )
    if mode == "nccl" and colocate_engines:
        raise ValueError(
            "rollout.weight_sync=nccl with cluster.colocate_engines=true puts actor rank 0 and engine 0 on one GPU, "
            "and NCCL refuses two ranks of a group on one GPU ('Duplicate GPU detected'); colocated engines take "
            "weights through CUDA IPC: set rollout.weight_sync=ipc (or auto)"
        )
    if mode == "ipc" and not colocate_engines:
        raise ValueError(
            "rollout.weight_sync=ipc shares GPU memory handles, so the engines must run on the training GPUs: "
            "set cluster.colocate_engines=true, or use rollout.weight_sync=nccl"
        )


def resolve_weight_sync(mode: str, device: str, colocate_engines: bool, backend: str = "vllm") -> str:
    """The transport ``auto`` stands for (table in ``rlhf.workers.weight_sync``); other modes are checked and kept."""
    check_weight_sync(mode, device, colocate_engines, backend)
    if backend == "hf":
        return "object_store"
    if mode != "auto":
        return mode
    if device != "cuda":
        return "object_store"
    return "ipc" if colocate_engines else "nccl"
