"""Multi-turn environments: the policy acts, the environment answers with observation tokens."""

from rlhf.envs.base import Env, StepResult, ToolStats, load_env

__all__ = ["Env", "StepResult", "ToolStats", "load_env"]
