"""worker.tokenizer: chat templates (equal to transformers'), UTF-8-safe incremental detokenization,
and stop strings across token boundaries."""

import json
import time

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpact.shared.errors import ModelLoadError, RequestError
from kvpact.worker.loader import default_model_path
from kvpact.worker.loader.gguf_file import GGUFFile
from kvpact.worker.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer
from tests.factories.tiny_models import CHATML_TEMPLATE, make_tiny_llama, tiny_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
    [
        {"role": "user", "content": "日本語で"},
        {"role": "assistant", "content": "はい。"},
        {"role": "user", "content": "ありがとう\nbye"},
    ],
]
MULTIBYTE_TEXTS = [
    "🙂🚀👍🏽 emoji 🎉",
    "日本語のテキスト 中文文本 한국어",
    "café naïve — «x»",
    "mixed 🙂 text 日本 ok",
]


@pytest.fixture(scope="module")
def smollm():
    """The default model's tokenizer, rebuilt from its GGUF (no weights)."""
    backend, config = GGUFFile(default_model_path()).tokenizer()
    return Tokenizer(
        backend,
        chat_template=config["chat_template"],
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_llama(tmp_path_factory.mktemp("tiny")))


# --- chat templates ----------------------------------------------------------------------------------


def test_default_model_chat_template_equals_transformers(smollm):
    """transformers renders the same template from the same GGUF (~8 s to build its tokenizer)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert smollm.apply_chat_template(messages, add_generation_prompt=add) == expected
        text = smollm.apply_chat_template(messages)
        assert smollm.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    assert smollm.eos_token_ids == {2} and smollm.bos_token_id == 1


def test_default_model_chat_prompt_is_chatml_with_the_default_system_prompt(smollm):
    ids = smollm.encode_chat(CONVERSATIONS[0])
    assert smollm.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> stay single tokens


def test_tiny_chat_template_equals_transformers(tiny, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(make_tiny_llama(tmp_path)))
    for messages in CONVERSATIONS:
        assert tiny.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert tiny.encode_chat(messages) == hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )


def test_template_context_has_special_tokens_raise_exception_and_tojson(tiny):
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    )
    t = Tokenizer(tiny.backend, chat_template=source, bos_token="<s>", eos_token="</s>")
    assert (
        t.apply_chat_template([{"role": "user", "content": "é"}])
        == '<s>[{"role": "user", "content": "é"}]</s>'
    )
    with pytest.raises(
        RequestError, match="chat template rejected the messages: first message must be from the user"
    ):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed(tiny):
    t = Tokenizer(tiny.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError, match="rejected the messages"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_and_broken_templates(tiny):
    with pytest.raises(RequestError, match="no chat template"):
        Tokenizer(tiny.backend).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        Tokenizer(tiny.backend, chat_template="{% for %}")


def test_chat_template_jinja_file_wins(tmp_path):
    directory = make_tiny_llama(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert (
        Tokenizer.from_dir(directory).apply_chat_template(CONVERSATIONS[0])
        == "What is the capital of France?!"
    )
    assert CHATML_TEMPLATE != Tokenizer.from_dir(directory).chat_template.source


# --- incremental detokenizer -------------------------------------------------------------------------


def _stream(tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.add(t) for t in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_never_emits_half_a_character(tiny, smollm, text):
    for tok in (tiny, smollm):
        ids = tok.encode(text, add_special_tokens=False)
        pieces, tail = _stream(tok, ids)
        assert "".join(pieces) + tail == text
        assert tail == ""
        assert not any("\ufffd" in p for p in pieces)


def test_a_split_emoji_is_held_until_complete(tiny):
    ids = tiny.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tiny.decode(ids[:1])  # the emoji really spans tokens
    pieces, _ = _stream(tiny, ids)
    assert pieces == [""] * (len(ids) - 1) + ["🙂"]


def test_flush_releases_an_incomplete_character_as_replacement(tiny):
    ids = tiny.encode("ok🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny)
    assert "".join(detok.add(t) for t in ids[:-1]) == "ok"
    assert detok.flush() == "\ufffd"


def test_prompt_context_and_special_tokens(tiny):
    prompt = tiny.encode(
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    answer = tiny.encode(" world 日本", add_special_tokens=False)
    pieces, tail = _stream(tiny, [*answer, 2], prompt_ids=prompt)
    assert "".join(pieces) + tail == " world 日本"  # eos (2) is skipped; the prompt is not repeated
    detok = IncrementalDetokenizer(tiny, skip_special_tokens=False)
    assert "".join(detok.add(t) for t in [1, *answer]) == "<|im_start|> world 日本"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab 日本語🙂🚀é\n1")), max_size=40))
def test_detokenized_stream_equals_full_decode(text):
    tok = tiny_tokenizer()
    ids = tok.encode(text).ids
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert not any(p.endswith("\ufffd") for p in pieces)


# --- stop strings ------------------------------------------------------------------------------------


def test_stop_string_across_pieces_is_cut_and_not_emitted():
    m = StopMatcher(["</s>"])
    assert m.feed("Hello <") == ("Hello ", None)
    assert m.feed("/s") == ("", None)
    assert m.feed("> bye") == ("", "</s>")
    assert m.feed("more") == ("", "</s>") and m.matched == "</s>"


def test_held_text_is_released_when_it_stops_matching():
    m = StopMatcher(["STOP", "\n\n"])
    assert m.feed("a ST") == ("a ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P?") == ("", "STOP")
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ART") == ("START", None)
    assert m.feed("x S") == ("x ", None)
    assert m.flush() == "S"


def test_first_completed_stop_wins_and_empty_or_no_stops():
    assert StopMatcher(["world", "o"]).feed("hello world") == ("hell", "o")
    assert StopMatcher(["lo w", "world"]).feed("hello world") == ("hel", "lo w")
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == ("a", "bc")  # ends first, as it would when streamed
    assert StopMatcher([]).feed("anything") == ("anything", None)
    assert StopMatcher(["", "x"]).feed("ab") == ("ab", None)
    assert StopMatcher(["日本"]).feed("テ日") == ("テ", None)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc日", max_size=30),
    stops=st.lists(st.text(alphabet="abc日", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matcher_equals_searching_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m = StopMatcher(stops)
    emitted, matched = "", None
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece, matched = m.feed(text[a:b])
        emitted += piece
        if matched:
            break
    if matched is None:
        emitted += m.flush()
    hits = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    if hits:
        _, index, stop = min(hits)
        assert (emitted, matched) == (text[:index], stop)
    else:
        assert (emitted, matched) == (text, None)


def test_stop_matching_is_linear_in_the_stop_strings_and_the_text():
    """A 128,000-character stop string once cost every one of its prefixes in memory (GBs) and a scan
    of them per piece; the automaton costs one table of its length and O(1) per character."""
    stop = "a" * 127_999 + "b"
    started = time.monotonic()
    m = StopMatcher([stop])
    emitted = "".join(m.feed("a" * 50)[0] for _ in range(400))  # 20,000 characters, all held back
    assert emitted == "" and m.matched is None
    assert m.feed("zz") == ("a" * 20_000 + "zz", None)  # no longer a prefix: released
    assert time.monotonic() - started < 2.0


def test_stop_matcher_handles_overlapping_prefixes():
    m = StopMatcher(["aab"])
    assert m.feed("aa") == ("", None)
    assert m.feed("a") == ("a", None)  # "aaa": the tail "aa" may still begin "aab"
    assert m.feed("b!") == ("", "aab")


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: word starts carry '▁', and the decoder strips a text's leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "▁a": 5, "H": 6, "i": 7, "Hi": 8, "▁Hi": 9}
    vocab |= {"w": 10, "o": 11, "r": 12, "l": 13, "d": 14, "▁w": 15, "▁wo": 16, "▁wor": 17}
    vocab |= {"▁worl": 18, "▁world": 19}
    merges = ["▁ w", "▁w o", "▁wo r", "▁wor l", "▁worl d", "H i", "▁ Hi", "▁ a"]
    special = [("<unk>", 0), ("<s>", 1), ("</s>", 2)]
    spec = {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for t, i in special
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ]},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }  # fmt: skip
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))


def test_token_texts_keep_a_word_starts_space_and_show_special_tokens(tiny):
    spm = sentencepiece_tokenizer()
    ids = spm.encode("Hi world", add_special_tokens=False)
    assert spm.decode(ids) == "Hi world" and spm.token_texts(ids) == [" Hi", " world"]  # alone: "world"
    assert spm.token_texts([2, 19, 19]) == ["</s>", " world", " world"]
    words = tiny.encode(" quick brown", add_special_tokens=False)
    assert "".join(tiny.token_texts(words)) == " quick brown"  # byte-level BPE: the text, token by token
