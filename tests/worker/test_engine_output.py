"""worker.output_stream: sampled tokens -> streamed pieces (EOS, ignore_eos, max_tokens, stop strings)."""

from __future__ import annotations

import torch

from kvpact.worker.engine.output_stream import OutputStream
from kvpact.worker.engine.request import FinishReason, SamplingParams, TopLogprobs
from kvpact.worker.engine.sequence import Sequence
from kvpact.worker.tokenizer import Tokenizer
from tests.factories.tiny_models import EOS_ID, tiny_tokenizer


def stream(stop_token_ids=frozenset({EOS_ID}), max_tokens=10, stop=()) -> OutputStream:  # type: ignore[no-untyped-def]
    tokenizer = Tokenizer(tiny_tokenizer(), eos_token="<|im_end|>")
    prompt = tokenizer.encode("Hello")
    seq = Sequence.create(
        0, "r", prompt, SamplingParams(), max_tokens, frozenset(stop_token_ids), torch.device("cpu")
    )
    return OutputStream(seq, tokenizer, stop, lambda item: None)


def ids_of(text: str) -> list[int]:
    return Tokenizer(tiny_tokenizer()).encode(text, add_special_tokens=False)


def test_eos_ends_with_stop_keeps_the_token_id_and_shows_no_text():
    s = stream()
    pieces = [s.on_token(t, None) for t in ids_of(" world")]
    last = s.on_token(EOS_ID, -0.5)
    assert all(p.finish_reason is None for p in pieces)
    assert (last.finish_reason, last.token_ids, last.logprobs, last.text) == (
        FinishReason.STOP,
        [EOS_ID],
        [-0.5],
        "",
    )
    assert "".join(p.text for p in pieces) == " world"
    assert last.usage is not None and last.usage.completion_tokens == len(pieces) + 1


def test_ignore_eos_means_eos_is_just_a_token():
    s = stream(stop_token_ids=frozenset(), max_tokens=2)
    first, second = s.on_token(EOS_ID, None), s.on_token(EOS_ID, None)
    assert first.finish_reason is None and second.finish_reason is FinishReason.LENGTH


def test_a_character_split_across_tokens_is_never_half_emitted():
    s = stream(max_tokens=50)
    ids = ids_of("🙂🚀")
    assert len(ids) > 2  # the emoji really are split into byte tokens
    texts = [s.on_token(t, None).text for t in ids]
    assert "".join(texts) == "🙂🚀" and all("\ufffd" not in t for t in texts)


def test_a_stop_string_prefix_held_back_is_released_when_max_tokens_ends_the_output():
    ids = ids_of(" world")[:2]
    text = Tokenizer(tiny_tokenizer()).decode(ids)
    s = stream(max_tokens=2, stop=(text[-1] + "!",))  # the text ends with the stop string's first char
    first, last = s.on_token(ids[0], None), s.on_token(ids[1], None)
    assert last.finish_reason is FinishReason.LENGTH
    assert first.text + last.text == text


def test_with_logprobs_each_token_and_alternative_is_named_by_its_own_text():
    s = stream(max_tokens=50)
    world, emoji = ids_of(" world"), ids_of("🙂")
    named = [s.on_token(t, -0.5, TopLogprobs([t, EOS_ID], [-0.5, -2.0])) for t in world + emoji]
    assert "".join(n for p in named[: len(world)] for n in p.tokens) == " world"
    assert [p.tokens for p in named[len(world) :]] == [["\ufffd"]] * len(emoji)  # a byte of the emoji alone
    assert all(p.top_logprobs[0].tokens == [p.tokens[0], "<|im_end|>"] for p in named)  # special shown
    assert s.on_token(world[0], None).tokens == []  # logprobs not asked for: nothing named
