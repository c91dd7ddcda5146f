"""Sequence parallelism on the device: k = 2 ranks against one, for every packed attention path.

Called by ``bench/gpu_step.py`` (check rows ``mistral_sp2``). Two processes share the one
device the GPU machine lends (NCCL refuses two ranks on one GPU, so they talk over gloo, the
activations staged through the host: the same all-to-all and all-gather calls, a slower wire)
and split one packed row of a tiny sliding-window GQA model. Compared with one process holding
the whole row, on the same device and path: the response log-probs (max |diff|) and the
gradient of the masked NLL (relative norm of the difference, after summing the ranks'
partial gradients as DeepSpeed's all-reduce does). ``run_ranks`` (k spawned processes, their
results back) also serves ``bench/long_context.py``.
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers import AutoModelForCausalLM

from rlhf.data.packing import pack
from rlhf.models.attention import prepare_model_for_packing
from rlhf.models.forward import packed_logprobs
from rlhf.models.sequence_parallel import SequenceParallel, enable_sequence_parallel

SP_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=4096,
    sliding_window=16,
    tie_word_embeddings=False,
)


def _outputs(impl: str, device: str, dtype: torch.dtype, sp: SequenceParallel | None, samples) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.MistralConfig(**SP_CONFIG), dtype=dtype)
    model = model.to(device).train()
    prepare_model_for_packing(model, impl)
    if sp is not None:
        enable_sequence_parallel(model, sp)
    (batch,) = pack(samples, sum(len(s) for s in samples))
    batch = batch.to(device)
    lp, _ = packed_logprobs(model, batch)
    mask = batch.action_mask
    (-(lp * mask).sum() / mask.sum()).backward()
    grad = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()]).cpu()
    if sp is not None:
        dist.all_reduce(grad, group=sp.group)
    return {"lp": lp.detach().float().cpu(), "mask": mask.cpu(), "grad": grad}


def _free_port() -> int:
    # Not rlhf.workers.placement.free_port: that module imports Ray, which the GPU machine lacks.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target, rank: int, port: int, queue, args: tuple) -> None:
    try:
        out = target(rank, port, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes: a queued tensor's shared memory dies with this process
        queue.put((rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - handed to the caller as text
        queue.put((rank, traceback.format_exc()))


def run_ranks(target, k: int, *args, timeout_s: float = 600.0) -> list:
    """``target(rank, port, *args)`` in ``k`` spawned processes (``port``: a free rendezvous port
    for them); each rank's return value in rank order, or the traceback text of a rank that raised."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, port, queue, args)) for r in range(k)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [v if isinstance(v, str) else torch.load(io.BytesIO(v)) for _, v in sorted(got.items())]


def _sp_rank(rank: int, port: int, impl: str, device: str, dtype: torch.dtype, samples) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = _outputs(impl, device, dtype, SequenceParallel(2, rank, dist.group.WORLD), samples)
    dist.destroy_process_group()
    return out


def sequence_parallel_checks(
    device: torch.device, dtype: torch.dtype, paths: list[str], samples
) -> list[dict]:
    """One check row per attention path: k = 2 (two processes) vs k = 1 on ``device``."""
    rows = []
    lp_tol = 1e-4 if dtype == torch.float32 else 0.25
    grad_tol = 1e-4 if dtype == torch.float32 else 0.05
    for impl in paths:
        ref = _outputs(impl, device.type, dtype, None, samples)
        got = run_ranks(_sp_rank, 2, impl, device.type, dtype, samples)
        failed = [v for v in got if isinstance(v, str)]
        if failed:
            print(f"sequence parallel on {impl} failed:\n{failed[0]}")
            rows.append(
                {
                    "model": "mistral_sp2",
                    "impl": impl,
                    "max_diff": float("nan"),
                    "mean_diff": float("nan"),
                    "ok": False,
                }
            )
            continue
        out = got[0]
        m = ref["mask"]
        lp_diff = float((out["lp"] - ref["lp"])[m].abs().max())
        grad_rel = float((out["grad"] - ref["grad"]).norm() / ref["grad"].norm())
        rows.append(
            {
                "model": "mistral_sp2",
                "impl": impl,
                "max_diff": lp_diff,
                "mean_diff": grad_rel,  # the gradient's relative error, in this row
                "ok": lp_diff <= lp_tol and grad_rel <= grad_tol,
            }
        )
    return rows
