"""A running server's admin API, for the commands that drive it (``batchserve traffic``,
``batchserve rollout``): the standard library's HTTP client, so the CLI needs nothing the
container does not install."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import orjson


class AdminError(Exception):
    """The admin API answered an error, or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message if status == 0 else f"{status}: {message}")
        self.status = status


@dataclass(frozen=True)
class AdminApi:
    """The admin API of one server, with its bearer token (stdlib HTTP: no client library)."""

    url: str
    token: str
    timeout_s: float = 900.0
    """A step may load and warm up a version on every engine."""

    def call(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else orjson.dumps(body)
        request = urllib.request.Request(
            self.url.rstrip("/") + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return orjson.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raise AdminError(error.code, _message(error.read())) from None
        except (urllib.error.URLError, OSError) as error:
            raise AdminError(0, f"{self.url} cannot be reached: {error}") from None


def _message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]
