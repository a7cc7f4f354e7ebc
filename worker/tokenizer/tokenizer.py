"""`Tokenizer`: a `tokenizers.Tokenizer` plus what serving needs around it (special tokens, chat template).

Built from a Hugging Face directory (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`)
or, for GGUF files, from the tokenizer the loader rebuilds out of the file's vocabulary (it writes the
same three files into the conversion cache, so both paths end here).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kvpact.shared.errors import ModelLoadError, RequestError
from kvpact.worker.tokenizer.chat_template import ChatTemplate


class Tokenizer:
    """Encode/decode text and render chat prompts. `eos_token_ids` is every id that ends generation
    (the tokenizer's eos token and the model config's eos ids)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        origin: str = "tokenizer",
    ) -> None:
        self.backend = backend
        self._token_texts: dict[int, str] = {}  # token_texts' memory (dict updates hold the GIL)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos = set(eos_token_ids)
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids = frozenset(eos)
        self.chat_template = (
            None
            if chat_template is None
            else ChatTemplate(
                chat_template, special_tokens={"bos_token": bos_token, "eos_token": eos_token}, origin=origin
            )
        )

    @classmethod
    def from_dir(cls, path: str | Path, *, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Read tokenizer.json (required), tokenizer_config.json and chat_template.jinja (optional)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(
                f"{path}: no tokenizer.json (kvpact needs the fast-tokenizer file beside the weights)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed JSON
            raise ModelLoadError(f"{file}: not a valid tokenizer file: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        return cls(
            backend,
            chat_template=chat_template_text(path, config),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            eos_token_ids=eos_token_ids,
            origin=str(path),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS).
        Through `encode_batch`, which releases the GIL while the Rust side works (`encode` holds it: a
        1 MB prompt stalled every other thread, the worker's event loop included, for a second)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id's own text, special tokens shown: what logprobs name a token by (OpenAI's `token`). It
        is decoded after an anchor token and the anchor's text removed, so a SentencePiece word start keeps
        its space (" world", where a decoder stripping a text's leading space gives "world" alone); a
        token that is part of a UTF-8 character reads U+FFFD. Remembered per id: a request with
        top_logprobs names up to 21 tokens a step."""
        names = self._token_texts
        missing = [i for i in dict.fromkeys(ids) if i not in names]
        if missing:
            anchor = self.backend.encode_batch(["a"], add_special_tokens=False)[0].ids
            base = self.backend.decode(anchor, skip_special_tokens=False)
            texts = self.backend.decode_batch([[*anchor, i] for i in missing], skip_special_tokens=False)
            for i, text in zip(missing, texts, strict=True):
                own = text[len(base) :] if anchor and text.startswith(base) else None
                names[i] = own if own is not None else self.backend.decode([i], skip_special_tokens=False)
        return [names[i] for i in ids]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own template."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send a plain prompt instead of messages")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own special tokens, so none
        are added (as transformers' `apply_chat_template(tokenize=True)` does)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON: {e}") from e


def chat_template_text(path: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins (transformers 5 writes it), else tokenizer_config.json's entry (a string,
    or a list of named templates of which "default" is used)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
