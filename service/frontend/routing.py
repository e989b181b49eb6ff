"""Which version of a model answers a request: its traffic split, read per request.

A request that names no version gets one by its model's weights (``traffic_split.py``): by the
bucket of its ``x-routing-key`` header (gRPC: metadata), so one key always meets one version
while the weights stand, or by a bucket drawn at random, once per request, without one. The
request's ``Routing`` also remembers the version chosen, so the request is counted under it
(``batchserve_model_requests_total``) when answered.
"""

from __future__ import annotations

import random

from starlette.types import Scope

from service import traffic_split
from service.bridge.interface import ModelInfo

ROUTING_KEY_HEADER = b"x-routing-key"
#: Where the middleware keeps a request's ``Routing`` in its scope's state.
ROUTING_STATE = "routing"


class Routing:
    """One request's routing key, its random bucket (drawn once, when first needed) and the
    model version it was validated for."""

    __slots__ = ("_draw", "chosen", "key")

    def __init__(self, key: str | None = None) -> None:
        self.key = key
        self._draw: int | None = None
        self.chosen: ModelInfo | None = None
        """The version the request was last validated for (None: not yet, or no model)."""

    def bucket(self, model: str) -> int:
        """This request's bucket among ``traffic_split.BUCKETS`` for ``model``."""
        if self.key is not None:
            return traffic_split.bucket_of(model, self.key)
        if self._draw is None:
            self._draw = random.randrange(traffic_split.BUCKETS)
        return self._draw


def routing_of(scope: Scope) -> Routing:
    """The ``Routing`` of an HTTP request, made at its first call and kept in its scope's
    state, where the middleware finds the version chosen once the request is answered."""
    state = scope.setdefault("state", {})
    routing = state.get(ROUTING_STATE)
    if routing is None:
        routing = state[ROUTING_STATE] = Routing(routing_key_of(scope))
    return routing  # type: ignore[no-any-return]


def routing_key_of(scope: Scope) -> str | None:
    """The request's ``x-routing-key`` header (the first, when repeated), or None."""
    for name, value in scope["headers"]:
        if name == ROUTING_KEY_HEADER:
            return bytes(value).decode("latin-1")
    return None
