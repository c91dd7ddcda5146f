"""What the benchmarks share: the model, tokenizer and toy prompts a run config names, and
the real workers (Ray, vLLM engines, DeepSpeed groups) placed per the config."""

from __future__ import annotations

import statistics
import threading
import time

NUM_TOY_PROMPTS = 512


def grpo_lr0_overrides(args, out: str) -> list[str]:
    """Overrides shared by the benchmarks that compare modes of the same GRPO run: one engine and
    one training rank (no reference), learning rate 0 (the full train step runs, the weights
    stay, so every mode samples the same responses and does the same work), the tiny model at
    ``args.hidden`` x ``args.layers``, ``args.prompts`` x ``args.samples_per_prompt`` a step, 2 CPUs."""
    return [
        "experiment=toy_count",
        "algorithm=grpo",
        "algorithm.kl_coef=0",
        "train.actor_lr=0",
        f"train.rollout_batch_size={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples_per_prompt}",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.num_layers={args.layers}",
        f"model.tiny.intermediate_size={2 * args.hidden}",
        "model.tiny.num_heads=4",
        "model.tiny.num_kv_heads=2",
        "cluster.num_cpus=2",
        "train.tensorboard=false",
        f"train.output_dir={out}",
        f"data.num_toy_prompts={NUM_TOY_PROMPTS}",
    ]


def model_and_prompts(cfg, tmp: str):
    """``(model_dir, tokenizer, prompts)``: ``cfg.model`` (the tiny model is built under ``tmp``)
    and the bundled count task tokenized with ``cfg.data.max_prompt_len``."""
    from transformers import AutoTokenizer

    from rlhf.data.prompts import load_prompts
    from rlhf.trainer.setup import prepare_model_dir

    model_dir = prepare_model_dir(cfg.model, tmp)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, _ = load_prompts("toy:count", tok, num_toy=NUM_TOY_PROMPTS, max_len=cfg.data.max_prompt_len)
    return model_dir, tok, prompts


def start_workers(cfg, model_dir: str):
    """Ray (local, per ``cfg.cluster``) and the run's ``Workers``; the caller shuts them down."""
    from rlhf.trainer.setup import build_workers, init_ray

    init_ray(cfg.cluster)
    return build_workers(cfg, model_dir)


class CpuSampler:
    """Machine-wide CPU use every ``every_s`` seconds, as ``(perf_counter, percent)``."""

    def __init__(self, every_s: float = 0.05):
        import psutil

        self.psutil, self.every_s = psutil, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.psutil.cpu_percent(interval=None)
        while not self._stop.wait(self.every_s):
            self.samples.append((time.perf_counter(), self.psutil.cpu_percent(interval=None)))

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        # One more, so that every span inside the block has a sample covering its end.
        self.samples.append((time.perf_counter(), self.psutil.cpu_percent(interval=None)))

    def mean(self, t0: float, t1: float) -> float:
        """Mean CPU % of the samples that cover [t0, t1]. A sample is the use since the one before
        it, so these are the samples after t0 up to the first at or after t1: at least one for any
        span inside the block, however short, and however late a busy machine lets this thread run."""
        inside = []
        for t, p in self.samples:
            if t > t0:
                inside.append(p)
                if t >= t1:
                    break
        return statistics.fmean(inside) if inside else float("nan")
