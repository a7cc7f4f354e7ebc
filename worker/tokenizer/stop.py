"""Stop strings over streamed text, one matcher per sequence.

Text arrives in pieces (one per token, from the detokenizer), so a stop string can span pieces. The
matcher keeps back the longest tail of the text that is still the beginning of some stop string and
emits the rest:

    stop "</s>":  feed("Hello <")  -> ("Hello ", None)     "<" might begin "</s>": held
                  feed("/s> bye")  -> ("", "</s>")          matched; the stop string is not emitted

The stop that ends first in the text wins (on a tie, the one that starts first), so the result does not
depend on how the text was cut into pieces. Once a stop matched, the sequence is over: further feeds
return ("", stop).

Linear time: each stop string runs a Knuth-Morris-Pratt automaton over the text, one character at a
time, whose state is the length of the longest tail of the text that begins that stop string. Building
one costs O(len(stop)); each character of output costs amortized O(1) per stop string; the text held
back is at most the longest stop string. (Matching by testing every prefix of every stop string cost
O(len(stop)^2) memory and time per piece.)
"""

from __future__ import annotations

from collections.abc import Iterable


class _Automaton:
    """KMP over one stop string: `step(ch)` -> the length of the longest tail of the text fed so far
    that is a prefix of `stop` (== len(stop) on a match)."""

    __slots__ = ("failure", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # failure[i]: length of the longest proper prefix of stop[: i + 1] that is also its suffix
        failure = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = failure[k - 1]
            if stop[i] == stop[k]:
                k += 1
            failure[i] = k
        self.failure = failure

    def step(self, ch: str) -> int:
        stop, k = self.stop, self.state
        while k and stop[k] != ch:
            k = self.failure[k - 1]
        if stop[k] == ch:
            k += 1
        self.state = k
        return k


class StopMatcher:
    """`feed(piece)` -> (text safe to emit, the stop string that matched or None).
    `flush()` -> the held-back tail, for a sequence that ended for another reason."""

    __slots__ = ("_automata", "_held", "matched")

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self._automata = [_Automaton(s) for s in dict.fromkeys(s for s in stop_strings if s)]
        self._held = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._automata:
            return piece, None
        text = self._held + piece
        base = len(self._held)
        for offset, ch in enumerate(piece):
            matched = None
            for automaton in self._automata:
                if automaton.step(ch) == len(automaton.stop) and (
                    matched is None or len(automaton.stop) > len(matched)  # ends here; starts first wins
                ):
                    matched = automaton.stop
            if matched is not None:
                self.matched, self._held = matched, ""
                return text[: base + offset + 1 - len(matched)], matched
        keep = max(a.state for a in self._automata)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
