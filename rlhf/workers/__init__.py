"""Ray workers: vLLM rollout engines (``rlhf.workers.rollout``) and their pool
(``rlhf.workers.rollout_pool``), their vLLM worker extension
(``rlhf.workers.vllm_ext``) and placements (``rlhf.workers.placement``).

Nothing heavy is imported here: ``import rlhf.workers`` must not pull in vLLM, Ray or
DeepSpeed; import the submodule you need.
"""
