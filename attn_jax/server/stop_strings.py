"""Stop sequences on streamed text: where a request's text ends, and what is safe to send.

A stop string may arrive split over several tokens, so text that could be the start of
one is held back until the next tokens decide. Each ``feed`` searches only the new text
and the few characters before it that a match could start in, so the cost per token does
not grow with the output.

Example::

    m = StopMatcher(["\\n\\n"])
    m.feed("Paris.\\n")   # -> ("Paris.", False): "\\n" may start a stop string
    m.feed("\\nThe")      # -> ("", True): the stop string ends the text at "Paris."
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first of ``stops`` to be complete in text fed piece by piece (ties: the
    longest); the text ends where it starts (the stop string is never sent, as in OpenAI's API)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stops={list(stops)!r} holds an empty string")
        self.stops = tuple(stops)
        self._longest = max(map(len, self.stops), default=0)
        self._chars = frozenset("".join(self.stops))  # text without these neither completes nor starts one
        self._buf = ""  # the last (longest - 1) characters sent, then those held back
        self._sent = 0  # where the held-back part of _buf starts
        self.stopped = False

    def feed(self, new: str) -> tuple[str, bool]:
        """Adds ``new`` text; returns (text now safe to send, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return new, False
        if self._sent == len(self._buf) and self._chars.isdisjoint(new):  # most tokens: nothing held back,
            buf = self._buf + new  # and a match completing now, or a start held back, would hold a char of ``new``
            self._buf = buf[max(len(buf) - (self._longest - 1), 0) :]
            self._sent = len(self._buf)
            return new, False
        start = max(len(self._buf) - self._longest + 1, 0)  # a match not found before ends in ``new``
        buf = self._buf + new
        found = [(i + len(s), i) for s, i in ((s, buf.find(s, start)) for s in self.stops) if i >= 0]
        if found:  # the first stop string to be complete ends the text, however the text was split
            self.stopped = True
            self._buf = buf[: min(found)[1]]
            return self._take(len(self._buf)), True
        self._buf = buf
        out = self._take(len(buf) - self._held_back())
        keep = max(self._sent - (self._longest - 1), 0)  # bounded: at most 2 * longest characters stay
        self._buf, self._sent = self._buf[keep:], self._sent - keep
        return out, False

    def flush(self) -> str:
        """The held-back text, once the request has ended without a stop string."""
        return self._take(len(self._buf))

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        for n in range(min(self._longest - 1, len(self._buf) - self._sent), 0, -1):
            if any(s.startswith(self._buf[-n:]) for s in self.stops):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = self._buf[self._sent : end], end
        return out
