"""Metrics: console progress bar, TensorBoard, optional Weights & Biases."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("rlhf")


class PlainProgress:
    """The progress bar's stand-in when the console is not a terminal: one line per
    ``every`` steps (a twentieth of the run) or ``every_s`` seconds, and at the last step."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        every_s: float = 30.0,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.n, self.every = total, initial, max(1, total // 20)
        self.every_s, self.clock = every_s, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.t0 = self.last_t = clock()
        self.first, self.last_n, self.postfix = initial, initial, {}

    def set_postfix(self, shown: dict) -> None:
        self.postfix = dict(shown)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n - self.last_n >= self.every or now - self.last_t >= self.every_s or self.n >= self.total:
            per_step = (now - self.t0) / max(self.n - self.first, 1)
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            rate = f"{per_step:.1f} s/step" if per_step >= 0.1 else f"{per_step * 1000:.0f} ms/step"
            self.write(f"rlhf: step {self.n}/{self.total} ({rate}) {extra}".rstrip())
            self.last_n, self.last_t = self.n, now

    def close(self) -> None:
        pass


def _terminal_columns() -> int:
    """The width of the terminal stderr writes to; 0 when it is no terminal, or one without a
    size (a pty opened by a program rather than a terminal), where tqdm would print nothing."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else 0
    except (OSError, ValueError, AttributeError):
        return 0


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
        # A terminal gets a progress bar; a log file, `ray job logs` or CI get a plain line now and
        # then (a bar there is one \r-joined line of many KB)
        self._console = contextlib.ExitStack()
        if _terminal_columns() > 0:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rlhf", dynamic_ncols=True)
            # log lines go above the bar (tqdm.write) instead of onto its line
            self._console.enter_context(logging_redirect_tqdm())
        else:
            self.bar = PlainProgress(total_steps, start_step)
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
        self._console.close()
        self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
