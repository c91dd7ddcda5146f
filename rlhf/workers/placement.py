"""Where model workers run: Ray placement groups and per-rank placements.

"Where things run" is configuration separate from "what runs": a ``ModelGroup`` receives a
``Placement`` (placement group + one bundle index per rank + the fractional CPU/GPU each
actor asks for). Several roles can share the same bundles (OpenRLHF-style colocation:
actor, reference and critic rank ``i`` on bundle ``i`` with e.g. 0.25 GPU each), or a role
can get a placement group of its own. ``pg=None`` schedules the actors anywhere in the
cluster, which is enough for a single machine and for tests.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

__all__ = [
    "Placement",
    "bundle_strategy",
    "cpu_threads",
    "create_placement_group",
    "describe_resources",
    "free_port",
    "use_cpu_share",
    "use_threads",
]

log = logging.getLogger(__name__)
_WAIT_NOTICE_S = 10.0  # a placement group not granted by then is reported as waiting for nodes


def cpu_threads(cpu_share: float) -> int:
    """``cpu_share`` of this node's cores (the ones this process may run on), at least one."""
    return max(1, int(len(os.sched_getaffinity(0)) * cpu_share + 1e-9))


def use_cpu_share(cpu_share: float) -> None:
    """Compute (torch intra-op threads) with ``cpu_share`` of this node's cores, at least one.

    The driver knows which processes run at the same time, so it hands each its share."""
    use_threads(cpu_threads(cpu_share))


