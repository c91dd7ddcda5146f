"""A data-parallel DeepSpeed model on Ray: one ``ModelWorker`` actor per rank.

The driver speaks ``list[Sample]`` (the data contract, ``rlhf.data.types``). For every call
it packs the samples into micro-batches under a token budget (``rlhf.data.packing.pack``),
deals them to the ranks (``balance_bins``, so every rank gets *different* data and about
the same number of tokens; the shorter ranks' lists are padded with ``None``: dummy,
zero-weight passes that keep the collectives in step), runs all ranks in parallel and
scatters the outputs back to the input order through ``FlatBatch.sample_index``.

Failures. A rank that raises leaves the others blocked in a collective until
``dist_timeout_s``. So the driver waits for the ranks' results one at a time and, on the
first error, kills every worker of the group and raises ``RuntimeError`` (role, rank, the
original error chained). The group is dead after that: every later call raises; build a
new ``ModelGroup`` (e.g. from the last checkpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf.data.packing import balance_bins, pack, shard_bounds, unpack
from rlhf.data.types import FlatBatch, Sample
from rlhf.envvars import model_worker_env
from rlhf.models.lora import LoraSettings
from rlhf.models.objective import TrainObjective
from rlhf.workers.deepspeed_worker import ROLES, DeepSpeedSettings, ModelWorker
from rlhf.workers.errors import WorkerDied, is_process_death, lost_peer
from rlhf.workers.placement import Placement, describe_resources, free_port
from rlhf.workers.worker_weights import DEFAULT_SYNC_BUCKET_BYTES

__all__ = ["ModelGroup"]

logger = logging.getLogger(__name__)

# Ports handed out by this driver: a port is only bound once rank 0 starts, seconds later,
# so two groups created back to back could otherwise be given the same one.
_ISSUED_PORTS: set[int] = set()


@ray.remote(num_cpus=0)
def _remote_free_port(exclude: list[int]) -> int:
    return free_port(exclude)


_LOOPBACK = "127.0.0.1"
# How long a rank whose collective lost its peer waits for Ray to report that peer dead (a lost
# node is declared dead after its health checks fail: ~15 s with Ray's defaults).
PEER_DEATH_WAIT_S = 60.0


def _rendezvous_node(
    bundle_nodes: Mapping[int, str],
    bundle_indices: Sequence[int],
    driver_node: str,
    node_addresses: Mapping[str, str],
) -> tuple[str, str]:
    """``(master_addr, node to pick the port on)`` for a group on the given bundles.

    Loopback only when EVERY bundle of the group is on the driver's node (the verified
    single-node recipe: no interface selection for gloo/NCCL); otherwise the address of rank
    0's node (``bundle_indices[0]``), which every rank can reach.

    Args:
        bundle_nodes: bundle index -> node id (``placement_group_table(pg)["bundles_to_node_id"]``).
        bundle_indices: the group's bundle of each rank.
        driver_node: node id of the driver.
        node_addresses: node id -> IP (``NodeManagerAddress`` of ``ray.nodes()``).
    """
    if all(bundle_nodes[b] == driver_node for b in bundle_indices):
        return _LOOPBACK, driver_node
    node0 = bundle_nodes[bundle_indices[0]]
    return node_addresses[node0], node0


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
        num_ranks: ranks (processes); data-parallel size ``num_ranks / sequence_parallel_size``.
        settings: the group's ``DeepSpeedSettings`` (default: its defaults); a ``reward`` group
            trains only with ``settings.lr > 0``.
        placement: where the ranks run; default: anywhere on the driver's node, 1 CPU each.
        attn_impl: attention implementation for the packed forward.
        seed: torch seed on every rank.
        env_vars: extra environment variables for the worker processes.
        log_dir: where the ranks write DeepSpeed's INFO lines (None: to the console).
        wait: wait for the ranks to start here (else call ``wait_started``).
        startup_timeout_s: longest wait for the ranks to be scheduled and load the model.
        sequence_parallel_size: ranks that split each packed row along the sequence
            (``rlhf.models.sequence_parallel``); the token budget of a micro-batch is that of
            the whole group.
    """

    def __init__(
        self,
        role: str,
        model_dir: str,
        num_ranks: int,
        settings: DeepSpeedSettings | None = None,
        placement: Placement | None = None,
        attn_impl: str = "auto",
        seed: int = 0,
        env_vars: dict[str, str] | None = None,
        log_dir: str | None = None,
        wait: bool = True,
        startup_timeout_s: float = 300.0,
        lora: LoraSettings | None = None,
        lora_sync: str = "adapter",
        sequence_parallel_size: int = 1,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if sequence_parallel_size < 1 or num_ranks % sequence_parallel_size:
            raise ValueError(
                f"model.sequence_parallel_size={sequence_parallel_size} must divide the {role}'s "
                f"{num_ranks} ranks"
            )
        self.role, self.num_ranks = role, num_ranks
        self.sp_size = sequence_parallel_size
        self.placement = placement or Placement()
        self.placement.check(num_ranks)
        settings = settings or DeepSpeedSettings()
        master_addr, master_port = self._rendezvous()
        env = model_worker_env(self.placement.uses_gpu, self.placement.num_cpus)
        env.update(env_vars or {})
        remote_cls = ray.remote(ModelWorker)
        self.workers: list[Any] = []
        self._failure: str | None = None
        self._failure_cls: type[RuntimeError] = RuntimeError
        for r in range(num_ranks):
            opts = self.placement.actor_options(r)
            if self.placement.pg is None:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._driver_node, soft=False)
            self.workers.append(
                remote_cls.options(**opts, runtime_env={"env_vars": env}).remote(
                    role,
                    str(model_dir),
                    r,
                    num_ranks,
                    master_addr,
                    master_port,
                    settings,
                    attn_impl,
                    seed,
                    log_dir,
                    lora,
                    lora_sync,
                    sequence_parallel_size,
                )
            )
        self._start_refs = self._submit("info")
        self.infos: list[dict[str, Any]] = []
        if wait:
            self.wait_started(startup_timeout_s)

    def wait_started(self, timeout_s: float = 300.0) -> ModelGroup:
        """Wait until every rank has loaded its model (``wait=False`` lets the caller start
        several groups and engines at once and wait for them together)."""
        if not self.infos:
            # A rank that fails to start kills the others (they would wait in the rendezvous).
            self.infos = self._gather(self._start_refs, "start", timeout_s=timeout_s)
        return self

    def _rendezvous(self) -> tuple[str, int]:
        """Address and a free port on the node of rank 0 (loopback if all ranks are on the driver's)."""
        self._driver_node = ray.get_runtime_context().get_node_id()
        pg = self.placement.pg
        addr, node = _LOOPBACK, self._driver_node
        if pg is not None:
            addr, node = _rendezvous_node(
                placement_group_table(pg)["bundles_to_node_id"],
                self.placement.bundle_indices,
                self._driver_node,
                {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive", True)},
            )
        if node == self._driver_node:
            port = free_port(sorted(_ISSUED_PORTS))
        else:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            port = ray.get(
                _remote_free_port.options(scheduling_strategy=strategy).remote(sorted(_ISSUED_PORTS)),
                timeout=60,  # a zero-CPU task: only a lost node keeps it from running
            )
        _ISSUED_PORTS.add(port)
        return addr, port

    # ------------------------------------------------------------ rank calls
    def _on_all(self, method: str, *args: Any, per_rank: Sequence[Any] | None = None) -> list[Any]:
        """``method(per_rank[r], *args)`` (or ``method(*args)``) on every rank; results in rank order.

        Fails fast: see the module docstring (the first rank error kills the group).
        """
        return self._gather(self._submit(method, *args, per_rank=per_rank), method)

    def _submit(self, method: str, *args: Any, per_rank: Sequence[Any] | None = None) -> list[Any]:
        if self._failure is not None:
            raise self._failure_cls(
                f"ModelGroup({self.role}) is dead after an earlier failure ({self._failure}); "
                "create a new group"
            )
        return [
            getattr(w, method).remote(*(() if per_rank is None else (per_rank[r],)), *args)
            for r, w in enumerate(self.workers)
        ]

    def _gather(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order. ``timeout_s`` bounds waits that need no peer to fail first
        (start-up: a rank the cluster cannot schedule would wait forever); collectives are
        bounded by ``dist_timeout_s`` on the ranks."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not done:
                waiting = sorted(rank_of[p] for p in pending)
                self._fail(
                    f"{what} not done on ranks {waiting} after {timeout_s:.0f} s",
                    TimeoutError(
                        f"ranks {waiting} of ModelGroup({self.role}) are not running after {timeout_s:.0f} s: "
                        f"each asks {self.placement.num_cpus:g} CPU and {self.placement.num_gpus:g} GPU; "
                        f"the cluster has {describe_resources(ray.available_resources())} free. Give the cluster more CPUs/GPUs "
                        "(cluster.num_cpus for a local Ray) or ask less (cluster.*_ranks, cpus_per_worker); "
                        "raise cluster.startup_timeout_s if the model is just slow to load"
                    ),
                    RuntimeError,
                )
            r = rank_of[done[0]]
            try:
                results[r] = ray.get(done[0])
            except Exception as e:
                if (
                    not is_process_death(e)
                    and lost_peer(e)
                    and (dead := self._dead_peer(r, pending, rank_of))
                ):
                    self._fail(
                        f"{what} failed on rank {r} of {self.num_ranks} after rank {dead[0]} died",
                        dead[1],
                        WorkerDied,
                    )
                self._fail(
                    f"{what} failed on rank {r} of {self.num_ranks}",
                    e,
                    WorkerDied if is_process_death(e) else RuntimeError,
                )
        return results

    def _dead_peer(
        self, failed: int, pending: list[Any], rank_of: dict[Any, int]
    ) -> tuple[int, BaseException] | None:
        """After rank ``failed`` lost a collective peer: a rank that died, with its error (Ray can
        take seconds to notice a lost node, so this waits up to ``PEER_DEATH_WAIT_S``)."""
        probes = {rank_of[p]: p for p in pending}
        for r, w in enumerate(self.workers):
            if r != failed and r not in probes:
                probes[r] = w.__ray_ready__.remote()  # a rank that returned may have died since
        ray.wait(list(probes.values()), num_returns=len(probes), timeout=PEER_DEATH_WAIT_S)
        for r, ref in sorted(probes.items()):
            try:
                ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - sorted out just below
                if is_process_death(e):
                    return r, e
        return None

    def _fail(self, what: str, e: BaseException, cls: type[RuntimeError]) -> None:
        self._failure, self._failure_cls = what, cls
        for w in self.workers:
            ray.kill(w)
        # A RayTaskError's text is the whole remote traceback (kept in the chain).
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        raise cls(
            f"ModelGroup({self.role}): {what}: {type(cause).__name__}: {cause}\n"
            "All workers of the group were killed (the other ranks would block in collectives until "
            "dist_timeout_s); the group is unusable now."
        ) from e

    # -------------------------------------------------------------- data flow
    def _deal(self, micro_batches: list[FlatBatch]) -> list[list[FlatBatch | None]]:
        """Micro-batches of each rank: one data-parallel shard per sequence-parallel group,
        the same on each of its ``sp_size`` consecutive ranks."""
        per_shard = balance_bins(micro_batches, self.num_ranks // self.sp_size)
        # train_step needs at least one slot: with nothing to deal every rank runs one dummy.
        if not per_shard[0]:
            per_shard = [[None] for _ in per_shard]
        return [per_shard[r // self.sp_size] for r in range(self.num_ranks)]

    def forward(
        self, samples: Sequence[Sample], max_tokens_per_microbatch: int, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per-sample outputs in input order, float32 on CPU.

        actor/reference: logprobs ``[n]`` (``logprobs[t] = log p(x_t | x_<t)``, 0 at t=0);
        critic: values ``[n]``; reward: a 0-dim score per sample.
        """
        return self.forward_async(samples, max_tokens_per_microbatch, temperature)()

    def forward_async(
        self,
        samples: Sequence[Sample],
        max_tokens_per_microbatch: int,
        temperature: float = 1.0,
        cpu_share: float | None = None,
        adapters: bool = True,
    ) -> Callable[[], list[torch.Tensor]]:
        """Start ``forward`` on every rank and return a function that waits for its result.

        Lets the driver run several groups' forwards at once (scoring: actor, reference, critic);
        ``cpu_share`` is each rank's share of its node's cores (default: 1 / ranks, the group
        running alone).
        """
        samples = list(samples)
        if not samples:
            return list
        per_rank = self._deal(pack(samples, max_tokens_per_microbatch))
        refs = self._submit("forward", temperature, self._share(cpu_share), adapters, per_rank=per_rank)

        def collect() -> list[torch.Tensor]:
            results: list[torch.Tensor | None] = [None] * len(samples)
            # The ranks of a sequence-parallel group return the same rows: read the first's.
            shards = self._gather(refs, "forward")[:: self.sp_size]
            for mbs, ys in zip(per_rank[:: self.sp_size], shards, strict=True):
                for mb, y in zip(mbs, ys, strict=True):
                    if mb is None:
                        continue
                    parts = list(y) if self.role == "reward" else unpack(y, mb.cu_seqlens)
                    for i, part in zip(mb.sample_index.tolist(), parts, strict=True):
                        results[i] = part
            return results  # type: ignore[return-value]

        return collect

    def without_adapters(self) -> BaseModelView:
        """This LoRA group's frozen base, scored like a reference group (no second model)."""
        return BaseModelView(self)

    def train(
        self,
        samples: Sequence[Sample],
        objective: TrainObjective,
        max_tokens_per_microbatch: int,
        num_minibatches: int = 1,
        num_epochs: int = 1,
        units: Sequence[Sequence[int]] | None = None,
        cpu_share: float | None = None,
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
        share = self._share(cpu_share)
        for _ in range(num_epochs):
            for start, end in shard_bounds(len(unit_list), num_minibatches):
                chunk_units = unit_list[start:end]
                idx = [i for u in chunk_units for i in u]
                pos = {i: k for k, i in enumerate(idx)}
                local_units = [[pos[i] for i in u] for u in chunk_units]
                steps.append(
                    self._train_minibatch(
                        [samples[i] for i in idx], local_units, objective, max_tokens_per_microbatch, share
                    )
                )
        out = {k: sum(s[k] for s in steps if k in s) / sum(1 for s in steps if k in s) for k in steps[0]}
        out["lr"] = steps[-1]["lr"]
        out["num_optimizer_steps"] = float(len(steps))
        return out

    def _train_minibatch(
        self,
        samples: list[Sample],
        units: list[list[int]],
        objective: TrainObjective,
        budget: int,
        share: float,
    ) -> dict[str, float]:
        mbs = pack(samples, budget, units=units)
        normalizer = float(sum(objective.loss_weight(mb) for mb in mbs))
        per_rank = self._deal(mbs)
        return _combine_rank_stats(
            self._on_all("train_step", objective, normalizer, share, per_rank=per_rank)
        )

    def _share(self, cpu_share: float | None) -> float:
        return 1.0 / self.num_ranks if cpu_share is None else cpu_share

    def info(self) -> list[dict[str, Any]]:
        """Per-rank ``ModelWorker.info`` (device, parameters, optimizer steps taken)."""
        return self._on_all("info")

    # ------------------------------------------------------- weights and state
    def get_weights(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """Full HF-named weights (gathered across ranks under ZeRO-3, one bucket at a time)."""
        return self._on_all("get_weights", bucket_bytes)[0]

    def get_weights_ref(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES) -> Any:
        """ObjectRef of the full ``[(name, tensor), ...]``, put by rank 0 (never copied to the driver)."""
        return self._on_all("get_weights_ref", bucket_bytes)[0][0]

    def last_gather(self) -> list[dict[str, int]]:
        """Per rank: buckets of the last weight gather and the most bytes held gathered at once."""
        return self._on_all("last_gather")

    def open_weight_transfer(
        self, mode: str, engines: list[Any], engine_workers: int, bucket_bytes: int, timeout_s: float
    ) -> None:
        """Every rank joins vLLM's trainer-side transfer (nccl | ipc) to ``engines``. GPU only."""
        self._on_all("open_weight_transfer", mode, engines, engine_workers, bucket_bytes, timeout_s)

    def send_weights(self) -> None:
        """One bucketed transfer to the engines opened by ``open_weight_transfer`` (all ranks)."""
        self._on_all("send_weights")

    def save_hf(self, path: str, merged: bool = False) -> None:
        """An HF model dir at ``path`` (LoRA: a PEFT adapter dir, or with ``merged`` the merged model)."""
        self._on_all("save_hf", str(path), merged)

    def save_checkpoint(self, path: str, tag: str | None = None) -> None:
        """DeepSpeed checkpoint (model, optimizer, scheduler) under ``path``: a shared dir, or a
        storage URI each rank uploads its part to (``rlhf.storage``)."""
        self._on_all("save_checkpoint", str(path), tag)

    def load_checkpoint(self, path: str, tag: str | None = None) -> None:
        """Restore every rank from ``save_checkpoint``'s dir."""
        self._on_all("load_checkpoint", str(path), tag)

    def upload_logs(self, output_dir: str) -> None:
        """Every rank copies its log file to ``<output_dir>/logs/``."""
        self._on_all("upload_log", output_dir)

    def shutdown(self) -> None:
        """Leave the process groups and kill the actors (the placement group is the caller's)."""
        if self._failure is None:  # after a failure the workers are already killed
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception as e:  # a dead rank must not keep the others alive
                logger.warning("ModelGroup(%s).shutdown: %s", self.role, e)
        for w in self.workers:
            ray.kill(w)
        self.workers = []


class BaseModelView:
    """The reference policy of a LoRA run: the actor's ranks with their adapters switched off.

    Scores like a ``reference`` ``ModelGroup`` (``forward``/``forward_async``, ``num_ranks``)
    and owns nothing: shutting it down leaves the actor running."""

    role = "reference"

    def __init__(self, group: ModelGroup) -> None:
        self.group = group

    @property
    def num_ranks(self) -> int:
        return self.group.num_ranks

    def forward_async(
        self,
        samples: Sequence[Sample],
        max_tokens_per_microbatch: int,
        temperature: float = 1.0,
        cpu_share: float | None = None,
    ) -> Callable[[], list[torch.Tensor]]:
        return self.group.forward_async(
            samples, max_tokens_per_microbatch, temperature, cpu_share, adapters=False
        )

    def forward(
        self, samples: Sequence[Sample], max_tokens_per_microbatch: int, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        return self.forward_async(samples, max_tokens_per_microbatch, temperature)()

    def upload_logs(self, output_dir: str) -> None:
        """Nothing: the actor's ranks are these ranks, and the actor uploads their logs."""

    def shutdown(self) -> None:
        """Nothing to stop: the actor group is shut down on its own."""
