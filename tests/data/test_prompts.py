import json

import pytest

from rlhf.data.chat import DataRowError
from rlhf.data.prompts import PromptLoader, load_prompts
from rlhf.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_prompts_use_the_chat_template(tok, tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"q": "count 1 2"}, {"q": [{"role": "user", "content": "say yes"}]}])
    prompts, skipped = load_prompts(f, tok, key="q")
    assert skipped == 0 and len(prompts) == 2
    assert prompts[0].text == "<|user|> count 1 2 <|end|> <|assistant|>"
    assert prompts[0].token_ids == tok(prompts[0].text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("rows", "msg"),
    [
        ([{"q": "a"}, {"other": "b"}], r"p.jsonl:2: missing column 'q'.*data.prompt_key"),
        ([{"q": " "}], r"p.jsonl:1: field 'q' is empty"),
        ([{"q": 3}], r"p.jsonl:1: field 'q' must be a string"),
    ],
)
def test_bad_prompt_rows_name_row_and_field(tok, tmp_path, rows, msg):
    f = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataRowError, match=msg):
        load_prompts(f, tok, key="q")


def test_missing_file_and_unknown_toy(tok, tmp_path):
    with pytest.raises(DataRowError, match="data.prompts"):
        load_prompts(str(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(ValueError, match="unknown toy task"):
        load_prompts("toy:chess", tok)


def test_overlong_prompts_error_or_skip_and_count(tok):
    prompts, _ = load_prompts("toy:count", tok, num_toy=50)
    limit = sorted(len(p.token_ids) for p in prompts)[25]
    with pytest.raises(ValueError, match=f"data.max_prompt_len={limit}"):
        load_prompts("toy:count", tok, num_toy=50, max_len=limit)
    kept, skipped = load_prompts("toy:count", tok, num_toy=50, max_len=limit, overlong="skip")
    assert skipped > 0 and len(kept) + skipped == 50
    assert all(len(p.token_ids) <= limit for p in kept)


def test_hf_source_that_cannot_load_is_named(tok):
    # Offline (HF_HUB_OFFLINE=1) and not cached: a clear error, not a hang.
    with pytest.raises(DataRowError, match="data source 'hf:no-such-org/no-such-data': cannot load"):
        load_prompts("hf:no-such-org/no-such-data", tok)


def test_loader_resumes_at_the_same_position(tok):
    prompts, _ = load_prompts("toy:count", tok, num_toy=10)
    a = PromptLoader(prompts, batch_size=4, seed=3)
    seen = [[p.text for p in a.next_batch()] for _ in range(3)]  # crosses an epoch boundary
    b = PromptLoader(prompts, batch_size=4, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [p.text for p in b.next_batch()] == [p.text for p in a.next_batch()]
    assert seen[0] != seen[2]
    with pytest.raises(ValueError, match="train.rollout_batch_size"):
        PromptLoader(prompts, batch_size=11)


ROWS = [
    {"prompt": "count 1 2", "answer": "3", "meta": {"tags": ["a", "b"], "level": 2}},
    {"prompt": [{"role": "user", "content": "count 4 5"}], "answer": "6", "meta": {"tags": [], "level": 1}},
]


def _check_columns(prompts):
    assert [p.info["answer"] for p in prompts] == ["3", "6"]
    assert prompts[0].info["meta"] == {"tags": ["a", "b"], "level": 2}  # nested values kept
    assert "prompt" not in prompts[0].info and [p.info["index"] for p in prompts] == [0, 1]


def test_every_column_reaches_the_prompt_info_from_jsonl(tok, tmp_path):
    prompts, _ = load_prompts(_write(tmp_path / "p.jsonl", ROWS), tok, label_key="answer")
    _check_columns(prompts)


def test_parquet_prompts(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], str) else "count 4 5") for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    prompts, _ = load_prompts(str(tmp_path / "p.parquet"), tok, label_key="answer")
    _check_columns(prompts)
    assert prompts[1].text == "<|user|> count 4 5 <|end|> <|assistant|>"


def test_hf_save_to_disk_prompts(tok, tmp_path):
    import datasets

    rows = [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], str) else "count 4 5") for r in ROWS]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    prompts, _ = load_prompts(f"hf:{tmp_path / 'ds'}:test", tok, label_key="answer")
    _check_columns(prompts)
    with pytest.raises(DataRowError, match="no split 'train'"):
        load_prompts(f"hf:{tmp_path / 'ds'}", tok)


def test_row_errors_name_file_line_and_column(tok, tmp_path):
    f = _write(tmp_path / "p.jsonl", [ROWS[0], {"prompt": "count 7"}])
    with pytest.raises(DataRowError, match=r"p\.jsonl:2: missing column 'answer' \(data.label_key\)"):
        load_prompts(f, tok, label_key="answer")
    f = _write(tmp_path / "e.jsonl", [ROWS[0], {"prompt": [{"role": "user", "content": " "}]}])
    with pytest.raises(DataRowError, match=r"e\.jsonl:2: prompt\[0\] \(user\) has an empty content"):
        load_prompts(f, tok)
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"prompt": "count 1"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataRowError, match=r"b\.jsonl:2: not UTF-8"):
        load_prompts(str(bad), tok)
