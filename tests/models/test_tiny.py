"""The tiny models' tokenizers, loaded the way the framework loads them (``AutoTokenizer``)."""

from __future__ import annotations

import pytest

TEXT = "count 3 4 5 what is the next"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_tokenizer_reads_words_as_the_tests_assume(arch, request):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(f"tiny_{arch}_dir"))
    for text in (TEXT, "hello world", "please repeat the answer"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, (arch, tok.convert_ids_to_tokens(ids))
        assert tok.decode(ids) == text
    # every letter word is one token, first in the text or after a space (transformers 5.x loads a
    # qwen2 directory with Qwen2Tokenizer: a word-level vocabulary came out as single characters)
    for word in ("count", "hello", "assistant", "please"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, (arch, word)
        assert len(tok(f"a {word}", add_special_tokens=False)["input_ids"]) == 2, (arch, word)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": TEXT}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[-1].lstrip("Ġ") == "<|assistant|>"
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {"<bos>", "<eos>", "<pad>"}


def test_unknown_token_share_is_measured_and_warned_once(tiny_llama_dir, caplog):
    from transformers import AutoTokenizer

    from rlhf.data.prompts import Prompt, unknown_token_fraction, warn_unknown_tokens

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    known = tok("count 3 4 5", add_special_tokens=False)["input_ids"]
    unknown = tok("Natalia sold clips to 48 friends", add_special_tokens=False)["input_ids"]
    prompts = [Prompt("", known), Prompt("", unknown)]
    plain_count = (known + unknown).count(tok.unk_token_id) / len(known + unknown)  # reference
    assert (
        unknown_token_fraction(prompts, tok.unk_token_id) == pytest.approx(plain_count) and plain_count > 0.05
    )
    with caplog.at_level("WARNING", logger="rlhf"):
        warn_unknown_tokens(prompts, tok, "data.prompts=test-unk")
        warn_unknown_tokens(prompts, tok, "data.prompts=test-unk")
        warn_unknown_tokens([Prompt("", known)], tok, "data.prompts=test-known")
    warned = [r.getMessage() for r in caplog.records if "unknown token" in r.getMessage()]
    assert len(warned) == 1 and f"{100 * plain_count:.0f}%" in warned[0] and "docs/models.md" in warned[0]
