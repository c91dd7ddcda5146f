"""Ulysses sequence parallelism against one rank holding the whole row.

k = 2 and 4 real gloo processes each run their slice of one packed row (many samples, one
crossing every split boundary, a length that is not a multiple of k) through the tiny
architectures of ``test_attention`` (GQA with fewer KV heads than ranks, sliding windows,
soft-capping); the log-probs, entropy, critic values, reward scores, the loss's gradients
and the parameters after one SGD step must equal k = 1's in fp32.
"""

from __future__ import annotations

import io
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.data.packing import pack
from rlhf.models import attention
from rlhf.models.attention import PACKED_VARLEN, VarlenKernel, prepare_model_for_packing
from rlhf.models.forward import packed_hidden_values, packed_logprobs, packed_sequence_scores
from rlhf.models.lora import LoraSettings, apply_lora
from rlhf.models.sequence_parallel import (
    SequenceParallel,
    check_sequence_parallel,
    enable_sequence_parallel,
)
from tests.models import fake_flash_attn
from tests.models.test_attention import ARCHS, build, fake_flash_varlen_cpu, make_samples

pytestmark = pytest.mark.cpu

# Their 4 query heads have 2 KV heads (GPT-NeoX: 4), so on 4 ranks the KV heads are fewer
# than the ranks. Sliding windows: qwen2_sliding, mistral, gemma2/3, phi3.
# "llama+lora": adapters on the projections, only they train. "@packed_varlen" and
# "@flash_attention_2": the GPU paths inside each rank, through CPU stand-ins for torch's CUDA
# kernel and for the flash-attn package (window and soft-cap keywords included); their k = 1
# reference is packed_sdpa, since transformers refuses flash_attention_2 on a CPU model.
SP_ARCHS = (
    *sorted(ARCHS),  # every tiny architecture of test_attention (sliding-window ones included)
    "llama+lora",
    "mistral@packed_varlen",
    "mistral@flash_attention_2",
    "gemma2@flash_attention_2",
)
TOL = 1e-5
FLASH = "flash_attention_2"


def _batch():
    (batch,) = pack(make_samples(), budget=1000)
    return batch


def _value_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    lm = build(name)
    torch.manual_seed(1)
    cfg = lm.config
    cfg.num_labels, cfg.pad_token_id = 1, 0
    return AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()


def _prepare(model: torch.nn.Module, impl: str, sp: SequenceParallel | None) -> None:
    if impl == FLASH:
        prepare_model_for_packing(model, "packed_sdpa")
        if sp is not None:
            fake_flash_attn.install()  # a spawned rank: nothing else runs in this process
            enable_sequence_parallel(model, sp, inner=FLASH)
        return
    prepare_model_for_packing(model, impl)
    if sp is not None:
        enable_sequence_parallel(model, sp)


def _run(name: str, sp: SequenceParallel | None) -> dict[str, torch.Tensor]:
    """Outputs, gradients and post-step parameters of ``name`` on the test row."""
    name, _, impl = name.partition("@")
    impl = impl or "packed_sdpa"
    real_kernel = attention.torch_varlen_kernel
    if impl == PACKED_VARLEN:
        kernel = VarlenKernel(fn=fake_flash_varlen_cpu, has_window=True, has_is_causal=False, has_gqa=True)
        attention.torch_varlen_kernel = lambda: kernel
        fake_flash_varlen_cpu.calls = 0
    try:
        return _outputs(name, impl, sp)
    finally:
        attention.torch_varlen_kernel = real_kernel


def _outputs(name: str, impl: str, sp: SequenceParallel | None) -> dict[str, torch.Tensor]:
    batch = _batch()
    out: dict[str, torch.Tensor] = {}
    arch, _, lora = name.partition("+")
    model = build(arch).train()
    if lora:
        torch.manual_seed(2)
        apply_lora(model, LoraSettings(rank=4, alpha=8.0))
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at 0: the adapters would change nothing
                torch.nn.init.normal_(p, std=0.05)
    _prepare(model, impl, sp)
    lp, ent = packed_logprobs(model, batch, temperature=0.7, return_entropy=True)
    # A loss weighting every position differently, so a slice mix-up cannot cancel out.
    w = torch.linspace(-1.0, 2.0, batch.num_tokens)
    loss = (lp * w).sum() / batch.num_tokens + 0.1 * ent.mean()
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    if sp is not None:
        for g in grads:
            # DeepSpeed's all-reduce adds the ranks' partial gradients the same way.
            dist.all_reduce(g, group=sp.group)
    # SGD: Adam divides by |g| and would turn rounding noise in near-zero gradients into
    # full-size steps, so its parameters would differ where the gradients agree.
    opt = torch.optim.SGD(params, lr=0.5)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    if impl == PACKED_VARLEN:
        assert fake_flash_varlen_cpu.calls > 0, "the varlen kernel did not run"
    if impl == FLASH and sp is not None:
        assert fake_flash_attn.flash_attn_varlen_func.calls > 0, "flash-attn's varlen did not run"
    out.update(lp=lp.detach(), ent=ent.detach(), loss=loss.detach())
    out["grad"] = torch.cat([g.reshape(-1) for g in grads])
    out["param"] = torch.cat([p.detach().reshape(-1) for p in params])
    if arch == "granite":
        return out  # transformers has no GraniteForSequenceClassification
    vm = _value_model(arch)
    _prepare(vm, impl, sp)
    with torch.no_grad():
        out["values"] = packed_hidden_values(vm, batch)
        out["scores"] = packed_sequence_scores(vm, batch)
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        sp = SequenceParallel(size=world, rank=rank, group=dist.group.WORLD)
        results = {name: _run(name, sp) for name in SP_ARCHS}
        buf = io.BytesIO()
        torch.save(results, buf)  # bytes: a queued tensor's shared memory dies with this process
        queue.put((rank, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        queue.put((rank, traceback.format_exc()))


def _spawn(k: int) -> list[dict]:
    from rlhf.workers.placement import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port([])
    procs = [ctx.Process(target=_worker, args=(r, k, port, queue)) for r in range(k)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=240) for _ in range(k))
    for p in procs:
        p.join(timeout=60)
    for r, res in got.items():
        assert not isinstance(res, str), f"rank {r} failed:\n{res}"
    return [torch.load(io.BytesIO(got[r])) for r in range(k)]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    return {name: _run(name, None) for name in SP_ARCHS}


@pytest.mark.parametrize("k", [2, 4])
def test_ulysses_equals_one_rank(k, reference):
    assert _batch().num_tokens % k != 0  # the row needs padding to be split
    per_rank = _spawn(k)
    for name in SP_ARCHS:
        ref = reference[name]
        for r, res in enumerate(per_rank):
            for key, want in ref.items():
                got = res[name][key]
                assert got.shape == want.shape, (name, r, key)
                err = float((got - want).abs().max())
                assert err < TOL, f"{name} k={k} rank {r}: {key} differs by {err:.2e}"
        # Not vacuous: the gradients and the outputs are far from 0 and from constant.
        assert float(ref["grad"].abs().max()) > 1e-3
        assert float(ref["lp"].std()) > 0.1
        assert "values" not in ref or float(ref["values"].std()) > 1e-3


def test_heads_not_divisible_is_a_clear_error():
    cfg = build("llama").config  # 4 heads
    with pytest.raises(
        ValueError, match=r"sequence_parallel_size=3 must divide the model's 4 attention heads"
    ):
        check_sequence_parallel(cfg, 3)
    with pytest.raises(ValueError, match="needs a packed attention path"):
        check_sequence_parallel(cfg, 2, "sdpa")
