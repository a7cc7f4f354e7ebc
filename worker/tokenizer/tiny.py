"""Tiny assets that tests and benchmarks (benchmarks/gpu_check.py) both build models from; nothing here is
used when serving.

    tiny_tokenizer()                a byte-level BPE tokenizer (384 tokens, SmolLM2's pre-tokenizer: digits
                                    split, then GPT-2), trained on the fly on text with emoji, CJK and
                                    accents so characters really split across tokens. Same every time.
    write_tokenizer_files(dir)      its tokenizer.json + tokenizer_config.json (ChatML chat template)
    SPECIAL_TOKENS, BOS_ID, EOS_ID  ids 0/1/2 = <|endoftext|>, <|im_start|>, <|im_end|>; eos = 2
    CHATML_TEMPLATE

Needs only the worker extra (tokenizers); the model writers that use transformers stay in
tests/factories/tiny_models.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! How are you today? I am fine, thank you. What is 12 + 34? It is 46.",
    "café naïve résumé jalapeño — «quotes» and ‘apostrophes’",
    "日本語のテキスト 中文文本 한국어 텍스트 🙂🚀👍🏽 emoji 🎉",
    "def f(x):\n    return x + 1\n",
]


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    return tok.to_str()


def tiny_tokenizer() -> Tokenizer:
    """The tiny models' byte-level BPE tokenizer (SmolLM2's pre-tokenizer: digits split, then GPT-2)."""
    return Tokenizer.from_str(tokenizer_json())


def write_tokenizer_files(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json (ChatML chat template, <|im_end|> as eos) in `directory`."""
    (directory / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
