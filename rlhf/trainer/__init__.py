"""Training-side pieces that run on the model workers.

``objectives``: picklable loss objectives (PPO policy, value, SFT; DPO/RM to come) that a
``rlhf.workers.group.ModelGroup`` sends to every DeepSpeed rank with each train call.
"""
