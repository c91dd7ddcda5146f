"""One packed train step vs a padded one on a GPU, plus packed == per-sample checks.

Run (one H200, a few minutes; needs only torch and transformers: no Ray, vLLM or network):

    python bench/gpu_step.py                 # ~0.5B Qwen2-style config, bf16, on cuda
    python bench/gpu_step.py --tiny          # tiny config on CPU (what tests/bench runs)

What it measures, with a random-init model (nothing is downloaded):

1. Correctness on the device: packed logprobs == per-sample logprobs (each sample alone,
   transformers' sdpa) for every packed attention path offered there, on the bench model
   and on tiny sliding-window (Mistral) and soft-capped + windowed (Gemma2) configs.
2. Speed at equal real tokens on a long-tailed length mix (prompts 20-400, responses
   1-1500, lognormal, ``bench/packing.py``'s mix): forward + backward of the masked response
   NLL over all micro-batches, packed rows (each attention path) vs right-padded
   micro-batches of ``--micro-batch-size`` samples with sdpa + attention mask. Reported:
   seconds per step (median of ``--repeats``), real tokens/s, MFU = model FLOPs of the real
   tokens / step time / peak (989 TFLOP/s dense bf16 for an H200), peak memory.

   Sequence parallelism (``bench/gpu_sequence_parallel.py``, rows ``mistral_sp2``): one row
   split over 2 processes on the device vs one process, per path: log-probs (max) and the
   gradient's relative error (in the "mean" column).

3. The ``hf`` rollout backend's sampler (``rlhf.models.decode``) on the device, with the bench
   model: the logprob it reports for each sampled token vs a full forward of the completion
   (a check row ``hf_decode``), and decode tokens/s for ``--decode-prompts`` x 4 completions
   of ``--decode-tokens`` tokens.

Model FLOPs of a train step: 6 x (non-embedding parameters) per real token plus
6 x layers x hidden x sum(n_i^2) for causal attention (forward 2 x n^2 x d for QK^T and AV,
halved by causality; backward twice the forward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from gpu_sequence_parallel import sequence_parallel_checks  # noqa: E402
from packing import sample_lengths  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from rlhf.data.packing import pack, unpack  # noqa: E402
from rlhf.data.types import Sample  # noqa: E402
from rlhf.models import attention  # noqa: E402
from rlhf.models.attention import PACKED_SDPA, PACKED_VARLEN, prepare_model_for_packing  # noqa: E402
from rlhf.models.forward import packed_logprobs  # noqa: E402

H200_BF16_DENSE_FLOPS = 989e12
BENCH_CONFIG = dict(  # Qwen2.5-0.5B's shapes
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@dataclass
class Timing:
    name: str
    step_s: float
    tokens_per_s: float
    mfu: float
    peak_mem_gib: float
    computed_tokens: int


def make_samples(n: int, vocab: int, seed: int, scale: float) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in sample_lengths(n, seed):
        p, r = max(2, int(p * scale)), max(1, int(r * scale))
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        out.append(Sample(input_ids=torch.randint(0, vocab, (p + r,), generator=g), action_mask=mask))
    return out


def model_flops(model: torch.nn.Module, samples: list[Sample]) -> float:
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    n = sum(p.numel() for p in model.parameters())
    # Tied: the embedding matrix is also the LM head, a real matmul per token; untied:
    # the input embedding is a lookup.
    non_embedding = n if cfg.tie_word_embeddings else n - embed
    tokens = sum(len(s) for s in samples)
    attn = 6 * cfg.num_hidden_layers * cfg.hidden_size * sum(len(s) ** 2 for s in samples)
    return 6 * non_embedding * tokens + attn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def packed_step(model, samples: list[Sample], budget: int, device) -> int:
    computed = 0
    for mb in pack(samples, budget):
        mb = mb.to(device)
        lp, _ = packed_logprobs(model, mb)
        mask = mb.action_mask.float()
        (-(lp * mask).sum() / mask.sum().clamp(min=1)).backward()
        computed += mb.num_tokens
    return computed


def padded_step(model, samples: list[Sample], micro: int, device) -> int:
    computed = 0
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        att = torch.zeros(len(chunk), width, dtype=torch.long)
        act = torch.zeros(len(chunk), width)
        for j, s in enumerate(chunk):
            ids[j, : len(s)], att[j, : len(s)], act[j, : len(s)] = s.input_ids, 1, s.action_mask.float()
        ids, att, act = ids.to(device), att.to(device), act.to(device)
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = act[:, 1:]
        (-(lp * m).sum() / m.sum().clamp(min=1)).backward()
        computed += ids.numel()
    return computed


def time_step(name, fn, model, samples, repeats, device, flops, peak_flops) -> Timing:
    real = sum(len(s) for s in samples)
    fn()  # warm-up: kernels, allocator
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    computed = 0
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        computed = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return Timing(name, step, real / step, flops / step / peak_flops, peak, computed)


def per_sample_check(model, samples: list[Sample], impl: str, device) -> tuple[float, float]:
    """(max, mean) |packed - per-sample| logprob over response tokens, under no_grad."""
    (batch,) = pack(samples, sum(len(s) for s in samples))
    batch = batch.to(device)
    with torch.no_grad():
        prepare_model_for_packing(model, impl)
        lp, _ = packed_logprobs(model, batch)
        model.set_attn_implementation("sdpa")
        diffs = []
        parts = unpack(lp, batch.cu_seqlens)
        for i, part in zip(batch.sample_index.tolist(), parts, strict=True):
            s = samples[i]
            ids = s.input_ids.to(device)
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
            m = s.action_mask[1:].to(device)
            diffs.append((part[1:] - ref)[m].abs())
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean())


def paths_for(device: torch.device, dtype: torch.dtype) -> list[str]:
    paths = [PACKED_SDPA]
    if device.type == "cuda" and dtype != torch.float32:
        if attention.torch_varlen_kernel() is not None:
            paths.append(PACKED_VARLEN)
        if attention.flash_attn_available():
            paths.append("flash_attention_2")
    return paths


def arch_checks(device, dtype, tol: float) -> list[dict]:
    """Tiny sliding-window / soft-capped configs: every path on this device vs per-sample."""
    out = []
    common = dict(TINY_CONFIG, tie_word_embeddings=False, head_dim=16)
    configs = {
        "mistral_window16": transformers.MistralConfig(**common, sliding_window=16),
        "gemma2_window16_softcap": transformers.Gemma2Config(
            **common, sliding_window=16, attn_logit_softcapping=5.0
        ),
    }
    samples = make_samples(6, TINY_CONFIG["vocab_size"], seed=1, scale=0.1)
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
        for impl in paths_for(device, dtype):
            mx, mean = per_sample_check(model, samples, impl, device)
            out.append({"model": name, "impl": impl, "max_diff": mx, "mean_diff": mean, "ok": mx <= tol})
    return out


def decode_check(model, vocab: int, device, tol: float, prompts: int, new_tokens: int) -> tuple[dict, dict]:
    """The hf backend's sampler on this device: reported logprobs vs a full forward of each
    completion (first 4 prompts), and decode throughput. Returns ``(check row, timing)``."""
    from rlhf.models.decode import sample_completions
    from rlhf.models.sampling import SamplingSpec

    model.set_attn_implementation("sdpa")  # decoding with a KV cache: no packed rows
    model.eval()
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(8, 64, (prompts,), generator=g).tolist()
    batch = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]
    n = 4
    args = (
        model,
        batch,
        n,
        SamplingSpec(temperature=1.0),
        [new_tokens] * prompts,
        list(range(prompts * n)),
        [],
    )
    sample_completions(*args)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = sample_completions(*args)
    sync(device)
    seconds = time.perf_counter() - t0
    diffs = []
    with torch.no_grad():
        for prompt, comps in zip(batch[:4], outs[:4], strict=True):
            for c in comps:
                ids = torch.tensor([prompt + c.token_ids], device=device)
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(prompt) - 1 : -1]
                ref = lp.gather(-1, torch.tensor(c.token_ids, device=device)[:, None]).squeeze(-1).cpu()
                diffs.append((ref - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    tokens = sum(len(c.token_ids) for comps in outs for c in comps)
    check = {"model": "bench", "impl": "hf_decode", "max_diff": float(d.max()), "mean_diff": float(d.mean())}
    check["ok"] = check["max_diff"] <= tol
    return check, {
        "rows": prompts * n,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config, fp32, on CPU (what the test runs)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per packed row")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-prompts", type=int, default=32, help="hf sampler: prompts (x 4 completions)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="hf sampler: tokens per completion")
    ap.add_argument("--json", type=str, default="", help="also write the results here")
    args = ap.parse_args(argv)

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    scale = 0.05 if args.tiny else 1.0
    tol = 1e-4 if dtype == torch.float32 else 0.25
    cfg = transformers.Qwen2Config(**(TINY_CONFIG if args.tiny else BENCH_CONFIG))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    samples = make_samples(args.samples, cfg.vocab_size, seed=0, scale=scale)
    budget = max(args.budget, max(len(s) for s in samples))
    flops = model_flops(model, samples)
    peak_flops = H200_BF16_DENSE_FLOPS if device.type == "cuda" else float("nan")
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "params": sum(p.numel() for p in model.parameters()),
        "samples": len(samples),
        "real_tokens": sum(len(s) for s in samples),
        "auto_attn_impl": attention.resolve_attn_impl(model, "auto"),
        "checks": [],
        "timings": [],
    }
    model.eval()
    check_set = samples[:8]
    for impl in paths_for(device, dtype):
        mx, mean = per_sample_check(model, check_set, impl, device)
        result["checks"].append(
            {"model": "bench", "impl": impl, "max_diff": mx, "mean_diff": mean, "ok": mx <= tol}
        )
    result["checks"] += arch_checks(device, dtype, tol)
    sp_samples = make_samples(6, TINY_CONFIG["vocab_size"], seed=2, scale=0.1)
    result["checks"] += sequence_parallel_checks(device, dtype, paths_for(device, dtype), sp_samples)
    model.train()
    variants = [
        (f"packed/{impl}", impl, lambda: packed_step(model, samples, budget, device))
        for impl in paths_for(device, dtype)
    ]
    mb = args.micro_batch_size
    variants.append((f"padded/sdpa(mb={mb})", "sdpa", lambda: padded_step(model, samples, mb, device)))
    for name, impl, fn in variants:
        if impl == "sdpa":
            model.set_attn_implementation("sdpa")  # padded rows with a mask: no packing involved
        else:
            prepare_model_for_packing(model, impl)
        t = time_step(name, fn, model, samples, args.repeats, device, flops, peak_flops)
        result["timings"].append(t.__dict__)
    padded_s = result["timings"][-1]["step_s"]
    for row in result["timings"]:
        row["speedup_vs_padded"] = padded_s / row["step_s"]
    check, result["decode"] = decode_check(
        model, cfg.vocab_size, device, tol, args.decode_prompts, args.decode_tokens
    )
    result["checks"].append(check)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def report(r: dict) -> None:
    print(
        f"{r['device']} | torch {r['torch']} | transformers {r['transformers']} | {r['dtype']} | "
        f"{r['params'] / 1e6:.1f}M params | {r['samples']} samples, {r['real_tokens']} real tokens | "
        f"auto -> {r['auto_attn_impl']}"
    )
    print("packed == per-sample (response-token logprobs); hf_decode: sampler logprobs == a full forward:")
    for c in r["checks"]:
        print(
            f"  {c['model']:<26} {c['impl']:<18} max {c['max_diff']:.2e}  mean {c['mean_diff']:.2e}  {'ok' if c['ok'] else 'FAIL'}"
        )
    print(
        f"{'train step (fwd+bwd)':<28} {'s/step':>8} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'computed':>9} {'vs padded':>9}"
    )
    for t in r["timings"]:
        print(
            f"{t['name']:<28} {t['step_s']:>8.3f} {t['tokens_per_s']:>10.0f} {t['mfu']:>7.1%} "
            f"{t['peak_mem_gib']:>9.2f} {t['computed_tokens']:>9} {t['speedup_vs_padded']:>8.2f}x"
        )
    d = r["decode"]
    print(
        f"hf sampler: {d['rows']} rows, {d['tokens']} tokens in {d['seconds']:.2f} s = {d['tokens_per_s']:.0f} tokens/s"
    )


if __name__ == "__main__":
    out = main()
    sys.exit(0 if all(c["ok"] for c in out["checks"]) else 1)
