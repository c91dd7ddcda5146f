"""Metrics: console progress bar, TensorBoard, optional Weights & Biases."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("rlhf")


class Tracker:
    """Writes scalar metrics to every configured sink; also keeps them in ``history``."""

    def __init__(
        self,
        output_dir: str,
        total_steps: int,
        tensorboard: bool = True,
        wandb_project: str = "",
        config: dict | None = None,
        start_step: int = 0,
    ):
        from tqdm import tqdm

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # The run's rows so far: those up to the step resumed from (a fresh run starts empty).
        self.history: list[dict] = self._keep_rows(self.dir / "metrics.jsonl", start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="rlhf", dynamic_ncols=True)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Drops events of steps after the resumed one, which the run now does again.
            self.tb = SummaryWriter(
                str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else 0
            )
        self.wandb = None
        if wandb_project:
            import wandb  # optional extra: pip install -e .[wandb]

            self.wandb = wandb.init(project=wandb_project, config=config or {}, dir=str(self.dir))
        self.jsonl = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()

    @staticmethod
    def _keep_rows(path: Path, start_step: int) -> list[dict]:
        """Cut ``metrics.jsonl`` back to the rows of steps ``<= start_step`` (none for a fresh
        run), so a resumed run does not append a second row for the steps it repeats."""
        if not path.is_file():
            return []
        rows = []
        if start_step > 0:
            for line in path.read_text().splitlines():
                # A line cut short by a kill is dropped with the rest of the unfinished step.
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row.get("step", start_step + 1) <= start_step:
                        rows.append(row)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
        return rows

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Record ``metrics`` of ``step``; ``advance=False`` for a row that is not a training step
        (the evaluation before the first step)."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        shown = {
            k: f"{metrics[k]:.3g}"
            for k in ("reward/mean", "eval/accuracy", "kl", "policy/clip_fraction")
            if k in metrics
        }
        self.bar.set_postfix(shown)
        if advance:
            self.bar.update(1)
        # Every metric of every step is in metrics.jsonl and TensorBoard; the console shows the bar.
        log.debug("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
