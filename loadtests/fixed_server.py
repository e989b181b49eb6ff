"""A trivial HTTP/1.1 server answering every request with one constant response.

It does no work per request beyond parsing it (httptools on uvloop), so wrk's rate against
it is the load generator's own ceiling on this machine: if the served rates come close to it,
the generator, not the server, is the bottleneck.

    python -m loadtests.fixed_server --port 8099
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import httptools
import uvloop

# About the size of a digits answer, so the generator reads as many bytes per response.
BODY = (
    b'{"model":"digits","version":"000000000000","predictions":[[0.0,0.0,0.0,0.0,0.0,'
    b"0.0,0.0,0.0,0.0,0.0]]}"
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


class FixedResponseProtocol(asyncio.Protocol):
    """Answers each complete request (keep-alive, pipelining allowed) with ``RESPONSE``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        if self.transport is not None:
            self.transport.write(RESPONSE)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FixedResponseProtocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
