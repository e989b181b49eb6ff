"""Stop strings: the output is cut exactly before the first one, and a stream never sends
what a stop string later claims."""

from __future__ import annotations

import pytest

from service.detokenizer import IncrementalDetokenizer
from service.stop_strings import StopStringText, TextDelta, find_stop, held_back
from tests.generative_models import byte_level_bpe


def test_find_stop_finds_the_earliest_match_ending_in_the_new_text() -> None:
    assert find_stop("hello world", 5, ["world"]) == (6, "world")
    assert find_stop("hello world", 5, ["rld", "lo w"]) == (3, "lo w")
    assert find_stop("hello world", 3, ["lo w", "rld"]) == (8, "rld")
    assert find_stop("hello world", 1, ["hello"]) is None  # checked when it arrived
    assert find_stop("abc", 3, ["", "x"]) is None


def test_held_back_is_the_longest_tail_that_could_start_a_stop_string() -> None:
    assert held_back("the end\n", ["\n\n"]) == 1
    assert held_back("say STO", ["STOP", "TOO"]) == 3
    assert held_back("nothing", ["STOP"]) == 0
    assert held_back("ST", ["STOP"]) == 2


def stream(pieces: list[str], stop: list[str], include_stop: bool = False) -> list[TextDelta]:
    text = StopStringText(stop, include_stop=include_stop)
    deltas = [text.add(piece) for piece in pieces]
    return [*deltas, text.finish()]


def test_the_output_is_cut_before_a_stop_string_split_over_pieces() -> None:
    deltas = stream(["Hello, wo", "rld! S", "TO", "P here", " more"], ["STOP"])
    assert "".join(delta.text for delta in deltas) == "Hello, world! "
    assert [delta.text for delta in deltas] == ["Hello, wo", "rld! ", "", "", "", ""]
    assert [delta.stopped for delta in deltas] == [False, False, False, True, True, True]


def test_held_back_text_is_released_when_the_stop_string_does_not_come() -> None:
    deltas = stream(["a\n", "b\n", "\n", "c"], ["\n\n"])
    assert [delta.text for delta in deltas[:2]] == ["a", "\nb"]
    assert deltas[2].stopped
    assert "".join(delta.text for delta in deltas) == "a\nb"

    unfinished = stream(["end S", "T"], ["STOP"])
    assert [delta.text for delta in unfinished] == ["end ", "", "ST"]
    assert not unfinished[-1].stopped


def test_the_earliest_of_several_stop_strings_wins_and_may_be_kept() -> None:
    deltas = stream(["one two three"], ["three", "two"])
    assert (deltas[0].text, deltas[0].stopped) == ("one ", True)
    kept = stream(["one two three"], ["three", "two"], include_stop=True)
    assert kept[0].text == "one two"


@pytest.mark.parametrize("stop", ["fox", "🙂", "y 🙂", "lazy dog"])
def test_detokenized_streams_cut_exactly_at_the_stop_string(stop: str) -> None:
    tokenizer = byte_level_bpe()
    text = "the quick brown fox jumps over the lazy 🙂 dog"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    output = StopStringText([stop])
    sent = ""
    for token in ids:
        delta = output.add(detokenizer.push(token))
        sent += delta.text
        assert text.startswith(sent)
        if delta.stopped:
            break
    else:
        sent += output.finish(detokenizer.finish()).text
    expected = text[: text.index(stop)] if stop in text else text
    assert sent == expected
    assert output.stopped == (stop in text)
