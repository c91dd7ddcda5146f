"""Weight sync parts the CPU can check: bucket plan, engine names, per-bucket stream, config rules.

The NCCL / CUDA-IPC transports themselves need GPUs; the per-bucket ZeRO-3 gather is checked
with real DeepSpeed in tests/workers/test_deepspeed_group.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.config.schema import ClusterConfig, PPOConfig, RolloutConfig, TrainConfig
from rlhf.trainer.engine_sync import EngineSync
from rlhf.trainer.setup import _bundles, _roles
from rlhf.workers.weight_sync import (
    TensorMeta,
    check_weight_sync,
    engine_param_name,
    gathered_weights,
    param_metas,
    plan_buckets,
    resolve_weight_sync,
)

pytestmark = pytest.mark.cpu


def metas(*sizes: int) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]


def test_bucket_plan_keeps_order_and_bounds_each_bucket():
    ms = metas(10, 10, 10, 50, 5, 5, 30)  # float32: 4 bytes each
    plan = plan_buckets(ms, 100)
    assert [list(b) for b in plan] == [[0, 1], [2], [3], [4, 5], [6]]
    # Every index once, in order; no bucket over 100 bytes unless one tensor alone is.
    assert [i for b in plan for i in b] == list(range(len(ms)))
    for b in plan:
        size = sum(ms[i].nbytes for i in b)
        assert size <= 100 or len(b) == 1


def test_oversized_tensor_gets_a_bucket_of_its_own_and_bad_size_is_refused():
    assert [list(b) for b in plan_buckets(metas(1, 1000, 1), 16)] == [[0], [1], [2]]
    assert [list(b) for b in plan_buckets(metas(1, 1, 1), 1 << 20)] == [[0, 1, 2]]
    assert plan_buckets([], 16) == []
    with pytest.raises(ValueError, match="rollout.sync_bucket_mb"):
        plan_buckets(metas(1), 0)


@pytest.mark.parametrize(
    "name,want",
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),  # DeepSpeed / DDP wrapper
        ("_orig_mod.lm_head.weight", "lm_head.weight"),  # torch.compile
        ("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),
    ],
)
def test_engine_param_name(name, want):
    assert engine_param_name(name) == want


def wrapped_tiny_model(model_dir: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapper = torch.nn.Module()
    wrapper.module = model  # how DeepSpeed's engine exposes the model: ``module.`` prefix
    return wrapper, model


def test_stream_names_are_the_checkpoint_names_the_engine_loads(tiny_qwen2_dir):
    """Through the DeepSpeed-style wrapper, the sent names are exactly the saved safetensors keys
    (what vLLM's load_weights reads), tied weights once, tensors equal."""
    wrapper, _ = wrapped_tiny_model(tiny_qwen2_dir)
    saved = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    sent = list(gathered_weights(wrapper, bucket_bytes=4096, zero3=False))
    assert [n for n, _ in sent] == [m.name for m in param_metas(wrapper)]
    assert sorted(n for n, _ in sent) == sorted(saved)
    for n, t in sent:
        assert torch.equal(t, saved[n]), n


def test_stream_runs_the_bucket_hook_once_per_bucket(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ms = param_metas(model)
    bucket = 2 * max(m.nbytes for m in ms)
    seen: list[int] = []
    names = []
    for name, _ in gathered_weights(model, bucket, zero3=False, on_bucket=lambda: seen.append(len(names))):
        names.append(name)
    # The hook ran at the start of each planned bucket, before its first tensor.
    assert seen == [b.start for b in plan_buckets(ms, bucket)]


# ---------------------------------------------------------------------------- config rules
@pytest.mark.parametrize(
    "mode,device,colocate,want",
    [
        ("auto", "cpu", False, "object_store"),
        ("auto", "cuda", False, "nccl"),
        ("auto", "cuda", True, "ipc"),
        ("object_store", "cuda", True, "object_store"),
        ("nccl", "cuda", False, "nccl"),
    ],
)
def test_auto_weight_sync(mode, device, colocate, want):
    assert resolve_weight_sync(mode, device, colocate) == want


def test_the_hf_backend_always_syncs_through_the_object_store():
    assert resolve_weight_sync("auto", "cuda", False, "hf") == "object_store"
    assert resolve_weight_sync("object_store", "cpu", False, "hf") == "object_store"
    for mode, colocate in (("nccl", False), ("ipc", True), ("auto", True)):
        with pytest.raises(ValueError, match="rollout.backend=hf takes weights through the object store"):
            check_weight_sync(mode, "cuda", colocate, "hf")
    with pytest.raises(ValueError, match="rollout.backend=hf"):
        PPOConfig(
            rollout=RolloutConfig(backend="hf", weight_sync="nccl"), cluster=ClusterConfig(device="cuda")
        )
    with pytest.raises(ValueError, match="rollout.backend='sglang' is not valid"):
        RolloutConfig(backend="sglang")


@pytest.mark.parametrize(
    "fields,match",
    [
        (
            {"rollout": RolloutConfig(weight_sync="nccl")},
            r"rollout.weight_sync=nccl needs GPUs.*cluster.device=cpu",
        ),
        ({"rollout": RolloutConfig(weight_sync="ipc")}, r"rollout.weight_sync=ipc needs GPUs"),
        (
            {"cluster": ClusterConfig(colocate_engines=True)},
            r"cluster.colocate_engines=true needs cluster.device=cuda",
        ),
        (
            {"rollout": RolloutConfig(weight_sync="ipc"), "cluster": ClusterConfig(device="cuda")},
            r"weight_sync=ipc .* set cluster.colocate_engines=true",
        ),
        (
            {
                "cluster": ClusterConfig(device="cuda", colocate_engines=True),
                "train": TrainConfig(max_staleness=1),
            },
            r"set train.max_staleness=0",
        ),
        (
            {
                "cluster": ClusterConfig(device="cuda", colocate_engines=True),
                "rollout": RolloutConfig(num_engines=2),
            },
            r"rollout.num_engines \(2\) must be <= the largest cluster.\*_ranks",
        ),
        (  # OpenRLHF#726: NCCL will not put two ranks of one group on one GPU
            {
                "cluster": ClusterConfig(device="cuda", colocate_engines=True),
                "rollout": RolloutConfig(weight_sync="nccl"),
            },
            r"weight_sync=nccl with cluster.colocate_engines=true .*'Duplicate GPU detected'.*weight_sync=ipc",
        ),
        (  # engine 1 would sit on the critic's second GPU, where no actor rank exports handles
            {
                "cluster": ClusterConfig(device="cuda", colocate_engines=True, critic_ranks=2),
                "rollout": RolloutConfig(num_engines=2),
            },
            r"weight_sync=ipc: .* rollout.num_engines \(2\) must be <= cluster.actor_ranks \(1\)",
        ),
    ],
)
def test_gpu_only_choices_on_the_wrong_cluster_are_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**fields)


def test_colocated_engines_beyond_the_actor_ranks_are_fine_through_the_object_store():
    cfg = PPOConfig(
        cluster=ClusterConfig(device="cuda", colocate_engines=True, critic_ranks=2),
        rollout=RolloutConfig(num_engines=2, weight_sync="object_store"),
    )
    assert resolve_weight_sync(cfg.rollout.weight_sync, "cuda", True) == "object_store"


def test_bad_mode_and_sleep_level_are_refused():
    with pytest.raises(ValueError, match="rollout.weight_sync='rdma' is not valid"):
        RolloutConfig(weight_sync="rdma")
    with pytest.raises(ValueError, match="rollout.sleep_level"):
        RolloutConfig(sleep_level=3)
    with pytest.raises(ValueError, match="rollout.weight_sync"):
        check_weight_sync("rdma", "cuda", False)


def colocated(gpus_per_worker: float) -> PPOConfig:
    return PPOConfig(
        cluster=ClusterConfig(
            device="cuda",
            colocate_engines=True,
            actor_ranks=2,
            gpus_per_worker=gpus_per_worker,
            gpus_per_engine=0.5,
        ),
        rollout=RolloutConfig(num_engines=2),
    )


def test_colocated_engines_join_the_training_bundles():
    cfg = colocated(0.15)
    roles = _roles(cfg, "m")
    assert len(roles) == 3  # actor, reference, critic
    bundles = _bundles(cfg, roles)
    assert set(bundles) == {"all"}  # no placement group of their own
    n, cpus, gpus = bundles["all"]
    assert n == 2 and gpus == pytest.approx(0.15 * 3 + 0.5)
    separate = _bundles(PPOConfig(cluster=ClusterConfig(device="cuda", gpus_per_engine=1.0)), roles)
    assert separate["engines"] == (1, 1.0, 1.0)


def test_colocated_shares_over_one_gpu_are_refused_before_anything_is_reserved():
    # 3 roles x 0.25 + 0.5 = 1.25: Ray would grant it and might split the bundle over two GPUs.
    with pytest.raises(ValueError, match=r"bundle i asks 1.25 GPUs .* cluster.gpus_per_worker=0.167"):
        _bundles(colocated(0.25), _roles(colocated(0.25), "m"))


# ---------------------------------------------------------------------------- sleep / push order
class FakeGpuPool:
    """Records what EngineSync asks of the engines (sleep mode and transfers need GPUs)."""

    def __init__(self, calls: list) -> None:
        self.calls, self.engines, self.engine_workers = calls, ["e0", "e1"], 2

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def update_weights(self, ref, version=None):
        self.calls.append(("update_weights", ref, version))

    def expect_version(self, version):
        self.calls.append(("expect_version", version))

    def transferred(self, version=None):
        self.calls.append(("transferred", version))


class FakeGpuActor:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def get_weights_ref(self, bucket_bytes):
        self.calls.append(("get_weights_ref", bucket_bytes))
        return "ref"

    def open_weight_transfer(self, mode, engines, workers, bucket_bytes, timeout_s):
        self.calls.append(("open", mode, tuple(engines), workers, bucket_bytes))

    def send_weights(self):
        self.calls.append(("send",))


def run_two_steps(cfg: PPOConfig) -> list:
    calls: list = []
    sync = EngineSync(cfg, FakeGpuPool(calls), FakeGpuActor(calls))
    for step in range(2):
        sync.release()
        sync.push(version=step + 1)  # the weights after optimizer step `step`
    return calls


def test_colocated_engines_sleep_then_wake_weights_before_the_push_and_kv_after():
    cfg = PPOConfig(
        cluster=ClusterConfig(device="cuda", colocate_engines=True), rollout=RolloutConfig(sleep_level=2)
    )

    def one_step(version):
        return [
            ("sleep", 2),
            ("wake_up", ("weights",)),
            ("expect_version", version),  # the engines number the transferred weights with it
            ("send",),
            ("transferred", version),
            ("wake_up", ("kv_cache",)),
        ]

    calls = run_two_steps(cfg)
    # The transfer group is opened once (ipc: engines colocated), then reused.
    assert calls[:3] == one_step(1)[:3]
    assert calls[3] == ("open", "ipc", ("e0", "e1"), 2, 256 << 20)
    assert calls[4:] == one_step(1)[3:] + one_step(2)


def test_cpu_run_pushes_through_the_object_store_and_never_sleeps():
    cfg = PPOConfig(rollout=RolloutConfig(sync_bucket_mb=8))
    assert run_two_steps(cfg) == [
        ("get_weights_ref", 8 << 20),
        ("update_weights", "ref", 1),
        ("get_weights_ref", 8 << 20),
        ("update_weights", "ref", 2),
    ]


def declared(source) -> list:
    """The source's metadata under either vLLM contract (0.32: a method; 0.33: a property)."""
    meta = source.metadata
    return meta() if callable(meta) else meta


def test_weight_source_meets_vllms_contract(tiny_qwen2_dir):
    """vLLM's own checks on our WeightSource: metadata agrees with iteration element by element
    (what its NCCL sender verifies before each broadcast), and every rank owns every
    parameter (what its IPC sender requires). The transfer itself needs GPUs.

    Runs against the installed vLLM (0.32 here and in CI); scripts/check_vllm_gpu_api.sh runs
    it against the GPU extra's vLLM, whose WeightSource contract differs."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from rlhf.workers.weight_sync import vllm_weight_source

    wrapper, model = wrapped_tiny_model(tiny_qwen2_dir)
    source = vllm_weight_source(wrapper, bucket_bytes=4096, zero3=False)
    meta = declared(source)
    names = [n for n, _ in model.named_parameters()]
    assert [m.name for m in meta] == names
    assert all(
        tuple(m.shape) == tuple(p.shape) for m, (_, p) in zip(meta, model.named_parameters(), strict=True)
    )
    for _ in range(2):  # re-iterable: every sync is a fresh pass
        sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
        assert [n for n, _ in sent] == names
    if hasattr(source, "owned_names"):  # vLLM >= 0.33
        assert source.implements_iter_full()
        assert source.owned_names(0) == source.owned_names(3) == names


class RecordingClient:
    """vLLM's VLLMWeightSyncClient protocol, recording calls (a non-sender must make none)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")


def test_non_sender_rank_joins_every_bucket_gather_through_vllms_nccl_engine(tiny_llama_dir, monkeypatch):
    """A training rank other than 0 holds no NCCL endpoint, but under ZeRO-3 it must still walk
    the whole stream so the per-bucket gathers line up with rank 0's. vLLM's real trainer
    engine drives it (no CUDA on that path); every sync must walk every bucket again."""
    from rlhf.workers import weight_sync

    walked: list[list[str]] = []
    real = weight_sync.gathered_weights

    def recording(model, bucket_bytes, *, zero3, on_bucket=None):
        walked.append([])
        for name, t in real(model, bucket_bytes, zero3=zero3, on_bucket=on_bucket):
            walked[-1].append(name)
            yield name, t

    monkeypatch.setattr(weight_sync, "gathered_weights", recording)
    wrapper, model = wrapped_tiny_model(tiny_llama_dir)
    client = RecordingClient()
    transfer = weight_sync.open_trainer_transfer(
        "nccl",
        client=client,  # type: ignore[arg-type]
        source=weight_sync.vllm_weight_source(wrapper, 4096, zero3=False),
        rank=1,
        bucket_bytes=4096,
        engine_workers=2,
    )
    for _ in range(2):
        transfer.send_weights()
    assert client.calls == []
    assert walked == [[n for n, _ in model.named_parameters()]] * 2


# ---------------------------------------------------------------------------- NCCL ranks per engine
def test_every_engine_worker_gets_its_own_nccl_rank():
    """vLLM's trainer sends rank_offset=1 to all workers (unique within one engine); separate
    engines would all claim rank 1 and the rendezvous could never complete (OpenRLHF gives
    engine i the offset 1 + i * tp for the same reason)."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    from rlhf.workers.weight_sync import engine_init_payloads

    engines, tp = 3, 2
    sent = worker_init_payload(  # what vLLM's NCCL trainer hands the client
        NCCLWeightTransferInitInfo(
            master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=1 + engines * tp
        )
    )
    payloads = engine_init_payloads(sent, engines, tp)
    # vLLM's worker rank: rank_offset + dp_rank * workers + worker rank, dp_rank 0 in each engine
    ranks = [p["rank_offset"] + w for p in payloads for w in range(tp)]
    assert sorted(ranks) == list(range(1, sent["world_size"]))
    rest = {k: v for k, v in sent.items() if k != "rank_offset"}
    assert all({k: v for k, v in p.items() if k != "rank_offset"} == rest for p in payloads)
    # ipc's payload has no ranks: every engine gets it as it is
    assert engine_init_payloads({"packed": True}, engines, tp) == [{"packed": True}] * engines


@pytest.mark.e2e
def test_pool_client_sends_each_engine_its_payload(ray_session):
    """EnginePoolClient over real Ray actors (stand-ins for engines, which need GPUs for this)."""
    from rlhf.workers.weight_sync import EnginePoolClient

    @ray_session.remote(num_cpus=0)
    class RecordingEngine:
        def __init__(self):
            self.got = []

        def transfer_init(self, info):
            self.got.append(("init", info))

        def transfer_start(self):
            self.got.append(("start",))

        def transfer_update(self, info):
            self.got.append(("update", info))

        def transfer_finish(self):
            self.got.append(("finish",))

        def calls(self):
            return self.got

    engines = [RecordingEngine.remote() for _ in range(2)]
    client = EnginePoolClient(engines, timeout_s=60, workers_per_engine=1)
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    got = ray_session.get([e.calls.remote() for e in engines], timeout=60)
    for j, calls in enumerate(got):
        assert calls == [
            ("init", {"rank_offset": 1 + j, "world_size": 3}),
            ("start",),
            ("update", {"names": ["w"]}),
            ("finish",),
        ]