def use_threads(n: int) -> None:
    """Compute (torch intra-op threads of this thread) with ``n`` threads."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def describe_resources(resources: dict[str, float]) -> str:
    """``"CPU=8, GPU=0"`` for ``ray.cluster_resources()`` or ``ray.available_resources()``."""
    return f"CPU={resources.get('CPU', 0.0):g}, GPU={resources.get('GPU', 0.0):g}"


def create_placement_group(
    num_bundles: int,
    cpus_per_bundle: float,
    gpus_per_bundle: float,
    strategy: str = "PACK",
    timeout_s: float = 120.0,
    name: str = "",
) -> PlacementGroup:
    """Reserve ``num_bundles`` bundles of ``{CPU, GPU}`` and wait until they are ready.

    Args:
        num_bundles: one bundle per data-parallel rank (colocated roles share bundles).
        cpus_per_bundle: logical CPUs per bundle.
        gpus_per_bundle: GPUs per bundle (0 on a CPU-only cluster).
        strategy: Ray placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        timeout_s: how long to wait for the cluster to grant the resources.
        name: optional placement-group name (shows in the Ray dashboard).

    Raises:
        RuntimeError: the resources were not granted within ``timeout_s``; the message says
            what was asked, what the cluster has and which ``cluster.*`` fields to change.
    """
    if num_bundles < 1:
        raise ValueError(f"a placement group needs at least one bundle, got num_bundles={num_bundles}")
    bundle: dict[str, float] = {"CPU": float(cpus_per_bundle)}
    if gpus_per_bundle > 0:
        bundle["GPU"] = float(gpus_per_bundle)
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy, name=name)
    # Tell the user early when the cluster cannot grant it now (a node lost, an autoscaler adding
    # one): the run then waits for nodes to join, up to timeout_s, instead of seeming to hang.
    first = min(_WAIT_NOTICE_S, timeout_s)
    ready, _ = ray.wait([pg.ready()], timeout=first)
    if not ready:
        log.warning(
            "waiting up to %.0f s more (cluster.startup_timeout_s) for nodes with room for %s: %s",
            timeout_s - first,
            _describe_ask(num_bundles, bundle, strategy, name),
            _cluster_now(bundle),
        )
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s - first)
    if not ready:
        state = placement_group_table(pg).get("state", "unknown")
        ray.util.remove_placement_group(pg)
        raise RuntimeError(_not_granted(num_bundles, bundle, strategy, timeout_s, state))
    _remember_node_sizes(ray.nodes())
    return pg


def _describe_ask(num_bundles: int, bundle: dict[str, float], strategy: str, name: str) -> str:
    return f"placement group {name or '?'} of {num_bundles} bundles x {bundle} ({strategy})"


_NODE_SIZES: dict[str, dict[str, float]] = {}  # node id -> total resources, seen while alive


def _remember_node_sizes(nodes: list[dict]) -> None:
    """Ray keeps no resources for a dead node: remember each live node's, to tell later whether
    a node that died could have held what a placement group waits for."""
    _NODE_SIZES.update({n["NodeID"]: n["Resources"] for n in nodes if n.get("Alive") and n.get("Resources")})


def _node_health(bundle: dict[str, float]) -> tuple[int, list[str]]:
    """(alive node count, addresses of the nodes this process saw alive, now dead, that could
    have held a ``bundle``) from one ``ray.nodes()``. A dead node too small for a bundle, or
    gone before this run placed anything, is not why a group waits: naming it would send the
    user after the wrong thing."""
    nodes = ray.nodes()
    _remember_node_sizes(nodes)

    def could_hold(node: dict) -> bool:
        total = _NODE_SIZES.get(node["NodeID"])
        return total is not None and all(total.get(k, 0.0) >= v for k, v in bundle.items())

    return (
        sum(1 for n in nodes if n.get("Alive")),
        sorted({n["NodeManagerAddress"] for n in nodes if not n.get("Alive") and could_hold(n)}),
    )


def _cluster_now(bundle: dict[str, float]) -> str:
    alive, dead = _node_health(bundle)
    return (
        f"{alive} nodes alive, free {describe_resources(ray.available_resources())} of "
        f"{describe_resources(ray.cluster_resources())}" + (f"; dead nodes {dead}" if dead else "")
    )


def _not_granted(
    num_bundles: int, bundle: dict[str, float], strategy: str, timeout_s: float, state: str
) -> str:
    alive, dead = _node_health(bundle)
    return (
        (
            f"nodes {dead} died and no node with their resources joined within {timeout_s:.0f} s "
            "(cluster.startup_timeout_s): bring them back or add nodes, or shrink the run to the nodes "
            "left. "
            if dead
            else ""
        )
        + f"placement group of {num_bundles} bundles x {bundle} ({strategy}) not ready after "
        f"{timeout_s:.0f}s (state {state}); the cluster has {describe_resources(ray.cluster_resources())} in "
        f"total. Need CPU={num_bundles * bundle['CPU']:g}, GPU={num_bundles * bundle.get('GPU', 0.0):g}: "
        "lower cluster.actor_ranks/critic_ranks/ref_ranks/reward_ranks or "
        "cluster.cpus_per_worker/gpus_per_worker, raise cluster.num_cpus (local Ray), set "
        "cluster.colocate=true to share bundles, or add nodes to the Ray cluster"
        + (
            f". {strategy} puts every bundle on a node of its own: it needs {num_bundles} nodes with room "
            f"(the cluster has {alive} alive); use "
            "cluster.placement_strategy=spread (best effort) or pack"
            if strategy == "STRICT_SPREAD" and num_bundles > 1
            else ""
        )
    )


def bundle_strategy(pg: PlacementGroup, bundle_index: int) -> PlacementGroupSchedulingStrategy:
    """Scheduling strategy pinning an actor (and the tasks it starts) to bundle ``bundle_index``."""
    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True,
    )


@dataclass
class Placement:
    """Where the ranks of one model group run.

    Attributes:
        pg: the placement group, or None to let Ray schedule the actors anywhere.
        bundle_indices: bundle of each rank (``len == num_ranks``); ignored when ``pg`` is None.
        num_cpus: logical CPUs each rank's actor asks for (fractions allow colocation).
        num_gpus: GPUs each rank's actor asks for (e.g. 0.25 when four roles share a GPU).
    """

    pg: PlacementGroup | None = None
    bundle_indices: list[int] = field(default_factory=list)
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    @classmethod
    def on_bundles(
        cls, pg: PlacementGroup, num_ranks: int, num_cpus: float, num_gpus: float, first_bundle: int = 0
    ) -> Placement:
        """Rank ``i`` on bundle ``first_bundle + i`` (roles built this way on one pg are colocated)."""
        return cls(pg, list(range(first_bundle, first_bundle + num_ranks)), num_cpus, num_gpus)

    @property
    def uses_gpu(self) -> bool:
        return self.num_gpus > 0

    def check(self, num_ranks: int) -> None:
        """Raise ValueError if this placement cannot host ``num_ranks`` ranks."""
        if self.pg is None:
            return
        if len(self.bundle_indices) != num_ranks:
            raise ValueError(
                f"placement has {len(self.bundle_indices)} bundle indices for {num_ranks} ranks; "
                "give one bundle per rank (Placement.on_bundles)"
            )
        n = self.pg.bundle_count
        bad = [b for b in self.bundle_indices if not 0 <= b < n]
        if bad:
            raise ValueError(f"bundle indices {bad} out of range for a placement group of {n} bundles")

    def actor_options(self, rank: int) -> dict:
        """Ray ``.options(...)`` for the actor of ``rank``."""
        opts: dict = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.pg is not None:
            opts["scheduling_strategy"] = bundle_strategy(self.pg, self.bundle_indices[rank])
        return opts


def free_port(exclude: Sequence[int] = ()) -> int:
    """A TCP port free on this host now (for a rendezvous), not in ``exclude``."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
    raise RuntimeError("could not find a free TCP port for a rendezvous")
