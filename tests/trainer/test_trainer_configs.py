"""SFT / DPO / RM configs: composition, overrides, errors naming the field, and data errors naming the row."""

from __future__ import annotations

import json

import pytest
from hydra.errors import ConfigCompositionException

from rlhf.config import ConfigError, compose
from rlhf.config.trainers import DPOConfig, RMConfig, SFTConfig
from rlhf.data.chat import DataRowError

NAMES = ("sft", "dpo", "rm")


@pytest.mark.parametrize(("name", "schema"), [("sft", SFTConfig), ("dpo", DPOConfig), ("rm", RMConfig)])
def test_defaults_compose_typed_with_tiny_cpu_settings(name, schema):
    cfg = compose(name)
    assert isinstance(cfg, schema)
    assert cfg.data.path == "toy:count"
    assert cfg.model.path == ""  # the tiny model is built at run time
    assert cfg.cluster.device == "cpu"
    assert cfg.train.output_dir == f"runs/{name}_toy_count"


def test_overrides_reach_every_section():
    cfg = compose(
        "dpo",
        [
            "dpo.beta=0.2",
            "dpo.label_smoothing=0.1",
            "train.batch_size=4",
            "data.max_len=64",
            "cluster.actor_ranks=2",
            "model.tiny.hidden_size=64",
        ],
    )
    assert (cfg.dpo.beta, cfg.dpo.label_smoothing) == (0.2, 0.1)
    assert (cfg.train.batch_size, cfg.data.max_len, cfg.cluster.actor_ranks) == (4, 64, 2)
    assert cfg.model.tiny.hidden_size == 64
    assert compose("sft", ["sft.aggregation=seq_mean_token_sum"]).sft.aggregation == "seq_mean_token_sum"
    assert compose("rm", ["train.epochs=3", "train.lr=1e-5"]).train.epochs == 3


@pytest.mark.parametrize("name", NAMES)
def test_unknown_key_fails_naming_it(name):
    with pytest.raises(ConfigCompositionException, match=r"train\.no_such_key"):
        compose(name, ["train.no_such_key=1"])
    # A section of another trainer is unknown here too (e.g. dpo.* in the SFT config).
    other = "sft.aggregation=token_mean" if name != "sft" else "dpo.beta=0.2"
    with pytest.raises(ConfigCompositionException, match=other.split("=")[0].split(".")[0]):
        compose(name, [other])


@pytest.mark.parametrize("name", NAMES)
def test_ill_typed_value_fails_naming_it(name):
    with pytest.raises(ConfigCompositionException, match=r"train\.batch_size"):
        compose(name, ["train.batch_size=many"])


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("dpo", ["dpo.beta=0"], "dpo.beta"),
        ("dpo", ["dpo.label_smoothing=0.7"], "dpo.label_smoothing"),
        ("sft", ["sft.aggregation=sum"], "sft.aggregation"),
        ("sft", ["data.overlong=truncate"], "data.overlong"),
        ("rm", ["data.max_len=0"], "data.max_len"),
        ("sft", ["data.eval_size=-1"], "data.eval_size"),
        ("sft", ["train.epochs=0"], "train.epochs"),
        ("dpo", ["train.batch_size=0"], "train.batch_size"),
        ("rm", ["train.lr=0"], "train.lr"),
        ("rm", ["train.lr_schedule=linear"], "train.lr_schedule"),
        ("sft", ["train.zero_stage=4"], "train.zero_stage"),
        ("sft", ["train.max_tokens_per_microbatch=100"], "train.max_tokens_per_microbatch"),
        # a pair must fit one micro-batch: 2 x max_len
        ("dpo", ["train.max_tokens_per_microbatch=200"], "train.max_tokens_per_microbatch"),
        ("rm", ["cluster.device=tpu"], "cluster.device"),
    ],
)
def test_bad_values_fail_naming_the_field(name, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        compose(name, overrides)


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("name", "rows", "match"),
    [
        (
            "sft",
            [
                {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]},
                {"text": "no messages"},
            ],
            r"data\.jsonl:2: missing field 'messages'",
        ),
        (
            "dpo",
            [
                {"prompt": "count 1", "chosen": "2", "rejected": "a"},
                {"prompt": "count 1", "chosen": "2"},
            ],
            r"data\.jsonl:2: missing field 'rejected'",
        ),
        (
            "rm",
            [
                {"prompt": "count 1", "chosen": "2", "rejected": "a"},
                {"prompt": "count 1", "chosen": " ", "rejected": "a"},
            ],
            r"data\.jsonl:2: field 'chosen' is empty",
        ),
    ],
)
def test_malformed_rows_fail_through_the_entry_point_naming_the_row(
    tmp_path, tiny_llama_dir, monkeypatch, name, rows, match
):
    import importlib

    import rlhf.trainer.setup

    def must_not_start(*args, **kwargs):
        raise AssertionError("Ray/workers started before the data was validated")

    # Data errors must surface before any worker starts (Ray may already be up from other tests).
    monkeypatch.setattr(rlhf.trainer.setup, "init_ray", must_not_start)
    data = _write(tmp_path / "data.jsonl", rows)
    cfg = compose(name, [f"data.path={data}", f"model.path={tiny_llama_dir}", f"train.output_dir={tmp_path}"])
    with pytest.raises(DataRowError, match=match):
        importlib.import_module(f"rlhf.{name}").run(cfg)


def test_overlong_rows_error_or_are_skipped(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    from rlhf.sft import load_data

    rows = [{"prompt": "count 1", "completion": " ".join(["7"] * n)} for n in (3, 40, 4, 5)]
    data = _write(tmp_path / "data.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = compose("sft", [f"data.path={data}", "data.max_len=20", "data.eval_size=1"])
    with pytest.raises(DataRowError, match=r"data\.jsonl:2: .*data\.max_len=20"):
        load_data(cfg, tok)
    train, held_out = load_data(
        compose("sft", [f"data.path={data}", "data.max_len=20", "data.eval_size=1", "data.overlong=skip"]),
        tok,
    )
    assert (len(train), len(held_out)) == (2, 1)
    with pytest.raises(ValueError, match="data.eval_size"):
        load_data(
            compose(
                "sft", [f"data.path={data}", "data.max_len=20", "data.eval_size=3", "data.overlong=skip"]
            ),
            tok,
        )


def test_missing_data_file_is_named(tmp_path, tiny_llama_dir):
    from rlhf.rm import run

    cfg = compose("rm", [f"data.path={tmp_path}/nope.jsonl", f"model.path={tiny_llama_dir}"])
    with pytest.raises(DataRowError, match=r"data\.path=.*nope\.jsonl.*no such file"):
        run(cfg)
