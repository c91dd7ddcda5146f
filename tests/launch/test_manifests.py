"""Structural checks for the launch files: KubeRay manifests and runtime_env.yaml.

No cluster is involved. The KubeRay manifests are checked against a hand-written JSON schema for
the subset of the ray.io/v1 RayCluster/RayJob fields we use (field names as in KubeRay's
ray-operator/apis/ray/v1/*_types.go), plus cross-field rules a schema cannot express. Unknown
keys are rejected at the KubeRay levels: the API server drops unknown fields of a custom resource
(kubectl at most warns), so a misspelt `shutdownAfterJobFinishes` would leave GPU nodes running.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "launch" / "k8s"
RUNTIME_ENV = REPO / "launch" / "runtime_env.yaml"

GPU = "nvidia.com/gpu"

# --- JSON schema ---------------------------------------------------------------------------------

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_GPU_QUANTITY = {
    "anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": r"^[1-9][0-9]*$"}]
}
_RESOURCE_LIST = {
    "type": "object",
    "properties": {GPU: _GPU_QUANTITY},
    "additionalProperties": {"type": ["string", "integer", "number"]},
}
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "image": {"type": "string", "minLength": 1},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                # Kubernetes rejects non-string env values; YAML turns a bare 1 into an int.
                "properties": {"name": {"type": "string", "minLength": 1}, "value": {"type": "string"}},
            },
        },
        "resources": {
            "type": "object",
            "properties": {"limits": _RESOURCE_LIST, "requests": _RESOURCE_LIST},
            "additionalProperties": False,
        },
        "volumeMounts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "mountPath"],
                "properties": {"name": {"type": "string"}, "mountPath": {"type": "string"}},
            },
        },
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                "volumes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        }
    },
}
_HEAD_GROUP = {
    "type": "object",
    "required": ["rayStartParams", "template"],
    "additionalProperties": False,
    "properties": {
        "rayStartParams": {
            **_STRING_MAP,
            "required": ["num-cpus", "dashboard-host"],
            # Nothing may be scheduled on the head: it hosts the GCS, whose loss ends the cluster.
            "properties": {"num-cpus": {"const": "0"}},
        },
        "template": _POD_TEMPLATE,
        "serviceType": {"type": "string"},
        "headService": {"type": "object"},
        "enableIngress": {"type": "boolean"},
    },
}
_REPLICAS = {"type": "integer", "minimum": 0}
_WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"],
    "additionalProperties": False,
    "properties": {
        "groupName": {"type": "string", "minLength": 1},
        "replicas": _REPLICAS,
        "minReplicas": _REPLICAS,
        "maxReplicas": _REPLICAS,
        "numOfHosts": {"type": "integer", "minimum": 1},
        "rayStartParams": _STRING_MAP,
        "template": _POD_TEMPLATE,
        "scaleStrategy": {"type": "object"},
        "idleTimeoutSeconds": {"type": "integer"},
        "suspend": {"type": "boolean"},
    },
}
_RAYCLUSTER_SPEC = {
    "type": "object",
    "required": ["rayVersion", "headGroupSpec", "workerGroupSpecs"],
    "additionalProperties": False,
    "properties": {
        "rayVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "autoscalerOptions": {"type": "object"},
        "headServiceAnnotations": _STRING_MAP,
        "authOptions": {
            "type": "object",
            "required": ["mode"],
            "additionalProperties": False,
            "properties": {"mode": {"enum": ["token", "disabled"]}},
        },
        "suspend": {"type": "boolean"},
        "headGroupSpec": _HEAD_GROUP,
        "workerGroupSpecs": {"type": "array", "minItems": 1, "items": _WORKER_GROUP},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}},
}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


RAYCLUSTER_SCHEMA = _resource("RayCluster", _RAYCLUSTER_SPEC)
RAYJOB_SCHEMA = _resource(
    "RayJob",
    {
        "type": "object",
        "required": [
            "entrypoint", "runtimeEnvYAML", "submissionMode", "shutdownAfterJobFinishes",
            "ttlSecondsAfterFinished", "rayClusterSpec",
        ],
        "additionalProperties": False,
        "properties": {
            "entrypoint": {"type": "string", "pattern": r"^python -m rlhf\.[A-Za-z_][\w.]*( |$)"},
            "runtimeEnvYAML": {"type": "string"},
            "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
            "shutdownAfterJobFinishes": {"type": "boolean"},
            "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
            "backoffLimit": {"type": "integer", "minimum": 0},
            "suspend": {"type": "boolean"},
            "jobId": {"type": "string"},
            "metadata": _STRING_MAP,
            "entrypointNumCpus": {"type": "number"},
            "entrypointNumGpus": {"type": "number"},
            "entrypointResources": {"type": "string"},
            "submitterPodTemplate": _POD_TEMPLATE,
            "submitterConfig": {"type": "object"},
            "rayClusterSpec": _RAYCLUSTER_SPEC,
        },
    },
)  # fmt: skip

for _schema in (RAYCLUSTER_SCHEMA, RAYJOB_SCHEMA):
    jsonschema.Draft202012Validator.check_schema(_schema)


# --- validators ----------------------------------------------------------------------------------


class ManifestError(ValueError):
    pass


def _schema_errors(doc: Any, schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _cluster_errors(spec: dict[str, Any], where: str) -> list[str]:
    """Rules across fields, run only on a schema-valid spec."""
    errors: list[str] = []
    groups = [("headGroupSpec", spec["headGroupSpec"])]
    groups += [(f"workerGroupSpecs/{i}", g) for i, g in enumerate(spec["workerGroupSpecs"])]
    any_gpu = False
    # Unauthenticated, the dashboard/GCS let any pod that reaches them run code (Ray job API).
    if spec.get("authOptions", {}).get("mode") != "token":
        errors.append(f"{where}: authOptions.mode is not token (Ray token authentication off)")
    for path, group in groups:
        pod = group["template"]["spec"]
        errors += _security_errors(group["template"], f"{where}/{path}")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            cpath = f"{where}/{path}/{c['name']}"
            res = c.get("resources", {})
            lim, req = res.get("limits", {}).get(GPU), res.get("requests", {}).get(GPU)
            if lim is not None or req is not None:
                any_gpu = True
                # Kubernetes cannot overcommit GPUs: a request without the same limit is refused.
                if lim is None:
                    errors.append(f"{cpath}: requests {GPU} without limits")
                elif req is not None and int(req) != int(lim):
                    errors.append(f"{cpath}: {GPU} requests {req} != limits {lim}")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    errors.append(f"{cpath}: volumeMount {m['name']!r} has no volume")
        if path.startswith("workerGroupSpecs"):
            if not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
                errors.append(f"{where}/{path}: replicas outside [minReplicas, maxReplicas]")
            # KubeRay runs Ray in the first container; vLLM and NCCL need a real /dev/shm there.
            ray_container = pod["containers"][0]
            shm = [m for m in ray_container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if not shm:
                errors.append(f"{where}/{path}: /dev/shm is not mounted in {ray_container['name']}")
            for m in shm:
                empty_dir = volumes.get(m["name"], {}).get("emptyDir")
                if not isinstance(empty_dir, dict) or empty_dir.get("medium") != "Memory":
                    errors.append(f"{where}/{path}: /dev/shm volume is not an emptyDir with medium Memory")
    if not any_gpu:
        errors.append(f"{where}: no container requests {GPU}")
    return errors


RLHF_LABEL = {"app.kubernetes.io/name": "rlhf"}  # what launch/k8s/networkpolicy.yaml selects


def _security_errors(template: dict[str, Any], where: str) -> list[str]:
    """Non-root, no privilege escalation, and the label the NetworkPolicy selects."""
    errors = []
    labels = template.get("metadata", {}).get("labels", {})
    if any(labels.get(k) != v for k, v in RLHF_LABEL.items()):
        errors.append(f"{where}: pod template lacks the label {RLHF_LABEL} (the NetworkPolicy would miss it)")
    pod_sc = template["spec"].get("securityContext", {})
    if pod_sc.get("runAsNonRoot") is not True or pod_sc.get("runAsUser", 0) == 0:
        errors.append(f"{where}: pod securityContext must set runAsNonRoot: true and a non-zero runAsUser")
    for c in template["spec"]["containers"]:
        if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
            errors.append(f"{where}/{c['name']}: securityContext.allowPrivilegeEscalation must be false")
    return errors


def validate_raycluster(doc: Any) -> None:
    errors = _schema_errors(doc, RAYCLUSTER_SCHEMA)
    if not errors:
        errors = _cluster_errors(doc["spec"], "spec")
    if errors:
        raise ManifestError("\n".join(errors))


def validate_rayjob(doc: Any) -> None:
    errors = _schema_errors(doc, RAYJOB_SCHEMA)
    if not errors:
        spec = doc["spec"]
        errors = _cluster_errors(spec["rayClusterSpec"], "spec/rayClusterSpec")
        try:
            runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as e:
            errors.append(f"spec/runtimeEnvYAML: not YAML: {e}")
        else:
            if not isinstance(runtime_env, dict):
                errors.append("spec/runtimeEnvYAML: not a mapping")
            elif "working_dir" in runtime_env and not str(runtime_env["working_dir"]).startswith(
                ("s3://", "gs://", "https://")
            ):
                # The submitter pod has no checkout; a local path there uploads the wrong tree.
                errors.append("spec/runtimeEnvYAML: local working_dir; the code ships in the image")
    if errors:
        raise ManifestError("\n".join(errors))


def _load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture
def raycluster() -> dict[str, Any]:
    return _load(K8S / "raycluster.yaml")


@pytest.fixture
def rayjob() -> dict[str, Any]:
    return _load(K8S / "rayjob.yaml")


@pytest.fixture
def runtime_env() -> dict[str, Any]:
    return _load(RUNTIME_ENV)


# --- the real manifests --------------------------------------------------------------------------


def test_raycluster_is_valid(raycluster: dict[str, Any]) -> None:
    validate_raycluster(raycluster)
    assert raycluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_rayjob_is_valid(rayjob: dict[str, Any]) -> None:
    validate_rayjob(rayjob)
    spec = rayjob["spec"]
    assert spec["entrypoint"].startswith("python -m rlhf.")
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True


def test_rayjob_entrypoint_resolves(rayjob: dict[str, Any]) -> None:
    # A renamed module or config option would otherwise only fail once the GPU cluster is up.
    _, _, module, *overrides = rayjob["spec"]["entrypoint"].split()
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    # `group=option` overrides name files under conf/.
    checked = 0
    for override in overrides:
        key, _, value = override.partition("=")
        if (REPO / "conf" / key).is_dir():
            assert (REPO / "conf" / key / f"{value}.yaml").is_file(), override
            checked += 1
    assert checked, "the entrypoint selects no config group (expected at least cluster=gpu)"
    # The whole command line must also pass the typed config's validation, not just name files.
    from rlhf.config import compose

    cfg = compose(module.rsplit(".", 1)[-1], overrides)
    assert cfg.cluster.device == "cuda"
    assert cfg.train.max_tokens_per_microbatch >= cfg.rollout.max_model_len


def test_rayjob_cluster_matches_raycluster(raycluster: dict[str, Any], rayjob: dict[str, Any]) -> None:
    assert rayjob["spec"]["rayClusterSpec"] == raycluster["spec"], (
        "launch/k8s/rayjob.yaml's rayClusterSpec drifted from launch/k8s/raycluster.yaml's spec"
    )


def test_rayjob_env_vars_match_runtime_env(rayjob: dict[str, Any], runtime_env: dict[str, Any]) -> None:
    job_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert job_env["env_vars"] == runtime_env["env_vars"]


def test_ray_version_matches_pinned_ray(raycluster: dict[str, Any]) -> None:
    # KubeRay picks the submitter's CLI syntax from rayVersion; it must be the Ray in the image.
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"ray[default]=={raycluster["spec"]["rayVersion"]}"' in pyproject


# --- the validators reject broken manifests ------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    return spec["workerGroupSpecs"][0]


def _worker_container(spec: dict[str, Any]) -> dict[str, Any]:
    return _worker(spec)["template"]["spec"]["containers"][0]


def _dshm_volume(spec: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in _worker(spec)["template"]["spec"]["volumes"] if v["name"] == "dshm")


CLUSTER_MUTATIONS: dict[str, Mutation] = {
    "no-headGroupSpec": lambda s: s.pop("headGroupSpec"),
    "no-workerGroupSpecs": lambda s: s.pop("workerGroupSpecs"),
    "no-groupName": lambda s: _worker(s).pop("groupName"),
    "no-maxReplicas": lambda s: _worker(s).pop("maxReplicas"),
    "replicas-as-string": lambda s: _worker(s).update(replicas="2"),
    "replicas-above-max": lambda s: _worker(s).update(replicas=_worker(s)["maxReplicas"] + 1),
    "misspelt-field": lambda s: s.update(workerGroupSpec=s.pop("workerGroupSpecs")),
    "gpu-as-word": lambda s: _worker_container(s)["resources"]["limits"].update({GPU: "eight"}),
    "gpu-fractional": lambda s: _worker_container(s)["resources"]["limits"].update({GPU: 0.5}),
    "gpu-requests-differ": lambda s: _worker_container(s)["resources"]["requests"].update({GPU: 4}),
    "gpu-requests-only": lambda s: _worker_container(s)["resources"]["limits"].pop(GPU),
    "no-gpu-anywhere": lambda s: [
        _worker_container(s)["resources"][k].pop(GPU) for k in ("limits", "requests")
    ],
    "no-dev-shm": lambda s: _worker_container(s).update(
        volumeMounts=[m for m in _worker_container(s)["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    ),
    "dev-shm-on-disk": lambda s: _dshm_volume(s).update(emptyDir={}),
    "mount-without-volume": lambda s: _worker(s)["template"]["spec"].update(
        volumes=[v for v in _worker(s)["template"]["spec"]["volumes"] if v["name"] != "data"]
    ),
    "head-takes-work": lambda s: s["headGroupSpec"]["rayStartParams"].update({"num-cpus": "4"}),
    "head-num-cpus-int": lambda s: s["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
    "head-no-num-cpus": lambda s: s["headGroupSpec"]["rayStartParams"].pop("num-cpus"),
    "env-value-int": lambda s: _worker_container(s)["env"].append({"name": "X", "value": 1}),
    "no-image": lambda s: _worker_container(s).pop("image"),
    "bad-rayVersion": lambda s: s.update(rayVersion="latest"),
    "no-token-auth": lambda s: s.pop("authOptions"),
    "token-auth-disabled": lambda s: s["authOptions"].update(mode="disabled"),
    "worker-as-root": lambda s: _worker(s)["template"]["spec"]["securityContext"].update(runAsUser=0),
    "head-may-be-root": lambda s: s["headGroupSpec"]["template"]["spec"].pop("securityContext"),
    "privilege-escalation": lambda s: _worker_container(s).pop("securityContext"),
    "worker-unlabelled": lambda s: _worker(s)["template"].pop("metadata"),
}


@pytest.mark.parametrize("mutate", CLUSTER_MUTATIONS.values(), ids=CLUSTER_MUTATIONS.keys())
def test_raycluster_validator_rejects(raycluster: dict[str, Any], mutate: Mutation) -> None:
    bad = copy.deepcopy(raycluster)
    mutate(bad["spec"])
    with pytest.raises(ManifestError):
        validate_raycluster(bad)


@pytest.mark.parametrize("mutate", CLUSTER_MUTATIONS.values(), ids=CLUSTER_MUTATIONS.keys())
def test_rayjob_validator_rejects_bad_cluster(rayjob: dict[str, Any], mutate: Mutation) -> None:
    bad = copy.deepcopy(rayjob)
    mutate(bad["spec"]["rayClusterSpec"])
    with pytest.raises(ManifestError):
        validate_rayjob(bad)


RESOURCE_MUTATIONS: dict[str, Mutation] = {
    "old-apiVersion": lambda d: d.update(apiVersion="ray.io/v1alpha1"),
    "no-apiVersion": lambda d: d.pop("apiVersion"),
    "no-metadata-name": lambda d: d["metadata"].pop("name"),
    "bad-name": lambda d: d["metadata"].update(name="RLHF_PPO"),
}


@pytest.mark.parametrize("mutate", RESOURCE_MUTATIONS.values(), ids=RESOURCE_MUTATIONS.keys())
def test_validators_reject_bad_resource(
    raycluster: dict[str, Any], rayjob: dict[str, Any], mutate: Mutation
) -> None:
    for doc, validate in ((raycluster, validate_raycluster), (rayjob, validate_rayjob)):
        bad = copy.deepcopy(doc)
        mutate(bad)
        with pytest.raises(ManifestError):
            validate(bad)


def test_validators_reject_wrong_kind(raycluster: dict[str, Any], rayjob: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        validate_raycluster(rayjob)
    with pytest.raises(ManifestError):
        validate_rayjob(raycluster)


JOB_MUTATIONS: dict[str, Mutation] = {
    "no-entrypoint": lambda s: s.pop("entrypoint"),
    "entrypoint-not-rlhf": lambda s: s.update(entrypoint="python train.py cluster=gpu"),
    "entrypoint-prefix-only": lambda s: s.update(entrypoint="python -m rlhf."),
    "no-shutdown": lambda s: s.pop("shutdownAfterJobFinishes"),
    "shutdown-as-string": lambda s: s.update(shutdownAfterJobFinishes="true"),
    "misspelt-shutdown": lambda s: s.update(shutdownAfterJobFinish=s.pop("shutdownAfterJobFinishes")),
    "no-ttl": lambda s: s.pop("ttlSecondsAfterFinished"),
    "negative-ttl": lambda s: s.update(ttlSecondsAfterFinished=-1),
    "bad-submissionMode": lambda s: s.update(submissionMode="JobMode"),
    "no-rayClusterSpec": lambda s: s.pop("rayClusterSpec"),
    "runtime-env-not-yaml": lambda s: s.update(runtimeEnvYAML="env_vars: [unclosed"),
    "runtime-env-local-working-dir": lambda s: s.update(runtimeEnvYAML="working_dir: .\n"),
}


@pytest.mark.parametrize("mutate", JOB_MUTATIONS.values(), ids=JOB_MUTATIONS.keys())
def test_rayjob_validator_rejects(rayjob: dict[str, Any], mutate: Mutation) -> None:
    bad = copy.deepcopy(rayjob)
    mutate(bad["spec"])
    with pytest.raises(ManifestError):
        validate_rayjob(bad)


# --- security: NetworkPolicy, image user, preemption -----------------------------------------------


def test_networkpolicy_fences_the_ray_pods(raycluster: dict[str, Any]) -> None:
    policy = _load(K8S / "networkpolicy.yaml")
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == RLHF_LABEL
    assert "Ingress" in spec["policyTypes"]
    for rule in spec["ingress"]:
        sources = rule.get("from")
        # A rule open to every source may only open the token-protected dashboard port.
        if not sources:
            assert [p["port"] for p in rule["ports"]] == [8265], rule
        else:
            assert all(src.get("podSelector", {}).get("matchLabels") == RLHF_LABEL for src in sources), rule


def test_image_runs_as_the_manifests_non_root_user(raycluster: dict[str, Any]) -> None:
    users = [
        line.split()[1]
        for line in (REPO / "docker" / "Dockerfile").read_text().splitlines()
        if line.startswith("USER ")
    ]
    assert users, "docker/Dockerfile has no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root")
    for group in [raycluster["spec"]["headGroupSpec"], *raycluster["spec"]["workerGroupSpecs"]]:
        assert str(group["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_preemption_gives_the_driver_time_to_checkpoint(
    raycluster: dict[str, Any], rayjob: dict[str, Any]
) -> None:
    from rlhf.config import compose

    grace = compose("ppo", ["experiment=toy_count"]).train.stop_grace_s
    head = raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    # Kubernetes' SIGKILL and `ray job stop`'s must both come after the driver's own deadline.
    assert head["terminationGracePeriodSeconds"] > grace
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) > grace
    # `ray job submit` (launch/submit.sh) too: Ray's job supervisor reads the wait from the job's
    # runtime_env; its default of 3 s killed the driver before its checkpoint was written.
    runtime_env = yaml.safe_load((REPO / "launch" / "runtime_env.yaml").read_text())
    assert (
        int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"])
        == int(env["RAY_JOB_STOP_WAIT_TIME_S"])
        > grace
    )
    # A restarted job resumes: it is retried, and its output dir is on the shared volume.
    assert rayjob["spec"]["backoffLimit"] >= 1
    _, _, module, *overrides = rayjob["spec"]["entrypoint"].split()
    cfg = compose(module.rsplit(".", 1)[-1], overrides)
    assert cfg.train.resume == "auto" and cfg.train.output_dir.startswith("/data/")


# --- runtime_env.yaml ----------------------------------------------------------------------------


def test_runtime_env_loads(runtime_env: dict[str, Any]) -> None:
    assert runtime_env["working_dir"] == "."
    for pattern in (".git", ".venv", "outputs", "runs", "*.egg-info", "__pycache__"):
        assert pattern in runtime_env["excludes"]
    env = runtime_env["env_vars"]
    assert env == {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "RAY_JOB_STOP_WAIT_TIME_S": "60",
    }
    # CPU-only settings belong to the CPU entry point; on a GPU cluster they would break vLLM/DeepSpeed.
    assert not {"VLLM_CPU_KVCACHE_SPACE", "DS_ACCELERATOR"} & env.keys()


def test_runtime_env_accepted_by_ray(runtime_env: dict[str, Any]) -> None:
    runtime_env_mod = pytest.importorskip("ray.runtime_env")
    runtime_env_mod.RuntimeEnv(**runtime_env)
    # The same check fails for the unquoted form, so the test above is not vacuous.
    with pytest.raises(TypeError):
        runtime_env_mod.RuntimeEnv(env_vars={"HF_HUB_OFFLINE": 1})
