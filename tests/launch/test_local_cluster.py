"""Several Ray nodes on one machine (scripts/local_cluster.sh: distinct loopback IPs, a temp dir
per node, private token auth; a head with no CPUs, as on KubeRay, and three worker nodes, the last
with a disk of its own at PRIVATE), and GRPO jobs submitted with launch/submit.sh: ranks and
engines spread over the nodes (checked from Ray's own view, the state API), outputs in a real
S3-compatible server, `ray job stop` -> checkpoint -> resubmission resumes; a local output dir the
last node cannot see is refused; a node lost during a checkpoint save is recovered once a
replacement node joins (the nodes left are too few), a second one on the nodes left; a node that
never comes back is named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
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


def _private_disks() -> bool:
    """Mount namespaces with a tmpfs (root on Linux), for a node without the shared disk."""
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs t /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


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
    env = _env(state)
    if _private_disks():
        env["RLHF_PRIVATE_DIR"] = str(state / "private")
        # every process stages under PRIVATE: the last node's staging (and the tiny model the
        # driver builds there) is its own
        env["RLHF_STAGING_DIR"] = str(state / "private" / "staging")
    env["RLHF_HEAD_CPUS"] = "0"  # the head runs drivers only: a lost worker node must be replaced
    start = subprocess.run(
        [str(SCRIPT), "start", "4", "2"], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
        yield state
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=_env(state), capture_output=True, timeout=120)


def _submit(cluster: Path, *overrides: str, wait: bool = True) -> subprocess.CompletedProcess:
    dashboard = (cluster / "dashboard").read_text().strip()
    return subprocess.run(
        [str(REPO / "launch" / "submit.sh"), "--address", dashboard, *(() if wait else ("--no-wait",)), "--", *overrides],
        env=_env(cluster), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


JOB = (
    "experiment=toy_count", "algorithm=grpo", "train.rollout_batch_size=4", "rollout.n_samples_per_prompt=2",
    "cluster.actor_ranks=2", "cluster.ref_ranks=2", "cluster.placement_strategy=strict_spread",
    "cluster.cpus_per_engine=2", "train.tensorboard=false",
)  # fmt: skip


def test_a_local_output_dir_the_nodes_do_not_share_is_refused(cluster):
    if not (cluster / "private").is_dir():
        pytest.skip("no mount namespaces here (needs root): every node shares this disk")
    t0 = time.perf_counter()
    proc = _submit(cluster, *JOB, "train.num_steps=1", f"train.output_dir={cluster / 'private' / 'out'}")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "is not shared: nodes ['127.0.0.5'] do not see the file" in out, out[-3000:]
    assert "s3://" in out  # the message names the way out
    print(f"\nrefused in {time.perf_counter() - t0:.1f} s")


# Ships a model dir that only the driver's disk has to the node with a private disk; prints
# [what that node saw before, after, the driver's fingerprint].
SHIP = """
import json, sys
import ray
from rlhf.models.tiny import build_tiny_model
from rlhf.workers import node_files as nf
ray.init(address=sys.argv[1])
path = str(build_tiny_model(sys.argv[2], arch="llama"))
private = [n for n in nf.worker_nodes() if n[1] == sys.argv[3]]
before = nf._on_nodes(private, nf._fingerprint, [(path,)], 60, "probe")[0]
nf.ship_model_dirs([path], 120)
after = nf._on_nodes(private, nf._fingerprint, [(path,)], 60, "probe")[0]
print(json.dumps([before, after, nf._fingerprint(path)]))
"""


def test_a_model_dir_only_the_driver_has_is_shipped(cluster):
    if not (cluster / "private").is_dir():
        pytest.skip("no mount namespaces here (needs root): every node shares this disk")
    address = (cluster / "address").read_text().strip()
    proc = subprocess.run(
        [sys.executable, "-c", SHIP, address, str(cluster / "private" / "model"), "127.0.0.5"],
        env=_env(cluster), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, driver = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before is None and after == driver is not None


def _logs(cluster: Path, job_id: str) -> str:
    dashboard = (cluster / "dashboard").read_text().strip()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "job", "logs", "--address", dashboard, job_id],
        env=_env(cluster), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.stdout + proc.stderr


def _ended(cluster: Path, job_id: str) -> str:
    """The job's final status, or "" while it runs."""
    dashboard = (cluster / "dashboard").read_text().strip()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "job", "status", "--address", dashboard, job_id],
        env=_env(cluster), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # `ray job status` ends with "Job '...' succeeded" / "failed" / "was stopped" once the job ended
    out = (proc.stdout + proc.stderr).lower()
    return next((s.upper() for s in ("succeeded", "failed", "stopped") if s in out), "")


