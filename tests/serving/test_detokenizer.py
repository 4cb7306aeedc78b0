"""Incremental detokenisation equals decoding the whole output (the GGUF tokenizer through
its byte table, which emits what ``DecodeStream`` does, and the trailing-window path), reads
a bounded window per token, and stops at stop strings found across token boundaries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.serving.detokenizer import IncrementalDetokenizer, _byte_table

TEXTS = [
    "Hello, wörld! 你好，世界 🎉🎉 naïve café — ok <|im_end|> then more",
    "  leading spaces\n\n\ttabs and trailing   ",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf):
    from attn_jax.models.gguf_loader import load_tokenizer

    return load_tokenizer(smollm2_gguf)


class DecodeOnly:
    """A tokenizer seen through ``decode`` alone (no ``tokenizers`` backend), counting
    the ids each call decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    chunks, stopped = [], False
    for i in ids:
        text, stopped = detok.add(i)
        chunks.append(text)
        if stopped:
            return chunks, True
    chunks.append(detok.finish(ids))
    return chunks, stopped


def _cases(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(0)
    cases = [tokenizer.encode(t) for t in TEXTS]
    return cases + [rng.integers(0, tokenizer.vocab_size, 30).tolist() for _ in range(20)]  # incomplete bytes too


@pytest.mark.parametrize("path", ["stream", "window"])
def test_incremental_text_equals_the_full_decode(gguf_tokenizer, path):
    tokenizer = gguf_tokenizer if path == "stream" else DecodeOnly(gguf_tokenizer)
    for ids in _cases(gguf_tokenizer):
        detok = IncrementalDetokenizer(tokenizer)
        assert (detok._backend is not None) == (path == "stream")
        chunks, _ = _run(detok, ids)
        assert "".join(chunks) == gguf_tokenizer.decode(ids, skip_special_tokens=True)
        assert detok.text == "".join(chunks)
        assert not any(c.endswith("\ufffd") for c in chunks[:-1])  # no half characters while streaming


def test_window_stays_small_over_4000_tokens(gguf_tokenizer):
    """Each token decodes a few trailing ids, not the output so far."""
    tokenizer = DecodeOnly(gguf_tokenizer)
    ids = (gguf_tokenizer.encode(" ".join(TEXTS)) * 200)[:4000]
    chunks, _ = _run(IncrementalDetokenizer(tokenizer), ids)
    per_token = tokenizer.decoded[:-1]  # the last call is finish's single full decode
    assert len(per_token) <= 2 * len(ids)
    assert max(per_token) <= 12, max(per_token)
    assert "".join(chunks) == gguf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("path", ["stream", "window"])
@pytest.mark.parametrize(
    ("text", "stop", "want"),
    [
        ("The answer is 42. Next question", ("Next",), "The answer is 42. "),
        ("The answer is 42. Next question", ("question", "42"), "The answer is "),  # the earliest match wins
        ("naïve café", ("ïve c",), "na"),  # across tokens and multi-byte characters
        ("Hello world", ("Hello",), ""),
    ],
)
def test_stop_strings_end_the_text_before_them(gguf_tokenizer, path, text, stop, want):
    tokenizer = gguf_tokenizer if path == "stream" else DecodeOnly(gguf_tokenizer)
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    chunks, stopped = _run(detok, gguf_tokenizer.encode(text))
    assert stopped and "".join(chunks) == want == detok.text
    assert detok.stopped_by in stop
    with pytest.raises(RuntimeError, match="no more tokens are taken"):
        detok.add(1)


def test_text_without_a_stop_string_is_all_returned(gguf_tokenizer):
    ids = gguf_tokenizer.encode(TEXTS[0])
    chunks, stopped = _run(IncrementalDetokenizer(gguf_tokenizer, stop=("zzz", "never here")), ids)
    assert not stopped and "".join(chunks) == gguf_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 16), st.integers(0, 49151)), max_size=40))
def test_the_byte_table_emits_what_decode_stream_emits_token_by_token(gguf_tokenizer, ids):
    """A byte-level tokenizer's table path (special tokens, split and invalid UTF-8 among the
    random ids; whole-character tokens take the text table) emits DecodeStream's text at every
    token, and the whole equals ``decode``."""
    from tokenizers.decoders import DecodeStream

    backend = gguf_tokenizer.backend_tokenizer
    detok, stream = IncrementalDetokenizer(gguf_tokenizer), DecodeStream(skip_special_tokens=True)
    assert detok._bytes is not None and len(detok._bytes) == gguf_tokenizer.vocab_size == 49152
    assert detok._texts is not None and IncrementalDetokenizer(gguf_tokenizer, stop=("x",))._texts is None
    assert [detok.add(i) for i in ids] == [(stream.step(backend, i) or "", False) for i in ids]
    detok = IncrementalDetokenizer(gguf_tokenizer)
    assert "".join(_run(detok, ids)[0]) == gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_text_table_holds_what_the_byte_path_gives_with_nothing_pending(gguf_tokenizer):
    """Every token's text-table entry is what ``_decode_new`` returns for it with no bytes
    pending (None where that is nothing: special tokens, incomplete characters, and a token
    whose text ends in U+FFFD, as SmolLM2's id 24211 does)."""
    from attn_jax.serving.detokenizer import _text_table

    texts = _text_table(gguf_tokenizer.backend_tokenizer)
    assert len(texts) == gguf_tokenizer.vocab_size and texts[24211] is None
    for i, text in enumerate(texts):
        assert (text or "") == IncrementalDetokenizer(gguf_tokenizer)._decode_new(i), i


def test_a_tokenizer_that_is_not_byte_level_streams_through_decode_stream():
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "##b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    assert _byte_table(tokenizer) is None
