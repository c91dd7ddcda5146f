"""Files every node of a multi-node run must see, checked (and model dirs shipped) before any
worker starts.

- A local ``train.output_dir`` must be one directory all nodes share: ranks write their
  checkpoint parts straight into it. The driver writes a marker there; a probe on every node
  must see it, or the run is refused, naming the nodes (a storage URI needs no such check).
- A model directory that exists only on the driver's node (the tiny model the driver builds, a
  model copied to the head) is shipped through Ray's object store to the nodes that lack it,
  into the same path; one that cannot be written there is refused, naming the node.

Nodes with no CPU (a KubeRay head started with ``num-cpus: 0``) host no worker and are skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from rlhf.storage import is_uri

log = logging.getLogger("rlhf")

__all__ = ["NodeFilesError", "check_shared_dir", "ship_model_dirs", "worker_nodes"]

# Beyond this a model is not pushed through the object store: it belongs on shared storage.
MAX_SHIP_BYTES = 8 << 30


class NodeFilesError(RuntimeError):
    """A path the run needs is not on every node (a configuration problem: never retried)."""


def worker_nodes() -> list[tuple[str, str]]:
    """``(node_id, ip)`` of every alive node that can host a worker (has CPUs)."""
    import ray

    return [
        (n["NodeID"], n["NodeManagerAddress"])
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("CPU", 0) > 0
    ]


def _driver_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _on_nodes(
    nodes: list[tuple[str, str]], fn, args_per_node: list[tuple], timeout_s: float, what: str
) -> list:
    """``fn(*args)`` as a zero-CPU task pinned to each node; results in node order."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)
        for (node_id, _), args in zip(nodes, args_per_node, strict=True)
    ]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [nodes[refs.index(r)][1] for r in pending]
        for r in pending:
            ray.cancel(r, force=True)
        raise NodeFilesError(
            f"{what}: nodes {late} did not answer within {timeout_s:.0f} s (cluster.startup_timeout_s); "
            "are they alive (ray status)?"
        )
    return ray.get(refs)


def _sees(path: str) -> bool:
    return os.path.exists(path)


def check_shared_dir(path: str, timeout_s: float, setting: str = "train.output_dir") -> None:
    """Refuse a local ``path`` that some worker node does not share with the driver."""
    if is_uri(path):
        return
    nodes = [n for n in worker_nodes() if n[0] != _driver_node()]
    if not nodes:
        return  # every worker runs on the driver's node
    root = Path(path).absolute()
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f".rlhf-shared-{uuid.uuid4().hex}"
    marker.write_text("written by the driver; every node must see it\n")
    try:
        seen = _on_nodes(nodes, _sees, [(str(marker),)] * len(nodes), timeout_s, f"checking {setting}")
    finally:
        marker.unlink(missing_ok=True)
    blind = [ip for (_, ip), ok in zip(nodes, seen, strict=True) if not ok]
    if blind:
        relative = (
            f" ({path} is relative: to the driver's working dir, {Path.cwd()}, which a Ray job unpacks on "
            "each node separately; give an absolute path)"
            if not Path(path).is_absolute()
            else ""
        )
        raise NodeFilesError(
            f"{setting}={path} is not shared: nodes {blind} do not see the file the driver wrote in it "
            f"(each node has its own disk there){relative}. Ranks write their checkpoint parts into it, so a resume "
            f"would miss them. Use a directory every node mounts (NFS, a KubeRay PVC) or a storage URI, "
            f"e.g. {setting}=s3://bucket/run (docs/multi-node.md)"
        )


def _fingerprint(path: str) -> str | None:
    """Names and sizes of the files under ``path`` (None if it is not a directory)."""
    if not os.path.isdir(path):
        return None
    h = hashlib.sha1()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            h.update(f"{f.relative_to(path)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()


def _write_tree(path: str, files: dict[str, bytes]) -> str | None:
    """Write ``files`` under ``path`` (renamed into place whole); an error message or None."""
    tmp = f"{path.rstrip('/')}.rlhf-ship-{uuid.uuid4().hex[:8]}"
    try:
        for rel, data in files.items():
            dest = Path(tmp, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        if _fingerprint(path) is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ship_model_dirs(paths: list[str], timeout_s: float) -> None:
    """Copy each model dir in ``paths`` from the driver to the worker nodes that lack it."""
    import ray

    nodes = [n for n in worker_nodes() if n[0] != _driver_node()]
    for path in dict.fromkeys(p for p in paths if p and not is_uri(p)):
        if not nodes:
            return
        path = str(Path(path).absolute())
        want = _fingerprint(path)
        have = _on_nodes(nodes, _fingerprint, [(path,)] * len(nodes), timeout_s, f"looking for {path}")
        missing = [n for n, fp in zip(nodes, have, strict=True) if fp != want]
        if not missing:
            continue
        ips = [ip for _, ip in missing]
        different = [ip for (_, ip), fp in zip(nodes, have, strict=True) if fp is not None and fp != want]
        if different:
            raise NodeFilesError(
                f"model dir {path} differs on nodes {different} from the driver's copy (other files or sizes): "
                "put one copy on shared storage, or make them the same"
            )
        files = {str(f.relative_to(path)): f for f in sorted(Path(path).rglob("*")) if f.is_file()}
        size = sum(f.stat().st_size for f in files.values())
        if size > MAX_SHIP_BYTES:
            raise NodeFilesError(
                f"model dir {path} ({size / 2**30:.1f} GiB) exists only on the driver's node; nodes {ips} lack "
                f"it and it is too large to ship (> {MAX_SHIP_BYTES / 2**30:.0f} GiB): put it on storage every "
                "node mounts, or copy it to the same path on every node"
            )
        log.info("shipping %s (%.1f MB) to nodes %s, which lack it", path, size / 1e6, ips)
        ref = ray.put({rel: f.read_bytes() for rel, f in files.items()})
        errors = _on_nodes(missing, _write_tree, [(path, ref)] * len(missing), timeout_s, f"shipping {path}")
        failed = {ip: e for (_, ip), e in zip(missing, errors, strict=True) if e}
        if failed:
            raise NodeFilesError(
                f"model dir {path} exists only on the driver's node and could not be written on nodes "
                f"{failed}: put it on storage every node mounts, or copy it to the same path on every node"
            )