def _wait_for_log(cluster: Path, job_id: str, pattern: str, timeout_s: float) -> str:
    """The first line of the job's log matching ``pattern``, waiting for it up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (hit := re.search(pattern, logs := _logs(cluster, job_id))):
        assert time.monotonic() < deadline and not _ended(cluster, job_id), logs[-4000:]
        time.sleep(2)
    return logs[hit.start() : logs.find("\n", hit.start())][:300]


def _where(cluster: Path) -> tuple[dict, dict]:
    dashboard = (cluster / "dashboard").read_text().strip()
    view = subprocess.run(
        [sys.executable, "-c", STATE_VIEW, dashboard],
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert view.returncode == 0, view.stderr[-2000:]
    return tuple(json.loads(view.stdout.strip().splitlines()[-1]))


# Prints [[ip, pid, rank]] of the live actor ranks (ModelWorker actors of role actor, by name).
LIVE_RANKS = """
import json, sys
from ray.util.state import list_actors, list_nodes
ips = {n.node_id: n.node_ip for n in list_nodes(address=sys.argv[1])}
print(json.dumps([[ips[a.node_id], a.pid, a.name] for a in list_actors(
    address=sys.argv[1], limit=1000, detail=True, filters=[("state", "=", "ALIVE")])
    if a.class_name == "ModelWorker"]))
"""


def _step(store) -> int:
    """The step of ``checkpoints/latest`` (0 before the first save)."""
    return (
        int(store.read_text("checkpoints/latest").split("_")[1]) if store.is_file("checkpoints/latest") else 0
    )


def _wait_for_step(cluster: Path, store, job_id: str, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _step(store) < step:
        assert time.monotonic() < deadline and not _ended(cluster, job_id), _logs(cluster, job_id)[-3000:]
        time.sleep(0.5)


def _node_session(cluster: Path, ip: str) -> str:
    """The session id of the node at ``ip`` (its raylet and workers), from local_cluster.sh's files."""
    return (cluster / f"node-{int(ip.rsplit('.', 1)[1]) - 2}.sid").read_text().strip()


def _add_node(cluster: Path, cpus: int) -> str:
    """``local_cluster.sh add CPUS``; returns the new node's IP."""
    add = subprocess.run(
        [str(SCRIPT), "add", str(cpus)], env=_env(cluster), capture_output=True, text=True, timeout=180
    )
    joined = re.search(rf"node (127\.0\.0\.\d+) \({cpus} CPUs\) joined", add.stdout)
    assert add.returncode == 0 and joined, add.stdout + add.stderr
    return joined.group(1)


def _kill_an_actor_node_during_a_save(
    cluster: Path, store, job_id: str, spare: str = ""
) -> tuple[str, int, bool]:
    """Kills the worker node (its raylet and workers: what a lost machine does) of an actor rank,
    not the head nor ``spare``, while that rank writes its checkpoint part; returns (node ip,
    rank pid, `latest` not moved yet)."""
    dashboard = (cluster / "dashboard").read_text().strip()
    deadline = time.monotonic() + 60  # the state API may list a rebuilt group's actors late
    while True:
        live = subprocess.run(
            [sys.executable, "-c", LIVE_RANKS, dashboard], env=_env(cluster), capture_output=True, text=True, timeout=120
        )  # fmt: skip
        assert live.returncode == 0, live.stderr[-2000:]
        ranks = json.loads(live.stdout.strip().splitlines()[-1])
        if hit := [(ip, pid) for ip, pid, _ in ranks if ip not in ("127.0.0.2", spare)]:
            break
        ended = _ended(cluster, job_id)  # a job that finished has no rank left to hit
        assert time.monotonic() < deadline and not ended, (
            f"no actor rank off the head and {spare!r} ({f'job {ended}' if ended else 'in 60 s'}): {ranks};"
            f" saved step {_step(store)}\n" + _logs(cluster, job_id)[-3000:]
        )
        time.sleep(1)
    ip, pid = hit[0]
    # the rank's staging dir as its own node sees it (its mount namespace, through /proc)
    staging = Path(f"/proc/{pid}/root") / str(cluster / "private" / "staging" / "write")
    if not (cluster / "private").is_dir():
        staging = Path(tempfile.gettempdir()) / "rlhf-staging" / "write"
    saved = store.read_text("checkpoints/latest")
    deadline = time.monotonic() + 300
    while not (staging.is_dir() and any("-actor-" in p.name for p in staging.iterdir())):
        assert time.monotonic() < deadline, "no checkpoint save seen in 300 s"
        time.sleep(0.005)
    during_save = store.read_text("checkpoints/latest") == saved
    subprocess.run(["pkill", "-KILL", "-s", _node_session(cluster, ip)], check=False)
    return ip, pid, during_save


