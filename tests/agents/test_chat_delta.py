"""Token-in/token-out observations: a trajectory built from sampled tokens and ChatDelta's
observation tokens equals the chat template's rendering of the whole conversation, for a
ChatML/Qwen-style template with <tool_call> and a Llama-3-style one; and what re-tokenizing
text (the old path) changes."""

from __future__ import annotations

import json

import pytest

from rlhf.agents.chat_delta import ChatDelta, TemplateDriftError
from rlhf.agents.templates import CHATML_TOKENS, CHATML_TOOLS, LLAMA3_TOKENS, LLAMA3_TOOLS
from rlhf.models.tiny import build_tokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok(request, tmp_path_factory):
    tokens, template = {"chatml": (CHATML_TOKENS, CHATML_TOOLS), "llama3": (LLAMA3_TOKENS, LLAMA3_TOOLS)}[
        request.param
    ]
    tok = build_tokenizer(tmp_path_factory.mktemp(request.param), style="qwen2")
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    tok.style = request.param
    return tok


def _call(tok, expr: str) -> str:
    if tok.style == "chatml":
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
    return json.dumps({"name": "calculator", "parameters": {"expression": expr}})


CONVERSATIONS = [
    # user -> call -> result -> answer
    lambda t: [
        {"role": "user", "content": "what is 12 * 34 ?"},
        {"role": "assistant", "content": _call(t, "12 * 34")},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "the answer is 408"},
    ],
    # system prompt, two calls in one turn (two results at once), then a user turn
    lambda t: [
        {"role": "system", "content": "answer with a number"},
        {"role": "user", "content": "add 1 and 2 , then 3 and 4"},
        {"role": "assistant", "content": _call(t, "1 + 2") + "\n" + _call(t, "3 + 4")},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "3 and 7"},
        {"role": "user", "content": "and the sum ?"},
        {"role": "assistant", "content": "10"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one_call", "two_calls_and_user_turn"])
@pytest.mark.parametrize("tools", [[CALC], None], ids=["tools", "no_tools"])
def test_token_deltas_equal_rendering_the_whole_conversation(tok, conversation, tools):
    messages = conversation(tok)
    delta = ChatDelta(tok, tools)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = delta.prompt(messages[:first])
    pending: list[dict] = []
    for m in messages[first:]:
        if m["role"] == "assistant":
            if pending:
                ids += delta.observation(pending)
                pending = []
            # the policy's tokens: its text as the template tokenizes it, then the stop token
            ids += list(tok(m["content"], add_special_tokens=False)["input_ids"]) + [delta.end_of_turn]
        else:
            pending.append(m)
    whole = delta.render(messages)
    assert ids + delta.tail == whole, (tok.decode(ids), tok.decode(whole))


def test_the_old_text_path_changes_the_policys_tokens(tok):
    """Decode the sampled tokens and tokenize the conversation text again (the old path): a
    sampled split that is not the canonical one ("co" "unt" for "count") comes back as another
    token sequence, so the trainer would score tokens the policy never sampled."""
    delta = ChatDelta(tok, [CALC])
    canonical = tok("count", add_special_tokens=False)["input_ids"]
    pieces = [tok(p, add_special_tokens=False)["input_ids"] for p in ("co", "unt")]
    sampled = [i for p in pieces for i in p]
    assert sampled != canonical and tok.decode(sampled) == tok.decode(canonical)
    prompt = [{"role": "user", "content": "say count"}]
    kept = delta.prompt(prompt) + sampled + [delta.end_of_turn]
    retokenized = delta.render([*prompt, {"role": "assistant", "content": tok.decode(sampled)}])
    assert kept[: len(delta.prompt(prompt))] == retokenized[: len(delta.prompt(prompt))]
    assert kept + delta.tail != retokenized  # what the old path would have trained on
    assert retokenized == delta.prompt(prompt) + canonical + [delta.end_of_turn] + delta.tail


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tok = build_tokenizer(tmp_path, style="qwen2")
    # renders only the last user message's content in full: adding one changes the earlier turn
    tok.chat_template = (
        "{%- for m in messages %}<|{{ m['role'] }}|> "
        "{{ m['content'] if loop.last or m['role'] != 'user' else 'user said something' }} <|end|> "
        "{%- endfor %}{%- if add_generation_prompt %}<|assistant|> {%- endif %}"
    )
    with pytest.raises(TemplateDriftError, match="chat template"):
        ChatDelta(tok).observation([{"role": "user", "content": "more"}])


def _trajectory(delta: ChatDelta, conversation: list[dict]) -> tuple[list[int], list[tuple[int, str]]]:
    """The tokens the agent loop builds for ``conversation`` (the policy's turns as the template's
    own tokens of their text), with where each part starts, as ``AgentLoop`` records them."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    ids, parts, pending, turn = delta.prompt(conversation[:first]), [(0, "the prompt")], [], 0
    for m in conversation[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            parts.append((len(ids), f"the observation after assistant turn {turn}"))
            ids += delta.observation(pending)
            pending = []
        turn += 1
        parts.append((len(ids), f"assistant turn {turn}"))
        ids += delta._encode(m["content"]) + [delta.end_of_turn]
    return ids, parts


def _chatml(tmp_path, template: str):
    tok = build_tokenizer(tmp_path, style="qwen2")
    tok.add_special_tokens({"additional_special_tokens": CHATML_TOKENS})
    tok.chat_template = template
    return tok


# ChatML that renders only the final answer of earlier assistant turns (Qwen3 and DeepSeek-R1
# style: the reasoning before </think> is stripped once a later turn exists)
STRIP_THINK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TURN = [
    {"role": "user", "content": "what is 2 + 3 ?"},
    {"role": "assistant", "content": "<think>add them</think> call"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "5"},
]


def test_a_template_that_strips_reasoning_from_earlier_turns_is_caught_per_trajectory(tmp_path):
    """The fixed base conversation has no <think>, so the start-up check passes; the trajectory's
    own conversation does, and its rendering differs in assistant turn 1."""
    delta = ChatDelta(_chatml(tmp_path, STRIP_THINK))
    ids, parts = _trajectory(delta, TOOL_TURN)
    why = delta.drift(ids, TOOL_TURN, parts)
    assert why is not None and "renders assistant turn 1 differently" in why, why
    plain = [TOOL_TURN[0], {"role": "assistant", "content": "call"}, *TOOL_TURN[2:]]
    assert delta.drift(*_trajectory(delta, plain)[:1], plain, _trajectory(delta, plain)[1]) is None


def test_a_template_with_todays_date_drifts_in_the_prompt_and_does_not_crash_observations(tmp_path):
    """Built on one day, checked on the next: the prompt part is named, and observations still
    render (the start-up base is rendered again once the date changed)."""
    dated = (
        "<|im_start|>system\nToday is DAY<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = _chatml(tmp_path, dated.replace("DAY", "5 December"))
    delta = ChatDelta(tok)
    ids, parts = _trajectory(delta, TOOL_TURN[:2])
    tok.chat_template = dated.replace("DAY", "6 December")  # midnight
    obs = delta.observation([TOOL_TURN[2]])  # raised TemplateDriftError mid-run before
    assert tok.decode(obs).strip().startswith("<|im_start|>tool")
    why = delta.drift(ids, TOOL_TURN[:2], parts)
    assert why is not None and "renders the prompt differently" in why and "5 December" in why, why


def test_a_template_that_marks_the_last_message_is_caught_per_trajectory(tmp_path):
    """Marks the last message when it is a tool result: the start-up check (which adds a tool
    message after the base) sees the mark in the new part only; a trajectory with two tool turns
    has the first one's mark dropped once the second follows."""
    marks = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'tool' and loop.last %} (latest){% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    delta = ChatDelta(_chatml(tmp_path, marks))
    two_tools = [
        *TOOL_TURN[:3],
        {"role": "assistant", "content": "again"},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    ids, parts = _trajectory(delta, two_tools)
    why = delta.drift(ids, two_tools, parts)
    assert why is not None and "the observation after assistant turn 1" in why, why
