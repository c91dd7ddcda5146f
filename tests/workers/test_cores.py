"""A rank's compute threads follow the share of the cores the driver gives each phase."""

from __future__ import annotations

import os
import types

import torch

from rlhf.workers.deepspeed_worker import ModelWorker


def test_cpu_share_sets_the_thread_count_and_gpu_ranks_are_left_alone():
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    try:
        ModelWorker._use_cores(cpu, 1.0)  # training alone: every core
        assert torch.get_num_threads() == cores
        ModelWorker._use_cores(cpu, 1.0 / (2 * cores))  # more processes than cores: never 0
        assert torch.get_num_threads() == 1
        ModelWorker._use_cores(cpu, 0.5)  # two groups scoring at once
        assert torch.get_num_threads() == max(1, cores // 2)
        ModelWorker._use_cores(types.SimpleNamespace(device=torch.device("cuda", 0)), 1.0)
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)
