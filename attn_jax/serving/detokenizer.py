"""Incremental detokenisation and stop strings: each new token's text in O(1) amortised.

Decoding a request's whole output again for every token costs O(n) per token (O(n^2)
per request). ``IncrementalDetokenizer`` decodes only what is new:

- with a byte-level BPE ``tokenizers`` backend (GPT-2's ``ByteLevel`` decoder, every added
  token special, as SmolLM2's): each token's bytes from a table built once
  per tokenizer, appended to the request's undecoded bytes, which are emitted once they
  decode to whole characters; a token that is whole characters by itself, with nothing
  pending and no stop strings, is a lookup in a second table of text. No call into the
  library per token: with 256 requests' streams interleaved, as an engine step feeds them,
  a quarter of ``DecodeStream``'s microseconds a token on the project's CPU
  (``benchmarks/detokenize.py``: 0.33 against 1.35);
- with another ``tokenizers`` backend (``tokenizer.backend_tokenizer``, as the GGUF
  tokenizer and transformers' fast tokenizers have, when its ``decode`` adds no clean-up):
  the library's streaming ``DecodeStream``;
- else a window of trailing ids (vLLM's prefix / read offsets): decode the ids since the
  last emitted chunk's start, with and without the new ones, and emit the difference
  once it does not end in an incomplete character (U+FFFD). The window spans the last
  chunk and any incomplete character: a few tokens.

Stop strings are searched for in the new text plus the text held back before it: while a
request runs, its last ``max(len(stop)) - 1`` characters are held back (they may start
a stop string), so each check reads O(new text + longest stop) characters. A match ends
the text before the stop string (OpenAI's rule: the stop string is not returned).

Example::

    detok = IncrementalDetokenizer(tokenizer, stop=("\\n\\n",))
    for token in tokens:
        text, stopped = detok.add(token)           # the text that became final, and a stop string hit
        print(text, end="")
        if stopped:
            break
    print(detok.finish(all_tokens))                # the held-back rest (when nothing stopped it)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

_REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


def _stream_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when decoding with it is exactly
    ``tokenizer.decode(ids, skip_special_tokens=True)``; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 (tokenizers >= 0.21)
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: each character a byte-level vocabulary spells a
    byte with, mapped to that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=4)  # by the tokenizer object (hashed by identity); a few tables kept
def _byte_table(backend) -> list[bytes | None] | None:
    """Each token id's bytes (None: a special token, skipped) when ``backend`` decodes as
    byte-level BPE does (its decoder GPT-2's ``ByteLevel``, every added token special, every
    token spelled in the byte alphabet); else None. Built once per tokenizer object."""
    spec = json.loads(backend.to_str())
    table = None
    if (spec.get("decoder") or {}).get("type") == "ByteLevel" and all(t["special"] for t in spec["added_tokens"]):
        alphabet, special = _byte_level_alphabet(), {t["id"] for t in spec["added_tokens"]}
        table = []
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(i)
            if i in special or token is None:
                table.append(None)
            elif all(c in alphabet for c in token):
                table.append(bytes(alphabet[c] for c in token))
            else:  # a token outside the byte alphabet: the library's own decoder decides
                table = None
                break
    return table


@functools.lru_cache(maxsize=4)
def _text_table(backend) -> list[str | None] | None:
    """What ``IncrementalDetokenizer._decode_new`` returns for each token with no bytes pending,
    where that is text: its piece decoded, unless the piece is a special token or its text ends
    in U+FFFD (an incomplete character, which waits for the next token's bytes; None there)."""
    table = _byte_table(backend)
    if table is None:
        return None
    texts: list[str | None] = []
    for piece in table:
        text = piece.decode("utf-8", "replace") if piece else ""
        texts.append(text if text and not text.endswith(_REPLACEMENT) else None)
    return texts


class IncrementalDetokenizer:
    """One request's output text, token by token, special tokens skipped.

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=True)``; one with a
        ``tokenizers`` backend (``backend_tokenizer``) streams through ``DecodeStream``.
      stop: strings that end the text where they first appear (not included).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max(map(len, self.stop), default=1) - 1  # characters a stop string may have begun in
        self._held = ""  # decoded text not emitted yet (the last ``_hold`` characters at most)
        self._chunks: list[str] = []  # everything emitted
        self.stopped_by: str | None = None  # the stop string that ended the text
        self._backend = _stream_backend(tokenizer)
        self._bytes = None if self._backend is None else _byte_table(self._backend)
        # Without stop strings nothing is held back: a whole-character token is its own text.
        self._texts = None if self.stop or self._backend is None else _text_table(self._backend)
        if self._bytes is not None:
            self._pending = b""  # bytes of the tokens since the last whole character
        elif self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
        else:
            self._ids: list[int] = []  # the window: ids from the last emitted chunk's start on
            self._read = 0  # ids[:_read] are the last emitted chunk's (context for the next)

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._chunks)

    def _decode_new(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is incomplete)."""
        if self._bytes is not None:
            piece = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else None
            if not piece:
                return ""
            pending = self._pending + piece
            text = pending.decode("utf-8", "replace")
            if text.endswith(_REPLACEMENT):  # an incomplete character (or invalid bytes) at the end: wait
                self._pending = pending
                return ""
            self._pending = b""
            return text
        if self._backend is not None:
            return self._stream.step(self._backend, int(token_id)) or ""
        self._ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self._ids[: self._read], skip_special_tokens=True) if self._read else ""
        after = decode(self._ids, skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        del self._ids[: self._read]  # the new chunk's ids become the next one's context
        self._read = len(self._ids)
        return after[len(before) :]

    def add(self, token_id: int) -> tuple[str, bool]:
        """Takes the next token; returns the text that became final and whether a stop
        string was found (then the text ends before it, and nothing more is taken)."""
        if self.stopped_by is not None:
            raise RuntimeError(f"the text stopped at {self.stopped_by!r}: no more tokens are taken")
        texts = self._texts
        if texts is not None and not self._pending and 0 <= token_id < len(texts):
            new = texts[token_id]
            if new is not None:
                self._chunks.append(new)
                return new, False
        new = self._decode_new(token_id)
        if not new:
            return "", False
        text = self._held + new
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
            if hits:
                cut, self.stopped_by = min(hits)
                self._held = ""
                return self._emit(text[:cut]), True
        keep = min(self._hold, len(text))
        self._held = text[len(text) - keep :]
        return self._emit(text[: len(text) - keep]), False

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def finish(self, output_ids: Sequence[int]) -> str:
        """The rest of the text once the request has ended (not by a stop string): the held
        back characters and any incomplete character at the end, so that the emitted text
        equals ``tokenizer.decode(output_ids, skip_special_tokens=True)`` (one full decode,
        once per request, unless the byte table decoded every byte already). ``output_ids``:
        every token the request generated."""
        if self.stopped_by is not None:
            return ""
        if self._bytes is not None and not self._pending:  # every byte decoded: the rest is the held text
            rest, self._held = self._held, ""
            return self._emit(rest)
        emitted = self.text
        full = self.tokenizer.decode(list(output_ids), skip_special_tokens=True)
        rest = full[len(emitted) :] if full.startswith(emitted) else self._held
        self._held = ""
        return self._emit(rest)
