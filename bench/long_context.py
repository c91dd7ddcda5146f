"""Sequence parallelism (Ulysses): per-rank memory and time of one train step on a long row.

Run (CPU, gloo, a few minutes on 2 cores; nothing is downloaded):

    .venv/bin/python bench/long_context.py                       # 8k, 16k, 32k tokens x k = 1, 2, 4
    .venv/bin/python bench/long_context.py --lengths 4096 --sizes 1 2   # a quick look

For each row length T and sequence-parallel size k, k processes (gloo) build the same
random-init Llama-style model (GQA), split one packed row of T tokens (three samples, so two
boundaries fall inside the row and samples cross the ranks' split) and run the forward and
backward of the masked NLL through ``rlhf.models.forward.packed_logprobs``, as the actor's
train step does. Each process reports:

- activation memory: its peak RSS during the step minus its RSS just before it (the model,
  its gradients and torch's own allocations are already there: a warm-up step on a short row
  ran first), in MiB;
- the step's wall time, and the part of it spent in the sequence-parallel collectives
  (the all-to-alls of every attention layer and the final all-gather, timed around the calls).

Printed: one row per (T, k) with the largest rank's activation memory and its ratio to k = 1's
at the same T, then the slope (MiB per 1k tokens, least squares over the lengths) and the
longest row a fixed budget (``--budget-mib`` of activations per rank) holds, per k. With k
processes on 2 cores, k = 4's times are those of an oversubscribed machine: compare memory
across k, and the collectives' share of each step.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpu_sequence_parallel import run_ranks  # noqa: E402

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _row(length: int, vocab: int):
    from rlhf.data.packing import pack
    from rlhf.data.types import Sample

    g = torch.Generator().manual_seed(0)
    sizes = [length // 2 + 3, length // 3, length - (length // 2 + 3) - length // 3]
    samples = []
    for n in sizes:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 8 :] = True  # a prompt, then the response that carries the loss
        samples.append(Sample(torch.randint(1, vocab, (n,), generator=g), mask))
    (batch,) = pack(samples, budget=length)
    return batch


def _step(model, batch) -> float:
    from rlhf.models.forward import packed_logprobs

    lp, _ = packed_logprobs(model, batch)
    mask = batch.action_mask
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=False)
    return float(loss.detach())


def _rank(rank: int, port: int, k: int, length: int, threads: int) -> dict:
    import transformers

    from rlhf.models import sequence_parallel as spm
    from rlhf.models.attention import prepare_model_for_packing

    torch.set_num_threads(threads)
    sp = None
    if k > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=k)
        sp = spm.SequenceParallel(size=k, rank=rank, group=dist.group.WORLD)
    comm = [0.0]
    inner = spm._all_to_all

    def timed_all_to_all(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            comm[0] += time.perf_counter() - t0

    spm._all_to_all = timed_all_to_all
    gather_forward = spm._GatherRow.forward

    def timed_gather(ctx, x, group):
        t0 = time.perf_counter()
        try:
            return gather_forward(ctx, x, group)
        finally:
            comm[0] += time.perf_counter() - t0

    spm._GatherRow.forward = staticmethod(timed_gather)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**MODEL), dtype=torch.float32
    ).train()
    prepare_model_for_packing(model, "packed_sdpa")
    if sp is not None:
        spm.enable_sequence_parallel(model, sp)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients exist before the measured step
    _step(model, _row(512, MODEL["vocab_size"]))  # warm-up: torch's one-time allocations
    batch = _row(length, MODEL["vocab_size"])
    before = _rss_mib()
    comm[0] = 0.0
    t0 = time.perf_counter()
    loss = _step(model, batch)
    seconds = time.perf_counter() - t0
    out = {"act_mib": _peak_mib() - before, "seconds": seconds, "comm_s": comm[0], "loss": loss}
    if k > 1:
        dist.barrier()
        dist.destroy_process_group()
    return out


def measure(length: int, k: int, cores: int) -> list[dict]:
    ranks = run_ranks(_rank, k, k, length, max(1, cores // k), timeout_s=3600)
    for r, res in enumerate(ranks):
        if isinstance(res, str):
            raise RuntimeError(f"T={length} k={k} rank {r} failed:\n{res}")
    return ranks


def _slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``act = a + b * T``: (a MiB, b MiB per token)."""
    n = len(points)
    if n == 1:
        return 0.0, points[0][1] / points[0][0]
    mx = sum(t for t, _ in points) / n
    my = sum(m for _, m in points) / n
    b = sum((t - mx) * (m - my) for t, m in points) / sum((t - mx) ** 2 for t, _ in points)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--budget-mib", type=float, default=2048.0, help="activation memory per rank")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    print(
        f"model: Llama hidden {MODEL['hidden_size']} x {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} KV heads, vocab "
        f"{MODEL['vocab_size']}, fp32; {args.cores} cores; train step = forward + backward of the NLL"
    )
    print(f"{'T':>7} {'k':>2} {'act MiB/rank':>13} {'vs k=1':>7} {'step s':>8} {'comm s':>8} {'comm %':>7}")
    table: dict[tuple[int, int], dict] = {}
    for length in args.lengths:
        for k in args.sizes:
            ranks = measure(length, k, args.cores)
            worst = max(ranks, key=lambda r: r["act_mib"])
            step = max(r["seconds"] for r in ranks)
            comm = max(r["comm_s"] for r in ranks)
            table[(length, k)] = {"act": worst["act_mib"], "step": step, "loss": ranks[0]["loss"]}
            base = table.get((length, 1))
            ratio = f"{worst['act_mib'] / base['act']:.2f}x" if base else "-"
            print(
                f"{length:>7} {k:>2} {worst['act_mib']:>13.0f} {ratio:>7} {step:>8.2f} {comm:>8.2f} "
                f"{100 * comm / step:>6.1f}%",
                flush=True,
            )
            if base and abs(ranks[0]["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]):
                print(f"  !! loss {ranks[0]['loss']:.6f} differs from k=1's {base['loss']:.6f}")
    print(f"\nlongest row in {args.budget_mib:.0f} MiB of activations per rank (act = a + b T, fitted):")
    first = None
    for k in args.sizes:
        a, b = _slope([(t, table[(t, k)]["act"]) for t in args.lengths if (t, k) in table])
        longest = (args.budget_mib - a) / b if b > 0 else float("inf")
        first = first or longest
        print(
            f"  k={k}: {1024 * b:.1f} MiB per 1k tokens -> {longest:,.0f} tokens ({longest / first:.2f}x k=1's)"
        )


if __name__ == "__main__":
    main()
