"""Drivers and the losses they send to the model workers.

``ppo_trainer`` (thin ``fit()``), ``experience`` (rollout -> scored samples),
``advantage_step``, ``dynamic_sampling``; ``supervised`` (the epoch loop shared by
``sft_trainer``, ``dpo_trainer`` and ``rm_trainer``); ``setup`` (run assembly: Ray,
placement, engines and model groups for every entry point). Objectives are picklable
losses a ``rlhf.workers.group.ModelGroup`` sends to every DeepSpeed rank: ``objectives``
(PPO policy, value, SFT) and ``pref_objectives`` (DPO, reward model).
"""
