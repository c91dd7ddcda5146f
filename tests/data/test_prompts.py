import importlib.util
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
        ([{"q": "a"}, {"other": "b"}], r"p.jsonl:2: missing field 'q'.*data.prompt_key"),
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


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_source_without_datasets_says_what_to_install(tok):
    with pytest.raises(DataRowError, match="pip install datasets"):
        load_prompts("hf:some/dataset", tok)


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
