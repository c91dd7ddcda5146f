"""Several Ray nodes on one machine (scripts/local_cluster.sh: distinct loopback IPs, a temp dir
per node, private token auth), and a GRPO job submitted to it with launch/submit.sh that spreads
its ranks and engines over the nodes, checked from Ray's own view (the state API)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local_cluster.sh"
# Prints [node_id -> ip, class -> [ip of each of its actors]] for the workers of the finished job.
STATE_VIEW = """
import json, sys
from ray.util.state import list_actors, list_nodes
ips = {n.node_id: n.node_ip for n in list_nodes(address=sys.argv[1])}
where = {}
for a in list_actors(address=sys.argv[1], limit=1000, detail=True):
    if a.class_name in ("ModelWorker", "RolloutEngine"):
        where.setdefault(a.class_name, []).append(ips[a.node_id])
print(json.dumps([ips, where]))
"""


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["RLHF_CLUSTER_DIR"] = str(state)
    env["RAY_CLI"] = str(Path(sys.executable).with_name("ray"))
    for line in (
        (state / "env").read_text().split("export ", 1)[-1].split() if (state / "env").exists() else []
    ):
        key, _, value = line.partition("=")
        env[key] = value
    env.pop("RAY_ADDRESS", None)  # submit.sh takes --address (the dashboard)
    return env


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    state = Path(tempfile.mkdtemp(prefix="rlhf-cl-", dir="/tmp"))
    start = subprocess.run(
        [str(SCRIPT), "start", "3", "2"], env=_env(state), capture_output=True, text=True, timeout=300
    )
    try:
        assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
        yield state
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=_env(state), capture_output=True, timeout=120)


def test_spread_grpo_job_puts_ranks_and_engines_on_different_nodes(cluster, tmp_path):
    env = _env(cluster)
    dashboard = (cluster / "dashboard").read_text().strip()
    proc = subprocess.run(
        [str(REPO / "launch" / "submit.sh"), "--address", dashboard, "--",
         "experiment=toy_count", "algorithm=grpo", "train.num_steps=2", "train.rollout_batch_size=4",
         "rollout.n_samples_per_prompt=2", "cluster.actor_ranks=2", "cluster.ref_ranks=2",
         "cluster.placement_strategy=strict_spread", "train.tensorboard=false", f"train.output_dir={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "done: 2 steps" in proc.stdout
    # Ray's own view, from a process of the cluster's env (Ray reads its auth mode once per process)
    view = subprocess.run(
        [sys.executable, "-c", STATE_VIEW, dashboard], env=env, capture_output=True, text=True, timeout=120
    )
    assert view.returncode == 0, view.stderr[-2000:]
    ips, where = json.loads(view.stdout.strip().splitlines()[-1])
    assert sorted(set(ips.values())) == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    # colocated actor + reference rank i share bundle i; strict_spread: one bundle per node
    workers, engines = where["ModelWorker"], where["RolloutEngine"]
    assert len(workers) == 4 and len(set(workers)) == 2 and all(workers.count(ip) == 2 for ip in set(workers))
    assert len(engines) == 1 and engines[0] not in workers  # the third node
    print(f"\nModelWorker nodes {sorted(workers)}, RolloutEngine node {engines}")