def _submit_and_stop(cluster: Path, store, job: tuple[str, ...]) -> int:
    """Submits the job, stops it with `ray job stop` after step 2; returns the step it stopped
    after (its checkpoint is the newest one)."""
    sub = _submit(cluster, *job, wait=False)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = re.search(r"raysubmit_\w+", sub.stdout + sub.stderr).group(0)
    _wait_for_step(cluster, store, job_id, 2, 400)
    dashboard = (cluster / "dashboard").read_text().strip()
    stop = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "job", "stop", "--address", dashboard, job_id],
        env=_env(cluster), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert stop.returncode == 0, stop.stdout + stop.stderr
    logs = _logs(cluster, job_id)
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+)", logs)
    assert stopped, logs[-3000:]
    step = int(stopped.group(1))
    assert _step(store) == step
    return step


def _check_resumed_twice_recovered_run(out: str, store, step: int, steps: int) -> None:
    """The resumed job's log and its outputs in the store: resumed at `step`, two recoveries,
    every step's metrics once, the final model, each rank's optimizer part and the logs."""
    assert f"at step {step}" in out and "resumed from s3://***@" in out, out[-3000:]
    story = "\n".join(  # the run's key lines, for a failure message
        x[:300]
        for x in out.splitlines()
        if re.search(r"worker died|recovery|resum|workers started|waiting up", x)
    )
    assert "recovery 1 of 2" in out and "recovery 2 of 2" in out, story
    assert f"done: {steps} steps" in out, out[-4000:]
    rows = [json.loads(x) for x in store.read_text("metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == list(range(1, steps + 1))
    files = store.list_files()
    assert "final/model.safetensors" in files and "final/tokenizer.json" in files
    ranks = [f for f in files if f.startswith(f"checkpoints/step_{steps}/actor/") and "optim_states" in f]
    assert len(ranks) == 2, files  # each rank's optimizer part
    logs_up = {f.split("/")[-1].split("-")[0] for f in files if f.startswith("logs/")}
    assert {"actor", "reference", "engine"} <= logs_up, files


def test_s3_job_is_stopped_resubmitted_and_survives_a_node_lost_during_a_save(cluster, s3_uri):
    """Runs last (it takes a node down). strict_spread puts the 2 colocated actor+reference ranks
    (2 CPUs each) on two nodes and the engine (2 CPUs) on the third: the three worker nodes are
    full (a node with a private disk gets the tiny model shipped); checkpoints, metrics, logs and
    the final model go to S3. `ray job stop` checkpoints; the resubmitted job resumes. A worker
    node holding an actor rank is killed while that rank writes its checkpoint part: the two nodes
    left cannot hold the run, so the recovery says it waits for nodes (cluster.startup_timeout_s);
    a replacement node with 4 CPUs joins, and the run rebuilds from the last complete checkpoint.
    Then a second node with an actor rank is lost during a save: the nodes left (the replacement's
    spare CPUs) suffice, and the run recovers on them with no node added. It finishes with every
    step's metrics once."""
    from rlhf.storage import Store

    store = Store(s3_uri)
    steps = 24
    job = (
        *JOB,
        f"train.num_steps={steps}",  # ~1 s a step here: long enough to be stopped, resumed and hit twice
        "train.save_every=1",
        "train.stop_grace_s=50",
        f'train.output_dir="{s3_uri}"',  # quoted for Hydra
    )
    t0 = time.perf_counter()
    step = _submit_and_stop(cluster, store, job)
    # room for two losses after it: a run that ends before the second kill leaves no rank to hit
    assert 2 <= step < steps - 10
    t_first = time.perf_counter() - t0
    ips, where = _where(cluster)  # the stopped job's actors, from Ray's own view
    assert sorted(set(ips.values())) == ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    workers, engines = where["ModelWorker"], where["RolloutEngine"]
    assert len(workers) == 4 and len(set(workers)) == 2 and all(workers.count(ip) == 2 for ip in set(workers))
    assert len(engines) == 1 and engines[0] not in workers  # a node of its own

    resub = _submit(cluster, *job, wait=False)
    assert resub.returncode == 0, resub.stdout + resub.stderr
    job_id = re.search(r"raysubmit_\w+", resub.stdout + resub.stderr).group(0)
    _wait_for_step(cluster, store, job_id, step + 1, 400)  # resumed and saved: every rank is up
    ip, pid, during_save = _kill_an_actor_node_during_a_save(cluster, store, job_id)
    t_kill = time.perf_counter() - t0
    # the run says that it waits for nodes (what a user sees); the pattern stops before the dead
    # nodes: Ray may not have marked the lost node dead by then
    waiting = _wait_for_log(cluster, job_id, r"waiting up to \d+ s more \(cluster.startup_timeout_s\)", 300)
    t_waiting = time.perf_counter() - t0
    assert _add_node(cluster, 4) == "127.0.0.6"
    t_added = time.perf_counter() - t0
    _wait_for_step(cluster, store, job_id, _step(store) + 1, 400)  # recovered and saved
    ip2, _, during_save2 = _kill_an_actor_node_during_a_save(cluster, store, job_id, spare="127.0.0.6")
    t_kill2 = time.perf_counter() - t0
    deadline = time.monotonic() + 500
    while not (status := _ended(cluster, job_id)):
        assert time.monotonic() < deadline, _logs(cluster, job_id)[-4000:]
        time.sleep(2)
    out = _logs(cluster, job_id)
    assert status == "SUCCEEDED", out[-4000:]
    _check_resumed_twice_recovered_run(out, store, step, steps)
    _, where = _where(cluster)  # every actor the jobs made, from Ray's own view
    assert "127.0.0.6" in where["ModelWorker"] + where["RolloutEngine"], where  # the replacement was used
    print(
        f"\nModelWorker nodes {sorted(workers)}, RolloutEngine node {engines}; stopped after step {step} "
        f"at {t_first:.0f} s; resumed, then killed node {ip} (actor rank pid {pid}) at {t_kill:.0f} s, "
        f"during a save: {during_save}; the recovery waited for nodes at {t_waiting:.0f} s ({waiting}); "
        f"node 127.0.0.6 joined at {t_added:.0f} s; recovered, then killed node {ip2} at {t_kill2:.0f} s, "
        f"during a save: {during_save2}; recovered on the nodes left and done at {time.perf_counter() - t0:.0f} s; "
        + re.search(r"a worker died: [^\n]*", out).group(0)[:300]
    )


# A driver that placed a group while the node at sys.argv[2] lived, then loses that node (kills
# session sys.argv[3]: the node's raylet and workers) and asks for two groups the cluster cannot
# grant; prints [seconds until Ray marked the node dead, error of an ask the dead node could have
# held, error of one it could not].
NEVER_BACK = """
import json, subprocess, sys, time
import ray
from rlhf.workers.placement import create_placement_group
ray.init(address=sys.argv[1])
ray.util.remove_placement_group(create_placement_group(1, 1, 0, timeout_s=60, name="before"))
subprocess.run(["pkill", "-KILL", "-s", sys.argv[3]], check=False)
t0 = time.monotonic()
while any(n["NodeManagerAddress"] == sys.argv[2] and n["Alive"] for n in ray.nodes()):
    assert time.monotonic() - t0 < 120, "Ray did not mark the killed node dead in 120 s"
    time.sleep(0.5)
biggest = max(n["Resources"].get("CPU", 0) for n in ray.nodes())
errors = []
for n, cpus in ((sum(n["Alive"] for n in ray.nodes()) + 1, 1), (1, biggest + 1)):
    try:
        create_placement_group(n, cpus, 0, "STRICT_SPREAD", timeout_s=2, name="probe")
    except RuntimeError as e:
        errors.append(str(e))
print(json.dumps([time.monotonic() - t0, *errors]))
"""


def test_a_node_that_does_not_come_back_is_named(cluster):
    """A node with 1 CPU joins and is lost for good. An ask it could have held names it (what a
    recovery that waited out cluster.startup_timeout_s says); an ask no node could hold (more
    CPUs a bundle than any node has) blames only the resources."""
    ip = _add_node(cluster, 1)
    address = (cluster / "address").read_text().strip()
    proc = subprocess.run(
        [sys.executable, "-c", NEVER_BACK, address, ip, _node_session(cluster, ip)],
        env=_env(cluster), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dead_after, fits, too_big = json.loads(proc.stdout.strip().splitlines()[-1])
    named = re.search(r"nodes \[([^\]]*)\] died and no node with their resources joined within 2 s", fits)
    assert named and f"'{ip}'" in named.group(1), fits
    assert "cluster.startup_timeout_s" in fits and "add nodes" in fits
    assert "died" not in too_big and "not ready after 2s" in too_big, too_big
    print(f"\nnode {ip} killed, marked dead after {dead_after:.0f} s; {fits[:160]}")
