"""Tiny random-init models and a tokenizer trained at run time.

Nothing can be downloaded from a model hub here, so tests, benchmarks and the default
experiment build a word-level tokenizer on a toy corpus and a small Llama- or Qwen2-style
model with random weights, saved with ``save_pretrained`` so that vLLM, DeepSpeed and
transformers all load the same directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

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


def build_tokenizer(out_dir: str | os.PathLike, corpus: list[str] | None = None):
    """Train a word-level tokenizer on ``corpus`` and save it as a HF fast tokenizer.

    Returns the loaded ``PreTrainedTokenizerFast`` (pad/bos/eos set, chat template set).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator(corpus or default_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return PreTrainedTokenizerFast.from_pretrained(str(out))


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
        tok = build_tokenizer(out)
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
