"""Stop strings over streamed text, one matcher per sequence.

Text arrives in pieces (one per token, from the detokenizer), so a stop string can span pieces. The
matcher keeps back the longest tail of the text that is still the beginning of some stop string and
emits the rest:

    stop "</s>":  feed("Hello <")  -> ("Hello ", None)     "<" might begin "</s>": held
                  feed("/s> bye")  -> ("", "</s>")          matched; the stop string is not emitted

The stop that ends first in the text wins (on a tie, the one that starts first), so the result does not
depend on how the text was cut into pieces. Once a stop matched, the sequence is over: further feeds
return ("", stop).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """`feed(piece)` -> (text safe to emit, the stop string that matched or None).
    `flush()` -> the held-back tail, for a sequence that ended for another reason."""

    __slots__ = ("_held", "_max_len", "_prefixes", "_stops", "matched")

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return piece, None
        text = self._held + piece
        found = [(i + len(s), i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            _, index, self.matched = min(found)
            self._held = ""
            return text[:index], self.matched
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string begins with (0 if none)."""
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
