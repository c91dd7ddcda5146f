"""SFT / DPO / RM configs: composition, overrides, errors naming the field, and data errors naming the row."""

from __future__ import annotations

import json

import pytest
from hydra.errors import ConfigCompositionException

from rlhf.config import ConfigError, compose
from rlhf.config.trainers import DEFAULT_LR, DPOConfig, RMConfig, SFTConfig
from rlhf.data.chat import DataRowError

NAMES = ("sft", "dpo", "rm")
DATA = "data.path=data/train.jsonl"


@pytest.mark.parametrize(("name", "schema"), [("sft", SFTConfig), ("dpo", DPOConfig), ("rm", RMConfig)])
def test_defaults_are_a_real_models_and_name_no_toy(name, schema):
    cfg = compose(name, [DATA])
    assert isinstance(cfg, schema)
    assert cfg.data.path == "data/train.jsonl"
    assert cfg.data.eval_size == 0  # nothing held out unless asked (and the log says which)
    assert cfg.train.output_dir == f"runs/{name}"
    full, lora = DEFAULT_LR[name]
    assert cfg.train.lr == full <= 1e-5
    assert compose(name, [DATA, "model.lora.rank=8"]).train.lr == lora == pytest.approx(10 * full)
    assert compose(name, [DATA, "train.lr=3e-6"]).train.lr == 3e-6  # a given lr wins


@pytest.mark.parametrize("name", NAMES)
def test_no_data_is_a_config_error_naming_the_toy_experiment(name):
    with pytest.raises(ConfigError, match=r"data\.path is not set.*experiment=toy_chat"):
        compose(name)


@pytest.mark.parametrize("name", NAMES)
def test_the_toy_task_is_one_experiment_for_all_three(name):
    cfg = compose(name, ["experiment=toy_chat"])
    assert (cfg.data.path, cfg.data.eval_size, cfg.train.lr) == ("toy:count", 16, 1e-3)
    assert cfg.model.path == ""  # the tiny model is built at run time
    assert cfg.cluster.device == "cpu"
    # the command line still wins over the experiment
    assert compose(name, ["experiment=toy_chat", "data.eval_size=4"]).data.eval_size == 4


def test_overrides_reach_every_section():
    cfg = compose(
        "dpo",
        [
            DATA,
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
    assert (
        compose("sft", [DATA, "sft.aggregation=seq_mean_token_sum"]).sft.aggregation == "seq_mean_token_sum"
    )
    assert compose("rm", [DATA, "train.epochs=3", "train.lr=1e-5"]).train.epochs == 3


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
        compose(name, [DATA, *overrides])


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
            r"data\.jsonl:2: missing field 'messages' \(or 'prompt' and 'completion'\) \(set "
            r"data\.messages_key.*this row has \['text'\]\)",
        ),
        (
            "dpo",
            [
                {"prompt": "count 1", "chosen": "2", "rejected": "a"},
                {"prompt": "count 1", "chosen": "2"},
            ],
            r"data\.jsonl:2: missing field 'rejected' \(set data\.rejected_key.*this row has \['chosen', 'prompt'\]\)",
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


def test_columns_under_other_names_are_mapped_and_the_held_out_share_is_logged(
    tmp_path, tiny_llama_dir, caplog
):
    import logging

    from transformers import AutoTokenizer

    from rlhf.data.chat import load_pairs
    from rlhf.sft import load_data

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sft_rows = [{"question": f"count {i}", "solution": f"{i + 1}"} for i in range(8)]
    sft = _write(tmp_path / "sft.jsonl", sft_rows)
    keys = ["data.prompt_key=question", "data.completion_key=solution"]
    with caplog.at_level(logging.INFO, logger="rlhf"):
        train, held_out = load_data(compose("sft", [f"data.path={sft}", "data.eval_size=2", *keys]), tok)
    assert (len(train), len(held_out)) == (6, 2)
    assert "8 rows; 2 (25.0%) held out for evaluation (data.eval_size=2), 6 to train on" in caplog.text
    # the mapped columns are what is trained on: "count 3" -> "4" exactly as with the default names
    plain = _write(
        tmp_path / "plain.jsonl", [{"prompt": r["question"], "completion": r["solution"]} for r in sft_rows]
    )
    same, _ = load_data(compose("sft", [f"data.path={plain}", "data.eval_size=2"]), tok)
    assert [s.input_ids.tolist() for s in train] == [s.input_ids.tolist() for s in same]

    pref_rows = [{"q": f"count {i}", "good": f"{i + 1}", "bad": "a"} for i in range(5)]
    prefs = _write(tmp_path / "prefs.jsonl", pref_rows)
    names = ["data.prompt_key=q", "data.chosen_key=good", "data.rejected_key=bad"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhf"):
        pairs, none_held = load_pairs(compose("dpo", [f"data.path={prefs}", *names]).data, tok)
    assert (len(pairs), none_held) == (5, [])
    assert "5 pairs, all trained on; no held-out evaluation" in caplog.text
    with pytest.raises(
        DataRowError,
        match=r"prefs\.jsonl:1: missing field 'chosen' \(set data\.chosen_key.*\['bad', 'good', 'q'\]",
    ):
        load_pairs(compose("rm", [f"data.path={prefs}", "data.prompt_key=q"]).data, tok)
