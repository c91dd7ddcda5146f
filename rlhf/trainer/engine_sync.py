"""The actor's weights to the rollout engines, and colocated engines' sleep around training.

Colocated engines (``cluster.colocate_engines``, GPU) share the training GPUs, so after
generating they sleep (``rollout.sleep_level``: 1 offloads weights to CPU and drops the KV
cache, 2 drops both) and the trainer gets the whole GPU for scoring and the update. The push
then wakes the weights only, sends the new ones, and wakes the KV cache last, so the memory
peak is weights + transfer buffers, never weights + KV cache + the trainer's activations.
This is the order vLLM's sleep-mode RL examples use.
"""

from __future__ import annotations

from typing import Any

from rlhf.config.schema import PPOConfig

__all__ = ["EngineSync"]


class EngineSync:
    """One per run: ``release()`` after generation, ``push()`` after the update.

    Args:
        cfg: the run config (``rollout.weight_sync``, ``rollout.sync_bucket_mb``,
            ``rollout.sleep_level``, ``cluster.colocate_engines``, ``train.rollout_timeout_s``).
        rollout: the ``RolloutPool``.
        actor: the actor's ``ModelGroup``.
    """

    def __init__(self, cfg: PPOConfig, rollout: Any, actor: Any) -> None:
        r, c = cfg.rollout, cfg.cluster
        self.mode = cfg.weight_sync_mode
        self.bucket_bytes = r.sync_bucket_mb << 20
        self.sleep_level = r.sleep_level if c.colocate_engines else 0
        self.timeout_s = cfg.train.rollout_timeout_s
        self.rollout, self.actor = rollout, actor
        self.asleep = False
        self._transfer_open = False

    def release(self) -> None:
        """Colocated engines give their GPU memory to the trainer (no-op otherwise)."""
        if self.sleep_level and not self.asleep:
            self.rollout.sleep(self.sleep_level)
            self.asleep = True

    def push(self, version: int | None = None) -> None:
        """Send the actor's current weights to every engine and leave the engines awake;
        ``version``: the trainer's number for them (optimizer steps), which the engines record
        per sampled token (default: the pool's count of updates + 1)."""
        if self.asleep:
            self.rollout.wake_up(["weights"])
        if self.mode == "object_store":
            self.rollout.update_weights(self.actor.get_weights_ref(self.bucket_bytes), version)
        else:
            if version is not None:
                self.rollout.expect_version(version)
            if not self._transfer_open:
                self.actor.open_weight_transfer(
                    self.mode,
                    list(self.rollout.engines),
                    self.rollout.engine_workers,
                    self.bucket_bytes,
                    self.timeout_s,
                )
                self._transfer_open = True
            self.actor.send_weights()
            self.rollout.transferred(version)
        if self.asleep:
            self.rollout.wake_up(["kv_cache"])
            self.asleep = False
