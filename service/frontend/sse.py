"""Server-sent events: how a generation streams its tokens over HTTP (OpenAI's ``stream: true``
and the generate extension's ``generate_stream``).

Each event is one ``data:`` line of JSON and a blank line; OpenAI's streams end with
``data: [DONE]``. The answer is Starlette's ``StreamingResponse``: while it streams, it
listens for the client's disconnect and cancels the stream when it comes, which closes the
engine's iterators (each sequence is cancelled in the engine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import orjson
from starlette.responses import StreamingResponse

EVENT_STREAM = "text/event-stream"
DONE = b"data: [DONE]\n\n"
#: No cache may keep a stream, and nginx must pass each event on as it comes.
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: object) -> bytes:
    """One event carrying ``data`` as JSON (one line: JSON escapes every newline)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def event_stream(
    events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None
) -> StreamingResponse:
    """A 200 answer that sends each of ``events`` as it comes."""
    return StreamingResponse(
        events, media_type=EVENT_STREAM, headers={**_STREAM_HEADERS, **(headers or {})}
    )
