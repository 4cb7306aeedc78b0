"""``StopMatcher``: text fed in any pieces comes out as the text before the first stop
string (or all of it), and nothing that could start a stop string is sent early."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.server.stop_strings import StopMatcher


def _oracle(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string to be complete, read one character at a time."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def _run(pieces: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    sent, stopped = [], False
    for piece in pieces:
        out, stopped = m.feed(piece)
        sent.append(out)
        if stopped:
            break
    if not stopped:
        sent.append(m.flush())
    return "".join(sent), stopped, sent


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3),
)
def test_any_split_gives_the_text_before_the_first_stop_string_to_complete(pieces, stops):
    text, stopped, _ = _run(pieces, stops)  # sent text cannot be taken back: all of it must be right
    assert (text, stopped) == _oracle("".join(pieces), stops)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abxy\n", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_pieces_without_a_stop_strings_character_take_the_short_path_and_agree(pieces, stops):
    """Pieces of characters no stop string holds (x, y) go out at once, nothing held back
    (``StopMatcher``'s short path); mixed with the others, the text is still the oracle's."""
    text, stopped, _ = _run(pieces, stops)
    assert (text, stopped) == _oracle("".join(pieces), stops)


def test_text_of_other_characters_goes_out_at_once_and_a_stop_string_across_it_still_matches():
    _, stopped, sent = _run(["xy", "zz", "Paris.", "\n", "\nThe"], ["\n\n"])
    assert sent == ["xy", "zz", "Paris.", "", ""] and stopped
    _, stopped, sent = _run(["<e", "n", "d>", "more"], ["end>"])
    assert sent == ["<", "", ""] and stopped


def test_a_stop_string_split_over_pieces_is_held_back_then_dropped():
    _, stopped, sent = _run(["Paris.", "\n", "\nThe"], ["\n\n"])
    assert sent == ["Paris.", "", ""] and stopped


def test_a_false_start_is_sent_once_it_cannot_match():
    _, stopped, sent = _run(["x<", "en", "d"], ["<end>"])
    assert sent == ["x", "", "", "<end"] and not stopped


def test_no_stop_strings_sends_everything_at_once():
    assert _run(["a", "bc"], [])[2] == ["a", "bc", ""]


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="holds an empty string"):
        StopMatcher(["ok", ""])
