"""Stop strings in streamed text: found across pieces, never leaked partially."""

from __future__ import annotations

from mlxd.engine.chat.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out, stopped = [], False
    for piece in pieces:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def test_no_stops_passes_everything_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_inside_one_piece():
    assert run(["END"], ["hello END world"]) == (["hello "], True)


def test_stop_split_across_pieces_is_held_back_then_dropped():
    out, stopped = run(["END"], ["hello E", "N", "D more"])
    assert stopped and "".join(out) == "hello " and out == ["hello ", "", ""]


def test_partial_prefix_released_when_it_turns_out_not_to_be_a_stop():
    out, stopped = run(["END"], ["abc EN", "X"])
    assert not stopped and "".join(out) == "abc ENX"
    assert out[0] == "abc "  # "EN" was held


def test_earliest_of_several_stops_wins():
    out, stopped = run(["world", "lo w"], ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_held_text_is_flushed_at_the_end():
    m = StopMatcher(("STOP",))
    assert m.feed("go ST") == ("go ", False)
    assert m.flush() == "ST"


def test_empty_stop_strings_are_ignored():
    assert run(["", "x"], ["abc"]) == (["abc", ""], False)


def test_the_matched_stop_string_is_recorded():
    m = StopMatcher(("world", "lo w", "zzz"))
    assert m.matched is None
    assert m.feed("hel") == ("he", False) and m.matched is None  # "l" may start "lo w"
    assert m.feed("lo world") == ("l", True)
    assert m.matched == "lo w"  # the earliest match, as the text shows
    unmatched = StopMatcher(("END",))
    unmatched.feed("no stop here")
    assert unmatched.matched is None
