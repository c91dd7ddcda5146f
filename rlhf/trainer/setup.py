"""Building a run: Ray, the model directory, tokenizer, placement, engines and model groups.

This is the "where things run" half of the system: it reads ``cluster.*`` and decides
placement groups and resources; the groups and engines it builds do not know about it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf.config.schema import RANK_FIELDS, DeepSpeedConfig
from rlhf.envvars import cpu_env
from rlhf.storage import local_mirror
from rlhf.workers.local_ray import LocalRay

if TYPE_CHECKING:
    from rlhf.config.schema import ClusterConfig, ModelConfig, PPOConfig
    from rlhf.config.trainers import DPOConfig, RMConfig, SFTConfig
    from rlhf.models.lora import LoraSettings
    from rlhf.workers.deepspeed_worker import DeepSpeedSettings
    from rlhf.workers.group import ModelGroup
    from rlhf.workers.rollout_pool import RolloutPool

log = logging.getLogger("rlhf")


def init_ray(cluster: ClusterConfig) -> None:
    """Join ``cluster.address`` or start a local Ray with ``cluster.num_cpus`` logical CPUs.

    Inside a Ray Job (``ray job submit``, KubeRay RayJob) the job's runtime_env already
    reaches every worker, and Ray refuses a second one that sets the same env var, so none
    is passed there.
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        ray.init(address=cluster.address or "auto")
        return
    env = cpu_env() if cluster.device == "cpu" else {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}
    runtime_env = {"env_vars": env}
    if cluster.address:
        ray.init(address=cluster.address, runtime_env=runtime_env)
        return
    stop_local_ray()  # one a test or demo left behind after its ray.shutdown()

    def start() -> None:
        global _local_ray
        _local_ray = LocalRay(cluster.num_cpus)
        address = _local_ray.start(cluster.ray_start_timeout_s)
        # WARNING: Ray's "Connecting to existing Ray cluster ..." lines are ours to tell
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
        log.info("local Ray of %d CPUs up at %s", cluster.num_cpus, address)

    start_local_ray(start, stop_local_ray, cluster.ray_start_timeout_s)


# The head init_ray started in its own session (rlhf.workers.local_ray), so that a signal to the
# driver's process group leaves it up until the driver has checkpointed.
_local_ray: LocalRay | None = None


def stop_local_ray() -> None:
    """Disconnect from and stop the local Ray head that ``init_ray`` started, if any."""
    global _local_ray
    if _local_ray is not None:
        _local_ray.stop()
        _local_ray = None


def prepare_nodes(output_dir: str, model_dirs: list[str], timeout_s: float) -> None:
    """Before any worker starts (Ray is up): refuse a local ``output_dir`` that some node does not
    share, and ship model dirs that only the driver's node has (``rlhf.workers.node_files``)."""
    from rlhf.workers.node_files import check_shared_dir, ship_model_dirs

    check_shared_dir(output_dir, timeout_s)
    ship_model_dirs(model_dirs, timeout_s)


# What ray.init raises when the processes it started did not come up in time: Ray waits a fixed
# 30 s for its raylet to register (ray/_private/node.py), which a loaded machine can miss.
_RAY_START_FAILURES = (
    "timed out during startup",
    "failed to start",
    "Failed to connect to GCS",
    "did not start within",
)


