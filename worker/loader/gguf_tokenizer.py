"""Rebuild a `tokenizers.Tokenizer` from a GGUF file's vocabulary (`tokenizer.ggml.*` metadata).

Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`, as in SmolLM2, Llama 3, Qwen2) is supported.
The text split before BPE depends on `tokenizer.ggml.pre`, the name llama.cpp gives the original
tokenizer's pre-tokenizer; the ones known here are reproduced, anything else gets GPT-2's split.
Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so both
are matched whole in text (the chat template writes `<|im_start|>` as text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpact.shared.errors import ModelLoadError

log = structlog.get_logger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that put every digit on its own, then split like GPT-2 (llama.cpp's STARCODER family).
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2 = frozenset({"default", "gpt-2", "gpt2"})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2:
        log.warning(
            "gguf_pre_tokenizer_unknown",
            pre=pre,
            using="gpt2",
            note="text may split differently from the original tokenizer",
        )
    return byte_level


def build_tokenizer(meta: Mapping[str, Any], source: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config dict with bos/eos tokens, chat_template and add_bos_token).
    `meta` maps GGUF keys to decoded values; raises ModelLoadError for what cannot be rebuilt."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            f"use the model's Hugging Face directory instead"
        )
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: Sequence[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelLoadError(f"{source}: the GGUF file has no tokenizer vocabulary or merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [_merge(m, source) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or []
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == TOKEN_TYPE_CONTROL
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)

    bos, eos = (
        _token(tokens, meta.get("tokenizer.ggml.bos_token_id")),
        _token(tokens, meta.get("tokenizer.ggml.eos_token_id")),
    )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer, config


def _token(tokens: Sequence[str], index: Any) -> str | None:
    if index is None or not 0 <= int(index) < len(tokens):
        return None
    return tokens[int(index)]


def _merge(merge: str, source: str) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not space:
        raise ModelLoadError(
            f"{source}: GGUF tokenizer merge {merge!r} is not two tokens separated by a space"
        )
    return left, right
