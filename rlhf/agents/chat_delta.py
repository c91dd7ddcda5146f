"""Token-in/token-out turns: the tokens between two policy turns come from the chat template,
never from re-tokenizing text.

A trajectory's tokens are ``prompt | g1 | tail | obs1 | g2 | tail | obs2 | ...``: ``g`` are the
policy's own sampled tokens (kept as sampled), ``tail`` is what the template puts after an
assistant turn's end token (ChatML: ``"\\n"``; Llama 3: nothing), and ``obs`` is the rendered
observation (tool results, a user turn) up to the next assistant header. ``tail`` and ``obs``
are the difference between the rendered conversation with and without the new messages, taken
on a fixed base conversation, so they do not depend on how earlier turns tokenize. When the
policy's tokens are the template's own tokenization of its text, the trajectory equals
``apply_chat_template`` of the whole conversation (tests/agents/test_chat_delta.py checks it for a
ChatML/Qwen-style and a Llama-3-style template).

A template whose rendering of earlier turns changes when a message is added has no such delta.
The fixed base conversation catches only the simple cases at start; a template that rewrites
earlier turns depending on their content or position (one that strips ``<think>`` from all but
the last assistant turn, one that marks the last message, one that prints today's date) is
caught per trajectory: when it ends, ``drift`` compares it with the template's rendering of the
whole conversation (one render per trajectory) and names the first part that differs. What a
drifted trajectory does is ``env.on_template_drift`` (``rlhf.agents.loop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ChatDelta", "TemplateDriftError"]

# A fixed conversation the deltas are taken on; its text never reaches a sample.
_BASE = [{"role": "user", "content": "base"}, {"role": "assistant", "content": "base"}]


class TemplateDriftError(ValueError):
    """The chat template renders earlier turns differently once a message is added."""


class ChatDelta:
    """Observation tokens for one tokenizer + tool list (``apply_chat_template(tools=...)``)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None):
        self.tok, self.tools = tokenizer, list(tools) if tools else None
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template: multi-turn tool rollouts render observations with it; "
                "use a chat model's tokenizer or set tokenizer.chat_template"
            )
        base = self.render(_BASE)
        prompt = self.render(_BASE[:1], add_generation_prompt=True)
        content = self._encode("base")
        turn = base[len(prompt) :]
        if base[: len(prompt)] != prompt:
            raise TemplateDriftError(
                "the chat template renders the user turn differently once an assistant turn follows it "
                f"({self._first_difference(prompt, base)}); its observations cannot be appended as tokens"
            )
        if turn[: len(content)] != content or len(turn) == len(content):
            raise TemplateDriftError(
                "the chat template does not render an assistant turn as <generation prompt> + content + "
                f"<end of turn>: rendered {self.tok.decode(turn)!r} after the generation prompt"
            )
        # the token the policy stops on, and what the template adds after it
        self.end_of_turn, self.tail = turn[len(content)], turn[len(content) + 1 :]
        self._base = base

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding in some versions
            out = out["input_ids"]
        return list(out)

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """The first policy turn's input: ``messages`` (system/user) and the assistant header."""
        return self.render(messages, add_generation_prompt=True)

    def observation(self, messages: Sequence[dict]) -> list[int]:
        """Tokens after a policy turn that ended on ``end_of_turn``: the template's tail, then
        ``messages`` (role ``tool`` or ``user``) rendered, then the next assistant header."""
        after = self.render([*_BASE, *messages], add_generation_prompt=True)
        if after[: len(self._base)] != self._base:
            # the template may render the base itself differently now (today's date changed)
            self._base = self.render(_BASE)
        if after[: len(self._base)] != self._base:
            raise TemplateDriftError(
                f"adding a message changes how the chat template renders the turns before it "
                f"({self._first_difference(self._base, after)}); its observations cannot be appended as tokens. "
                "Use a template that renders each message independently of the later ones"
            )
        return self.tail + after[len(self._base) :]

    def _first_difference(self, a: list[int], b: list[int]) -> str:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return f"first difference at token {at}: {self.tok.decode(a[at : at + 8])!r} became {self.tok.decode(b[at : at + 8])!r}"

    def assistant_content(self, token_ids: Sequence[int]) -> str:
        """A policy turn's text as the assistant message the template renders it from."""
        ids = list(token_ids)
        if ids and ids[-1] == self.end_of_turn:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def drift(
        self,
        ids: Sequence[int],
        messages: Sequence[dict],
        parts: Sequence[tuple[int, str]],
        unterminated: Sequence[int] = (),
    ) -> str | None:
        """None when the trajectory ``ids`` is what the template renders for ``messages`` (the
        whole conversation; the rendering may go on past the trajectory's end: a turn cut at its
        token limit, the tail after the last turn), else what differs. ``parts`` are the start
        token of each part of the trajectory with its name ("the prompt", "assistant turn 2", ...):
        the message names the part holding the first difference. ``unterminated``: the ends of
        policy turns that stopped without ``end_of_turn`` (cut at their token limit) and were
        followed by an observation: the rendering closes every turn, so the comparison does too.
        Compared as decoded text, so a policy's own tokenization of a word is no drift."""

        def text(t: Sequence[int]) -> str:
            return self.tok.decode(list(t), skip_special_tokens=False, clean_up_tokenization_spaces=False)

        ids, parts = list(ids), list(parts)
        for end in sorted(unterminated, reverse=True):
            ids.insert(end, self.end_of_turn)
            parts = [(start + (start >= end), name) for start, name in parts]
        mine, full = text(ids), text(self.render(messages))
        if full.startswith(mine):
            return None
        at = next(
            (i for i, (x, y) in enumerate(zip(mine, full, strict=False)) if x != y), min(len(mine), len(full))
        )
        part = next((name for start, name in reversed(parts) if len(text(ids[:start])) <= at), parts[0][1])
        return (
            f"the chat template renders {part} differently in the whole conversation than when the "
            f"trajectory was built (at character {at}: {mine[at : at + 40]!r} vs {full[at : at + 40]!r})"
        )
