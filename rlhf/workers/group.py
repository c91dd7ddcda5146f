"""A data-parallel DeepSpeed model on Ray: one ``ModelWorker`` actor per rank.

The driver speaks ``list[Sample]`` (the data contract, ``rlhf.data.types``). For every call
it packs the samples into micro-batches under a token budget (``rlhf.data.packing.pack``),
deals them to the ranks (``balance_bins``, so every rank gets *different* data and about
the same number of tokens), pads the shorter ranks' lists with ``None`` (dummy,
zero-weight passes that keep the collectives in step), runs all ranks in parallel and
scatters the outputs back to the input order through ``FlatBatch.sample_index``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf.data.packing import balance_bins, pack, unpack
from rlhf.data.types import FlatBatch, Sample
from rlhf.workers.deepspeed_worker import ROLES, DeepSpeedSettings, ModelWorker
from rlhf.workers.placement import Placement

__all__ = ["ModelGroup"]

logger = logging.getLogger(__name__)

# Ports handed out by this driver: a port is only bound once rank 0 starts, seconds later,
# so two groups created back to back could otherwise be given the same one.
_ISSUED_PORTS: set[int] = set()


def _free_port(exclude: Sequence[int] = ()) -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
    raise RuntimeError("could not find a free TCP port for the DeepSpeed rendezvous")


@ray.remote(num_cpus=0)
def _remote_free_port(exclude: list[int]) -> int:
    return _free_port(exclude)


def _split_evenly(n: int, parts: int) -> list[range]:
    """``parts`` contiguous chunks of ``range(n)`` whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _combine_rank_stats(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average objective stats over ranks weighted by each rank's loss weight."""
    total = sum(s["_weight"] for s in per_rank)
    key = "_weight" if total > 0 else "_count"
    denom = sum(s[key] for s in per_rank)
    out: dict[str, float] = {}
    for name in per_rank[0]:
        if name.startswith("_") or name in ("lr", "grad_norm"):
            continue
        vals = [(s[key], s[name]) for s in per_rank if name in s and s[key] > 0]
        if vals and denom > 0:
            out[name] = sum(w * v for w, v in vals) / denom
    # The optimizer state is global: rank 0 speaks for all.
    out["lr"], out["grad_norm"] = per_rank[0]["lr"], per_rank[0]["grad_norm"]
    return out


class ModelGroup:
    """``num_ranks`` DeepSpeed ranks of one model role, driven with ``list[Sample]``.

    Args:
        role: ``actor``, ``critic``, ``reference`` or ``reward`` (see ``ModelWorker``).
        model_dir: HF model directory (a causal LM; for reward, a sequence-classification model,
            or a causal LM to start reward-model training from).
        num_ranks: data-parallel size.
        ds_cfg: ``DeepSpeedSettings`` fields (dict or instance); a ``reward`` group trains only
            with ``lr > 0``.
        placement: where the ranks run; default: anywhere on the driver's node, 1 CPU each.
        attn_impl: attention implementation for the packed forward.
        seed: torch seed on every rank.
        env_vars: extra environment variables for the worker processes.
    """

    def __init__(
        self,
        role: str,
        model_dir: str,
        num_ranks: int,
        ds_cfg: dict[str, Any] | DeepSpeedSettings | None = None,
        placement: Placement | None = None,
        attn_impl: str = "auto",
        seed: int = 0,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.role, self.num_ranks = role, num_ranks
        self.placement = placement or Placement()
        self.placement.check(num_ranks)
        ds = DeepSpeedSettings.from_dict(ds_cfg).to_dict()
        master_addr, master_port = self._rendezvous()
        env = {
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(max(1, int(self.placement.num_cpus))),
        }
        if not self.placement.uses_gpu:
            env["DS_ACCELERATOR"] = "cpu"
        env.update(env_vars or {})
        remote_cls = ray.remote(ModelWorker)
        self.workers = []
        for r in range(num_ranks):
            opts = self.placement.actor_options(r)
            if self.placement.pg is None:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._driver_node, soft=False)
            self.workers.append(
                remote_cls.options(**opts, runtime_env={"env_vars": env}).remote(
                    role, str(model_dir), r, num_ranks, master_addr, master_port, ds, attn_impl, seed
                )
            )
        try:
            self.infos = ray.get([w.info.remote() for w in self.workers])
        except Exception:
            # The ranks that did start would wait in the rendezvous until the dist timeout.
            for w in self.workers:
                ray.kill(w)
            raise

    def _rendezvous(self) -> tuple[str, int]:
        """Address and a free port on the node of rank 0."""
        self._driver_node = ray.get_runtime_context().get_node_id()
        pg = self.placement.pg
        node = self._driver_node
        if pg is not None:
            node = placement_group_table(pg)["bundles_to_node_id"][self.placement.bundle_indices[0]]
        if node == self._driver_node:
            # The verified single-node recipe: loopback, no interface selection for gloo/NCCL.
            addr, port = "127.0.0.1", _free_port(sorted(_ISSUED_PORTS))
        else:
            addr = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            port = ray.get(
                _remote_free_port.options(scheduling_strategy=strategy).remote(sorted(_ISSUED_PORTS))
            )
        _ISSUED_PORTS.add(port)
        return addr, port

    # -------------------------------------------------------------- data flow
    def _deal(self, micro_batches: list[FlatBatch]) -> list[list[FlatBatch | None]]:
        per_rank: list[list[FlatBatch | None]] = list(balance_bins(micro_batches, self.num_ranks))
        slots = max(1, max(len(x) for x in per_rank))
        return [x + [None] * (slots - len(x)) for x in per_rank]

    def forward(
        self, samples: Sequence[Sample], max_tokens_per_microbatch: int, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per-sample outputs in input order, float32 on CPU.

        actor/reference: logprobs ``[n]`` (``logprobs[t] = log p(x_t | x_<t)``, 0 at t=0);
        critic: values ``[n]``; reward: a 0-dim score per sample.
        """
        samples = list(samples)
        if not samples:
            return []
        per_rank = self._deal(pack(samples, max_tokens_per_microbatch))
        outs = ray.get(
            [w.forward.remote(mbs, temperature) for w, mbs in zip(self.workers, per_rank, strict=True)]
        )
        results: list[torch.Tensor | None] = [None] * len(samples)
        for mbs, ys in zip(per_rank, outs, strict=True):
            for mb, y in zip(mbs, ys, strict=True):
                if mb is None:
                    continue
                parts = list(y) if self.role == "reward" else unpack(y, mb.cu_seqlens)
                for i, part in zip(mb.sample_index.tolist(), parts, strict=True):
                    results[i] = part
        return results  # type: ignore[return-value]

    def train(
        self,
        samples: Sequence[Sample],
        objective: Any,
        max_tokens_per_microbatch: int,
        num_minibatches: int = 1,
        num_epochs: int = 1,
        units: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, float]:
        """``num_epochs * num_minibatches`` optimizer steps over ``samples``.

        The samples (or ``units``: groups kept in one micro-batch, e.g. DPO pairs) are cut in
        order into ``num_minibatches`` contiguous mini-batches (shuffle beforehand if wanted);
        each mini-batch is packed, dealt to the ranks and gives one optimizer step whose
        gradient is that of the mini-batch mean loss (see ``rlhf.trainer.objectives``).

        Returns:
            Stats averaged over the optimizer steps (objective stats, ``grad_norm``), ``lr`` of
            the last step and ``num_optimizer_steps``.
        """
        samples = list(samples)
        unit_list = [list(u) for u in units] if units is not None else [[i] for i in range(len(samples))]
        if not 1 <= num_minibatches <= len(unit_list):
            raise ValueError(
                f"num_minibatches={num_minibatches} must be in [1, {len(unit_list)}] (the number of "
                "samples/units); lower train.num_minibatches or raise the rollout batch size"
            )
        steps: list[dict[str, float]] = []
        for _ in range(num_epochs):
            for chunk in _split_evenly(len(unit_list), num_minibatches):
                chunk_units = [unit_list[j] for j in chunk]
                idx = [i for u in chunk_units for i in u]
                pos = {i: k for k, i in enumerate(idx)}
                local_units = [[pos[i] for i in u] for u in chunk_units]
                steps.append(
                    self._train_minibatch(
                        [samples[i] for i in idx], local_units, objective, max_tokens_per_microbatch
                    )
                )
        out = {k: sum(s[k] for s in steps if k in s) / sum(1 for s in steps if k in s) for k in steps[0]}
        out["lr"] = steps[-1]["lr"]
        out["num_optimizer_steps"] = float(len(steps))
        return out

    def _train_minibatch(
        self, samples: list[Sample], units: list[list[int]], objective: Any, budget: int
    ) -> dict[str, float]:
        mbs = pack(samples, budget, units=units)
        normalizer = float(sum(objective.loss_weight(mb) for mb in mbs))
        per_rank = self._deal(mbs)
        refs = [
            w.train_step.remote(x, objective, normalizer) for w, x in zip(self.workers, per_rank, strict=True)
        ]
        return _combine_rank_stats(ray.get(refs))

    def info(self) -> list[dict[str, Any]]:
        """Per-rank ``ModelWorker.info`` (device, parameters, optimizer steps taken)."""
        return ray.get([w.info.remote() for w in self.workers])

    # ------------------------------------------------------- weights and state
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named state dict (gathered across ranks under ZeRO-3)."""
        return ray.get([w.get_weights.remote() for w in self.workers])[0]

    def save_hf(self, path: str) -> None:
        ray.get([w.save_hf.remote(str(path)) for w in self.workers])

    def save_checkpoint(
        self, path: str, client_state: dict[str, Any] | None = None, tag: str | None = None
    ) -> None:
        """DeepSpeed checkpoint (model, optimizer, scheduler, client state) under ``path``: a shared dir."""
        ray.get([w.save_checkpoint.remote(str(path), client_state, tag) for w in self.workers])

    def load_checkpoint(self, path: str, tag: str | None = None) -> dict[str, Any]:
        """Restore every rank; returns the client state saved with the checkpoint."""
        return ray.get([w.load_checkpoint.remote(str(path), tag) for w in self.workers])[0]

    def shutdown(self) -> None:
        """Leave the process groups and kill the actors (the placement group is the caller's)."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception as e:  # a dead rank must not keep the others alive
            logger.warning("ModelGroup(%s).shutdown: %s", self.role, e)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
