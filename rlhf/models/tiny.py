"""Tiny random-init models and a tokenizer trained at run time.

Nothing can be downloaded from a model hub here, so tests, benchmarks and the default
experiment build a word-level tokenizer on a toy corpus and a small Llama- or Qwen2-style
model with random weights, saved with ``save_pretrained`` so that vLLM, DeepSpeed and
transformers all load the same directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]

# Chat template: every turn is "<|role|> content <|end|>"; the generation prompt opens an
# assistant turn. Assistant turns end with <|end|> followed by <eos> so generation stops.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|>' }}"
    "{% if m['role'] == 'assistant' %}{{ ' <eos>' }}{% endif %}"
    "{% if not loop.last %}{{ ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <|assistant|>' }}{% endif %}"
)


def default_corpus() -> list[str]:
    """Words the toy tasks use: digits, number words, a few letters and common words."""
    words = [str(i) for i in range(100)]
    words += ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    words += list("abcdefghijklmnopqrstuvwxyz")
    words += [
        "count",
        "add",
        "sum",
        "the",
        "a",
        "is",
        "and",
        "what",
        "next",
        "please",
        "answer",
        "repeat",
        "say",
        "yes",
        "no",
        "ok",
    ]
    words += [
        "tool",
        "result",
        "call",
        "search",
        "user",
        "assistant",
        "system",
        "hello",
        "world",
        "good",
        "bad",
    ]
    return [" ".join(words)]


# Qwen2's pre-tokenizer split (letters with one leading non-letter, single digits, ...): what
# transformers' Qwen2Tokenizer applies to any qwen2 model directory, whatever tokenizer it holds.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def build_tokenizer(
    out_dir: str | os.PathLike,
    corpus: list[str] | None = None,
    style: Literal["word", "qwen2"] = "word",
    extra_special_tokens: Sequence[str] = (),
    added_tokens: Sequence[str] = (),
    eos_token: str = "<eos>",
    chat_template: str = CHAT_TEMPLATE,
):
    """Train a tokenizer on ``corpus`` and save it as a HF fast tokenizer.

    ``word``: one token per whitespace-separated word (Llama-style tiny models load it as it is).
    ``qwen2``: byte-level BPE over Qwen2's pre-tokenizer split. transformers (5.x) loads every
    ``qwen2`` model directory with ``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the
    saved vocabulary and merges: a word-level vocabulary without merges came out as single
    characters ("count" -> c o u n t). With real merges, each corpus word is one token (with or
    without its leading space) and numbers are single digits, as in Qwen's own tokenizer.

    ``extra_special_tokens`` (a chat template's markers, e.g. ``CHATML_TOKENS``) stay single
    tokens that BPE never merges into; ``added_tokens`` are single tokens too but not special, so
    decoding with ``skip_special_tokens`` keeps them (Qwen's ``<tool_call>``: the tool-call parser
    reads it from the decoded turn); ``eos_token`` is the token that ends generation (ChatML
    models end a turn with ``<|im_end|>``).

    Returns the tokenizer as ``AutoTokenizer`` loads it (pad/bos/eos set, chat template set).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus or default_corpus()
    special = [*SPECIAL_TOKENS, *(t for t in extra_special_tokens if t not in SPECIAL_TOKENS)]
    if style == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        trainer = trainers.WordLevelTrainer(special_tokens=special, min_frequency=1, show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            min_frequency=1,
            show_progress=False,  # its bar would be the console's first line
        )
        # each word alone too, so that a word opening a text is one token as well
        tok.train_from_iterator([*corpus, *(w for text in corpus for w in text.split())], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token=eos_token, unk_token="<unk>"
    )
    if extra_special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: Literal["llama", "qwen2"] = "llama",
    vocab_size: int | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Save a random-init causal LM (and the tokenizer) to ``out_dir``; return the path.

    The tokenizer is trained into ``out_dir`` unless ``tokenizer_dir`` is given, in which
    case it is copied from there. head_dim = hidden_size / num_heads = 64 by default, a
    size every attention backend (vLLM CPU, flash-attn, SDPA) supports.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    out = Path(out_dir)
    if tokenizer_dir is None:
        # the model's config.json first: AutoTokenizer picks the tokenizer class by model type
        (LlamaConfig if arch == "llama" else Qwen2Config)().save_pretrained(str(out))
        tok = build_tokenizer(out, style="word" if arch == "llama" else "qwen2")
    else:
        tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
        tok.save_pretrained(str(out))
    common = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    # generation_config carries eos so vLLM and HF generate stop at the same token.
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id,
            }
        )
    )
    return out


def build_task_model(
    out_dir: str | os.PathLike,
    render: Callable[[Any], list[str]],
    hidden_size: int = 256,
    num_layers: int = 4,
    chat_template: str = CHAT_TEMPLATE,
    **tokenizer_kwargs: Any,
) -> Path:
    """A tokenizer that reads the task's own text and a random-init tiny Qwen2 on it, in
    ``<out_dir>/model`` (returned). A fixed toy vocabulary reads most of a new task as ``<unk>``;
    this one is byte-level BPE (no ``<unk>`` at all, digits single tokens as in Qwen's) trained on
    ``render(draft)``: the task's texts as the model will see them, rendered by a draft tokenizer
    with the same ``chat_template`` (rendering depends on the template, not the vocabulary).
    ``tokenizer_kwargs`` go to :func:`build_tokenizer` (special tokens, ``eos_token``)."""
    out = Path(out_dir)
    draft = build_tokenizer(out / "draft_tokenizer", style="qwen2", chat_template=chat_template)
    corpus = render(draft)
    build_tokenizer(
        out / "tokenizer", corpus=corpus, style="qwen2", chat_template=chat_template, **tokenizer_kwargs
    )
    return build_tiny_model(
        out / "model",
        arch="qwen2",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=hidden_size // 64,
        num_kv_heads=max(1, hidden_size // 128),
        intermediate_size=hidden_size * 2,
        tokenizer_dir=out / "tokenizer",
    )
