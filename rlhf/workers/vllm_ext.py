"""vLLM worker extension: methods injected into every vLLM worker of a rollout engine.

``RolloutEngine`` passes ``worker_extension_cls="rlhf.workers.vllm_ext.WeightSyncExtension"``
to ``vllm.LLM``; vLLM then adds these methods to its worker class, and
``llm.collective_rpc("rlhf_load_weights", ...)`` runs them on every worker (one per
tensor-parallel rank). vLLM refuses an extension whose attribute names clash with the
worker's own (``reload_weights``, ``update_weights``, ... already exist), hence the
``rlhf_`` prefix.

This module must stay importable without vLLM: vLLM imports it by qualified name inside the
engine process, and the driver never needs it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["WeightSyncExtension"]


class WeightSyncExtension:
    """Mixed into the vLLM worker (``self`` is the worker: ``self.model_runner`` etc.)."""

    def rlhf_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-checkpoint-format weights in place; return how many tensors were given.

        Names are the Hugging Face ``state_dict`` names (``model.layers.0.self_attn.q_proj.weight``);
        the model's own ``load_weights`` fuses q/k/v and gate/up and shards for tensor
        parallelism, which is why the full (unsharded) tensors are sent to every rank.

        ``model.load_weights`` cannot be called directly after start-up in vLLM 0.32 (the
        post-load processing strips ``weight_loader`` from the parameters);
        ``reload_weights`` wraps it in the layer-wise reload lifecycle that restores them.
        """
        named_tensors = list(named_tensors)
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=iter(named_tensors))
        else:  # a worker class without the wrapper: call the runner under the config context
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                self.model_runner.reload_weights(weights_iterator=iter(named_tensors))
        return len(named_tensors)
