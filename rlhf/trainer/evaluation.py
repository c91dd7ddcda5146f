"""Held-out evaluation on the rollout engines (no extra model copy): greedy accuracy, pass@k.

``eval.prompts`` is read like ``data.prompts`` (its label columns reach the reward as
``info``). Each evaluation generates, with the weights the engines hold:

- one greedy response per prompt: ``eval/accuracy`` (share of prompts whose reward is at
  least ``eval.success_threshold``), ``eval/reward_mean``, ``eval/response_length``;
- with ``eval.n_samples = n > 1``, ``n`` responses per prompt at the rollout temperature:
  ``eval/pass@1`` and ``eval/pass@n`` by the unbiased estimator of Chen et al. (2021).

Rewards are the run's reward (function or model) without clipping or shaping. Generation is
single-turn even when training uses an environment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from rlhf.data.prompts import Prompt
from rlhf.trainer.experience import ExperienceMaker, RolloutStats, build_sample

__all__ = ["Evaluator", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluator:
    """Runs the evaluation of ``eval.*`` with the experience maker's engines and reward."""

    def __init__(self, maker: ExperienceMaker, prompts: Sequence[Prompt], eval_cfg, max_new_tokens: int):
        if not prompts:
            raise ValueError("eval.prompts holds no prompt")
        self.maker, self.prompts, self.cfg = maker, list(prompts), eval_cfg
        self.max_new_tokens = max_new_tokens
        self.agent_metrics: dict[str, float] = {}  # eval/agent/* of the greedy pass (multi-turn)
        self.reward_stats = RolloutStats()  # its reward_counts: eval/reward/* of this evaluation, all passes

    def _scores(self, n: int, temperature: float) -> tuple[list[list[float]], list[int]]:
        """Rewards ``[prompt][sample]`` and response lengths of ``n`` samples per prompt."""
        sampling = {"n": n, "temperature": temperature, "max_tokens": self.max_new_tokens, "seed": 12_345}
        agent = self.maker.agent_loop
        if agent is not None:  # tool-using tasks are evaluated with their tools
            samples, stats = agent.run(self.prompts, n, batch=-1, group_base=0, sampling=sampling)
            if n == 1:
                self.agent_metrics = stats.metrics("eval/agent", self.maker.rollout.num_engines)
        else:
            outs = self.maker.rollout.generate([p.token_ids for p in self.prompts], sampling)
            samples = [
                build_sample(p, c, group_id=i)
                for i, (p, comps) in enumerate(zip(self.prompts, outs, strict=True))
                for c in comps
            ]
        errored: set[int] = set()
        flat = self.maker.rewards(samples, self.reward_stats, errored)
        # a held-out answer whose reward call raised (reward.on_error=zero|drop) is a wrong answer
        flat = [0.0 if i in errored else r for i, r in enumerate(flat)]
        return [flat[i * n : (i + 1) * n] for i in range(len(self.prompts))], [s.num_actions for s in samples]

    def run(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.reward_stats = RolloutStats()
        ok = self.cfg.success_threshold
        greedy, lengths = self._scores(1, 0.0)
        metrics = {
            "eval/accuracy": sum(s[0] >= ok for s in greedy) / len(greedy),
            "eval/reward_mean": math.fsum(s[0] for s in greedy) / len(greedy),
            "eval/response_length": sum(lengths) / len(lengths),
            "eval/num_prompts": float(len(self.prompts)),
        }
        n = self.cfg.n_samples
        if n > 1:
            sampled, _ = self._scores(n, self.maker.cfg.rollout.temperature)
            correct = [sum(x >= ok for x in s) for s in sampled]
            for k in sorted({1, n}):
                metrics[f"eval/pass@{k}"] = math.fsum(pass_at_k(n, c, k) for c in correct) / len(correct)
        metrics.update(self.agent_metrics)
        metrics.update({f"eval/reward/{k}": float(v) for k, v in self.reward_stats.reward_counts.items()})
        metrics["eval/time_s"] = time.perf_counter() - t0
        return metrics
