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

A template whose rendering of earlier turns changes when a message is added (e.g. one that
strips reasoning from all but the last assistant turn) has no such delta: ``ChatDelta`` refuses
it at start, naming what differs.
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
        if base[: len(prompt)] != prompt or turn[: len(content)] != content or len(turn) == len(content):
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
            at = next(i for i, (a, b) in enumerate(zip(after, self._base, strict=False)) if a != b)
            raise TemplateDriftError(
                "adding a message changes how the chat template renders the turns before it (first "
                f"difference at token {at}: {self.tok.decode(self._base[at : at + 8])!r} became "
                f"{self.tok.decode(after[at : at + 8])!r}); its observations cannot be appended as tokens. "
                "Use a template that renders each message independently of the later ones"
            )
        return self.tail + after[len(self._base) :]
