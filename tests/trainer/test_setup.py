"""Run assembly checks that need no Ray: the model directory."""

from __future__ import annotations

import shutil

import pytest

from rlhf.config.schema import ModelConfig
from rlhf.trainer.setup import TOKENIZER_FILES, prepare_model_dir


def test_model_dir_without_tokenizer_says_so(tiny_llama_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    assert prepare_model_dir(ModelConfig(path=str(model)), str(tmp_path)) == str(model)
    for f in TOKENIZER_FILES:
        (model / f).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"model.path=.* has no tokenizer \(none of tokenizer.json"):
        prepare_model_dir(ModelConfig(path=str(model)), str(tmp_path))


def test_model_dir_without_config_says_so(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        prepare_model_dir(ModelConfig(path=str(tmp_path)), str(tmp_path))
