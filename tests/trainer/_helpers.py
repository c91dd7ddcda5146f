"""Helpers shared by the SFT, DPO and reward-model trainer tests."""

from __future__ import annotations

from rlhf.config import compose

TOY_LR = {"sft": 1e-3, "dpo": 5e-4, "rm": 5e-4}


def tiny_trainer_cfg(name: str, tmp_path, model_dir, *overrides: str):
    """Config ``name`` (``sft``/``dpo``/``rm``) for a small run of the tiny model under ``tmp_path``.

    24 toy rows (4 held out), batches of 8, no tensorboard, the toy learning rates the tests were
    tuned with; ``overrides`` come last and win.
    """
    return compose(
        name,
        [
            "experiment=toy_chat",
            f"train.lr={TOY_LR[name]}",
            f"model.path={model_dir}",
            f"train.output_dir={tmp_path}",
            "train.tensorboard=false",
            "data.num_toy=24",
            "data.eval_size=4",
            "train.batch_size=8",
            *overrides,
        ],
    )