def start_local_ray(
    start: Callable[[], object],
    stop: Callable[[], object],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """``start()`` (a local ``ray.init``), tried again after ``stop()`` while it fails with a
    start-up timeout and ``timeout_s`` (``cluster.ray_start_timeout_s``) has not passed; at least
    one retry. Returns the number of attempts. Other errors are raised at once."""
    t0, attempt = clock(), 0
    while True:
        attempt += 1
        try:
            start()
            return attempt
        except Exception as e:
            if not any(s in str(e) for s in _RAY_START_FAILURES):
                raise
            stop()  # the processes this attempt started
            waited = clock() - t0
            if attempt >= 2 and waited >= timeout_s:
                raise RuntimeError(
                    f"the local Ray did not start in {attempt} attempts over {waited:.0f} s ({e}). The machine "
                    "is probably overloaded or short of memory: stop other jobs (or stale Ray processes, "
                    "`ray stop`), or raise cluster.ray_start_timeout_s"
                ) from e
            log.warning(
                "the local Ray did not start (%s); trying again (attempt %d, cluster.ray_start_timeout_s=%.0f)",
                e,
                attempt + 1,
                timeout_s,
            )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def prepare_model_dir(model_cfg: ModelConfig, output_dir: str) -> str:
    """``model.path``, or a tiny random-init model built once under ``output_dir`` (the driver's
    staging copy of it for a storage URI; the model is shipped to nodes that lack it)."""
    if model_cfg.path:
        if not Path(model_cfg.path, "config.json").is_file():
            raise ValueError(
                f"model.path={model_cfg.path!r} is not a Hugging Face model directory (no config.json)"
            )
        if not any(Path(model_cfg.path, f).is_file() for f in TOKENIZER_FILES):
            # AutoTokenizer would instead suggest installing sentencepiece.
            raise ValueError(
                f"model.path={model_cfg.path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                "base model's tokenizer into it, e.g. AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR)"
            )
        return model_cfg.path
    from rlhf.models.tiny import build_tiny_model

    out = local_mirror(output_dir) / "tiny_model"
    if not (out / "config.json").is_file():
        t = model_cfg.tiny
        build_tiny_model(
            out,
            arch=t.arch,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            intermediate_size=t.intermediate_size,
            seed=t.seed,
        )
    return str(out)


def deepspeed_settings(train: DeepSpeedConfig, lr: float, total_steps: int = 0) -> DeepSpeedSettings:
    """The one conversion from the run's ``train.*`` config to a group's ``DeepSpeedSettings``.

    ``lr=0`` makes a frozen group (reference, PPO reward model). A supervised config's
    ``lr_schedule``/``min_lr_ratio`` travel too; ``total_steps`` is the length of a cosine schedule.
    """
    from rlhf.workers.deepspeed_worker import DeepSpeedSettings

    shared = {f.name: getattr(train, f.name) for f in fields(DeepSpeedConfig)}
    schedule = getattr(train, "lr_schedule", "constant")
    extra = {}
    if schedule == "cosine":
        extra = {
            "lr_schedule": "cosine",
            "total_steps": max(total_steps, train.warmup_steps + 1),
            "min_lr_ratio": train.min_lr_ratio,
        }
    return DeepSpeedSettings(**shared, lr=lr, **extra)


def lora_settings(model_cfg: ModelConfig) -> LoraSettings | None:
    """``model.lora`` as the workers take it; None = full fine-tuning."""
    from rlhf.models.lora import LoraSettings

    lo = model_cfg.lora
    if not lo.enabled:
        return None
    return LoraSettings(lo.rank, lo.alpha, lo.dropout, list(lo.target_modules), list(lo.modules_to_save))


@contextmanager
def model_group(
    cfg: SFTConfig | DPOConfig | RMConfig,
    role: str,
    path: str,
    num_ranks: int,
    lr: float = 0.0,
    total_steps: int = 0,
) -> Iterator[ModelGroup]:
    """A ``ModelGroup`` on a placement group of its own, both released on exit (SFT/DPO/RM)."""
    import ray

    from rlhf.workers.group import ModelGroup
    from rlhf.workers.placement import Placement, create_placement_group

    c, t = cfg.cluster, cfg.train
    check_fits({role: (num_ranks, c.cpus_per_worker, c.gpus_per_worker)}, c)
    pg = create_placement_group(
        num_ranks,
        c.cpus_per_worker,
        c.gpus_per_worker,
        strategy=c.strategy(role),
        timeout_s=c.startup_timeout_s,
        name=_pg_name(role),
    )
    try:
        placement = Placement.on_bundles(pg, num_ranks, c.cpus_per_worker, c.gpus_per_worker)
        settings = deepspeed_settings(t, lr, total_steps)
        group = ModelGroup(
            role,
            path,
            num_ranks,
            settings,
            placement,
            lora=lora_settings(cfg.model),
            attn_impl=cfg.model.attn_impl,
            seed=t.seed,
            startup_timeout_s=c.startup_timeout_s,
            sequence_parallel_size=cfg.model.sequence_parallel_size,
        )
        try:
            yield group
        finally:
            group.shutdown()
    finally:
        ray.util.remove_placement_group(pg)


def _log_dir(output_dir: str) -> str:
    """Workers' INFO logs: ``<output_dir>/logs`` (absolute: workers run in other directories);
    for a storage URI the same path under each node's staging dir, uploaded by ``RunOutput.publish``."""
    return str(local_mirror(output_dir) / "logs")


def _pg_name(role: str) -> str:
    # Unique: Ray refuses a second live placement group of the same name (two jobs on one
    # cluster, or a test session building workers twice).
    return f"rlhf-{role}-{uuid.uuid4().hex[:8]}"


@dataclass
class Workers:
    rollout: RolloutPool
    actor: ModelGroup
    reference: ModelGroup | None = None
    critic: ModelGroup | None = None
    reward_model: ModelGroup | None = None
    placement_groups: list = field(default_factory=list)

    def shutdown(self) -> None:
        """Stop every engine and rank, then free the placement groups they were reserved in."""
        import ray

        for w in (self.rollout, self.actor, self.reference, self.critic, self.reward_model):
            if w is not None:
                w.shutdown()
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.placement_groups.clear()


def _rollout_pool(cfg: PPOConfig, model_dir: str, pg: object) -> RolloutPool:
    from rlhf.workers.rollout_pool import RolloutPool

    r, c = cfg.rollout, cfg.cluster
    sync = cfg.weight_sync_mode
    kwargs = {
        "model_path": model_dir,
        "max_model_len": r.max_model_len,
        "seed": cfg.train.seed,
        "dtype": r.dtype,
        "weight_transfer": None if sync == "object_store" else sync,
        "sleep_mode": c.colocate_engines,
    }
    if r.backend == "hf":
        from rlhf.workers.hf_rollout import HFRolloutEngine as engine_cls
    else:
        from rlhf.workers.rollout import RolloutEngine as engine_cls

        kwargs.update(
            gpu_memory_utilization=r.gpu_memory_utilization,
            enforce_eager=r.enforce_eager,
            log_dir=_log_dir(cfg.train.output_dir),
            inflight_updates=cfg.train.mode == "streaming" and r.inflight_updates,
        )
        if cfg.syncs_adapter:
            from transformers import AutoConfig

            from rlhf.models.lora import adapter_config
            from rlhf.workers.lora_rollout import LoraRolloutEngine as engine_cls

            lora = lora_settings(cfg.model)
            model_type = AutoConfig.from_pretrained(model_dir).model_type
            kwargs.update(
                lora_rank=lora.rank,
                adapter_config=adapter_config(lora, model_type, model_dir),
                keep_versions=cfg.train.max_staleness + 1,
            )
    return RolloutPool(
        r.num_engines,
        kwargs,
        engine_cls=engine_cls,
        num_cpus_per_engine=c.cpus_per_engine,
        num_gpus_per_engine=c.gpus_per_engine,
        placement_group=pg,
        max_restarts=r.max_restarts,
        wait=False,
        startup_timeout_s=c.startup_timeout_s,
        call_timeout_s=cfg.train.rollout_timeout_s,
    )


def _roles(cfg: PPOConfig, model_dir: str) -> list[tuple[str, int, str, float]]:
    """``(role, ranks, model dir, lr)`` of every DeepSpeed group the run needs."""
    t = cfg.train
    dirs = {
        "actor": (model_dir, t.actor_lr),
        "reference": (model_dir, 0.0),
        "critic": (cfg.model.critic_path or model_dir, t.critic_lr),
        "reward": (cfg.reward.model_path, 0.0),
    }
    return [(r, getattr(cfg.cluster, RANK_FIELDS[r]), *dirs[r]) for r in cfg.model_roles()]


def _bundles(cfg: PPOConfig, roles: list[tuple[str, int, str, float]]) -> dict[str, tuple[int, float, float]]:
    """Placement groups to reserve: name -> ``(bundles, CPU per bundle, GPU per bundle)``."""
    c = cfg.cluster
    if c.colocate:
        # Rank i of every role shares bundle i (OpenRLHF colocation); each actor asks its share.
        # colocate_engines: engine i joins bundle i too (schema: colocate must be on, and
        # num_engines <= bundles), asking its own share of the same GPU.
        k = len(roles)
        e = 1 if c.colocate_engines else 0
        gpus = c.gpus_per_worker * k + c.gpus_per_engine * e
        if c.colocate_engines and gpus > 1:
            # Ray grants a bundle of more than one GPU and may then place its actors on different
            # GPUs: the engine would not share actor rank i's GPU (CUDA IPC fails, sleep frees nothing).
            raise ValueError(
                f"cluster.colocate_engines=true: engine i must share one GPU with rank i of every role, but "
                f"bundle i asks {gpus:g} GPUs ({k} roles {[r[0] for r in roles]} x cluster.gpus_per_worker="
                f"{c.gpus_per_worker:g} + cluster.gpus_per_engine={c.gpus_per_engine:g}); make them sum to <= 1, "
                f"e.g. cluster.gpus_per_worker={(1 - c.gpus_per_engine) / k:.3g}"
            )
        out = {"all": (max(r[1] for r in roles), c.cpus_per_worker * k + c.cpus_per_engine * e, gpus)}
    else:
        out = {role: (ranks, c.cpus_per_worker, c.gpus_per_worker) for role, ranks, _, _ in roles}
    if not c.colocate_engines:
        out["engines"] = (cfg.rollout.num_engines, c.cpus_per_engine, c.gpus_per_engine)
    return out


def check_fits(bundles: dict[str, tuple[int, float, float]], cluster: ClusterConfig) -> None:
    """Fail at once when the run asks more CPUs/GPUs than the cluster has in total: waiting
    could never help. (A remote cluster may be autoscaling: there only the bounded wait for
    each placement group applies.)"""
    import ray

    if cluster.address or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return
    total = ray.cluster_resources()
    for kind, i in (("CPU", 1), ("GPU", 2)):
        need = sum(b[0] * b[i] for b in bundles.values())
        have = total.get(kind, 0.0)
        if need > have + 1e-9:
            parts = ", ".join(f"{name} {b[0]}x{b[i]:g}" for name, b in bundles.items() if b[i])
            raise RuntimeError(
                f"the run needs {kind}={need:g} ({parts}) and the local Ray has {kind}={have:g} in total: "
                f"raise cluster.num_cpus (logical CPUs may exceed the cores), or ask less with "
                "cluster.*_ranks, cluster.cpus_per_worker/cpus_per_engine, rollout.num_engines"
            )


def build_workers(cfg: PPOConfig, model_dir: str) -> Workers:
    """Rollout engines and DeepSpeed groups placed per ``cluster.*``, started in parallel."""
    from rlhf.workers.group import ModelGroup
    from rlhf.workers.placement import Placement, create_placement_group

    c, t = cfg.cluster, cfg.train
    t0 = time.perf_counter()
    roles = _roles(cfg, model_dir)
    bundles = _bundles(cfg, roles)
    check_fits(bundles, c)
    pgs: dict[str, object] = {}
    groups: dict[str, ModelGroup] = {}
    pool = None
    try:
        for name, (n, cpus, gpus) in bundles.items():
            pgs[name] = create_placement_group(
                n, cpus, gpus, strategy=c.strategy(name), timeout_s=c.startup_timeout_s, name=_pg_name(name)
            )
        for role, ranks, path, lr in roles:
            pg = pgs["all" if c.colocate else role]
            groups[role] = ModelGroup(
                role,
                path,
                ranks,
                deepspeed_settings(t, lr),
                Placement.on_bundles(pg, ranks, c.cpus_per_worker, c.gpus_per_worker),
                attn_impl=cfg.model.attn_impl,
                seed=t.seed,
                log_dir=_log_dir(t.output_dir),
                wait=False,
                lora=lora_settings(cfg.model),
                lora_sync=cfg.rollout.lora_sync,
                sequence_parallel_size=cfg.model.sequence_parallel_size,
            )
        pool = _rollout_pool(cfg, model_dir, pgs["all" if c.colocate_engines else "engines"])
        # Engines and ranks load at the same time; wait for all of them (start-up says where it is).
        log.info(
            "starting workers: %s and %d rollout engine(s), loading in parallel",
            ", ".join(f"{role} ({ranks} rank{'s' * (ranks > 1)})" for role, ranks, _, _ in roles),
            cfg.rollout.num_engines,
        )
        pool.wait_started()
        log.info("rollout engines ready after %.0f s (warm-up included)", time.perf_counter() - t0)
        for k, (role, g) in enumerate(groups.items(), 1):
            g.wait_started(c.startup_timeout_s)
            log.info("%s ready (%d/%d groups) after %.0f s", role, k, len(groups), time.perf_counter() - t0)
    except BaseException:
        # Free what was reserved so a failed start does not hold the cluster's resources.
        for g in groups.values():
            g.shutdown()
        Workers(rollout=pool, actor=None, placement_groups=list(pgs.values())).shutdown()
        raise
    log.info("workers started in %.1f s: %s", time.perf_counter() - t0, ", ".join(groups) + ", engines")
    reference = groups.get("reference")
    if cfg.reference_is_actor_base:
        reference = groups["actor"].without_adapters()
        log.info("reference log-probs: the actor with its LoRA adapters disabled (no reference model built)")
    return Workers(
        rollout=pool,
        actor=groups["actor"],
        reference=reference,
        critic=groups.get("critic"),
        reward_model=groups.get("reward"),
        placement_groups=list(pgs.values()),
    )
