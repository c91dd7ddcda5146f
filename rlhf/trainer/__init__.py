"""Drivers and the losses they send to the model workers.

``ppo_trainer`` (thin ``fit()``), ``experience`` (rollout -> scored samples),
``advantage_step``; ``sft_trainer``, ``dpo_trainer``, ``rm_trainer``. Objectives are
picklable losses a ``rlhf.workers.group.ModelGroup`` sends to every DeepSpeed rank:
``objectives`` (PPO policy, value, SFT) and ``pref_objectives`` (DPO, reward model).
"""
