"""Stop strings: where a generated text must be cut, and what of it is safe to stream yet.

A stop string can arrive split over several tokens, and a stream must never send text that a
later token turns into the start of a stop string. So the text is checked each time it grows
(only where the new characters can complete a match), and the characters that could still be
the start of a stop string are held back until the next token decides. When one matches, the
sequence is done: its owner cancels it in the engine. Pure string work, no tokenizer, shared
by the engine and the front ends (as vLLM's ``check_stop_strings``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def find_stop(text: str, new_chars: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last ``new_chars`` characters of
    ``text``, as (where it starts, the string); ``None`` when there is none. The text before
    them was checked when it arrived."""
    best: tuple[int, str] | None = None
    for candidate in stop:
        if not candidate:
            continue
        start = max(0, len(text) - new_chars - len(candidate) + 1)
        found = text.find(candidate, start)
        if found >= 0 and (best is None or found < best[0]):
            best = (found, candidate)
    return best


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string, so
    must not be sent before more text decides."""
    longest = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, len(text)), longest, -1):
            if text.endswith(candidate[:length]):
                longest = length
                break
    return longest


@dataclass(frozen=True)
class TextDelta:
    """What to send after a piece of text arrived."""

    text: str
    stopped: bool
    """A stop string matched: ``text`` ends where the output ends, and the sequence is
    done."""


class StopStringText:
    """The text of one sequence, cut at its first stop string, streamed without ever sending
    characters a stop string later claims.

    ``include_stop``: keep the matched stop string at the end of the output (vLLM's
    ``include_stop_str_in_output``); OpenAI's API leaves it out.
    """

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        self._stop = tuple(candidate for candidate in stop if candidate)
        self._include_stop = include_stop
        self._text = ""
        self._sent = 0
        self._stopped = False

    @property
    def text(self) -> str:
        """The output sent so far."""
        return self._text[: self._sent]

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, delta: str) -> TextDelta:
        """Take the next piece of text; give what can be sent now."""
        if self._stopped:
            return TextDelta("", stopped=True)
        self._text += delta
        match = find_stop(self._text, len(delta), self._stop)
        if match is not None:
            start, candidate = match
            end = start + len(candidate) if self._include_stop else start
            self._stopped = True
            return self._send_up_to(end, stopped=True)
        return self._send_up_to(len(self._text) - held_back(self._text, self._stop), False)

    def finish(self, rest: str = "") -> TextDelta:
        """The last piece of text (the detokenizer's ``finish``), and everything held back:
        no more text will come to complete a stop string."""
        last = self.add(rest)
        if last.stopped:
            return last
        tail = self._send_up_to(len(self._text), stopped=False)
        return TextDelta(last.text + tail.text, stopped=False)

    def _send_up_to(self, end: int, stopped: bool) -> TextDelta:
        end = max(end, self._sent)
        piece = self._text[self._sent : end]
        self._sent = end
        return TextDelta(piece, stopped=stopped)
