import json

import pytest

from rlhf.data.chat import DataRowError, load_preferences, load_sft, tokenize_conversation
from rlhf.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _tokens(tok, s):
    return [
        (tok.convert_ids_to_tokens(int(i)), bool(m)) for i, m in zip(s.input_ids, s.action_mask, strict=True)
    ]


def test_multi_turn_mask_covers_only_assistant_turns(tok):
    s = tokenize_conversation(
        tok,
        [
            {"role": "user", "content": "count 1 2"},
            {"role": "assistant", "content": "3 4"},
            {"role": "tool", "content": "result ok"},
            {"role": "assistant", "content": "5"},
        ],
    )
    marked = [t for t, m in _tokens(tok, s) if m]
    assert marked == ["3", "4", "<|end|>", "<eos>", "5", "<|end|>", "<eos>"]
    # the text round-trips through the template: nothing dropped or duplicated
    assert tok.decode(s.input_ids.tolist()) == tok.apply_chat_template(
        [
            {"role": "user", "content": "count 1 2"},
            {"role": "assistant", "content": "3 4"},
            {"role": "tool", "content": "result ok"},
            {"role": "assistant", "content": "5"},
        ],
        tokenize=False,
    )


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("row", "msg"),
    [
        ({"text": "x"}, "missing field 'messages'"),
        ({"prompt": "count 1", "completion": "  "}, "'completion' is empty"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant tokens"),
        ({"prompt": "count 1", "completion": "2", "tools": [{"name": "calc"}]}, "OpenAI function schemas"),
    ],
)
def test_sft_bad_rows_name_the_row(tok, tmp_path, row, msg):
    f = _write(tmp_path / "d.jsonl", [{"prompt": "count 1", "completion": "2"}, row])
    with pytest.raises(DataRowError, match=msg) as e:
        load_sft(f, tok, max_len=64)
    assert "d.jsonl:2" in str(e.value)


def test_preferences_bad_rows(tok, tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": "count 1", "chosen": "2", "rejected": ""}])
    with pytest.raises(DataRowError, match=r"p.jsonl:1: field 'rejected' is empty"):
        load_preferences(f, tok, max_len=64)
    f = _write(tmp_path / "q.jsonl", [{"prompt": "count 1", "chosen": "2"}])
    with pytest.raises(DataRowError, match="missing field 'rejected'"):
        load_preferences(f, tok, max_len=64)


def test_overlong_rows_error_or_skip(tok, tmp_path):
    f = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "count 1", "completion": "2"},
            {"prompt": "count " + " ".join(["1"] * 80), "completion": "2"},
        ],
    )
    with pytest.raises(DataRowError, match="data.max_len=32"):
        load_sft(f, tok, max_len=32)
    samples, skipped = load_sft(f, tok, max_len=32, overlong="skip")
    assert (len(samples), skipped) == (1, 1)


def test_toy_sources(tok):
    sft, _ = load_sft("toy:count", tok, max_len=64, num_toy=5)
    pairs, _ = load_preferences("toy:count", tok, max_len=64, num_toy=5)
    assert len(sft) == 5 and len(pairs) == 5
    assert all(s.action_mask.sum() > 0 for s in sft)
    # chosen and rejected share the prompt tokens exactly
    for c, r in pairs:
        start = c.response_start
        assert start == r.response_start
        assert c.input_ids[:start].tolist() == r.input_ids[:start].tolist()


def test_sft_tool_transcript_renders_the_tool_prompt_and_trains_on_calls_only(tmp_path):
    """A row with ``tools`` is tokenized as the template renders the whole conversation with
    those tools (what the agent loop renders at rollout); tool results are not trained on."""
    from rlhf.agents.templates import CHATML_SPECIAL, CHATML_TOOL_TOKENS, CHATML_TOOLS

    tok = build_tokenizer(
        tmp_path / "chatml",
        style="qwen2",
        extra_special_tokens=CHATML_SPECIAL,
        added_tokens=CHATML_TOOL_TOKENS,
        eos_token="<|im_end|>",
        chat_template=CHATML_TOOLS,
    )
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    messages = [
        {"role": "user", "content": "what is 12 * 34 ?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    f = _write(tmp_path / "t.jsonl", [{"messages": messages, "tools": tools}])
    (s,), _ = load_sft(f, tok, max_len=512)
    whole = tok(tok.apply_chat_template(messages, tools=tools, tokenize=False), add_special_tokens=False)
    assert s.input_ids.tolist() == whole["input_ids"]
    assert "calculator" in tok.decode(
        s.input_ids[: s.input_ids.tolist().index(tok.convert_tokens_to_ids("user"))]
    )
    trained = tok.decode(s.input_ids[s.action_mask], skip_special_tokens=False)
    # the call and the answer (each with the template's end of turn), nothing else
    assert trained == call + "<|im_end|>\n" + "408<|im_end|>\n"
    # <tool_call> is one token that decoding keeps (the parser reads it); <|im_end|> is special
    assert tok.decode(tok(call)["input_ids"], skip_special_tokens=True) == call
    assert len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) == 1
