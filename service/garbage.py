"""How a serving process sets Python's garbage collector, once it holds what it keeps for life.

Requests make and drop objects by the thousand a second, nearly all freed by reference
counting within milliseconds. At Python's default (a young collection every 700 net new
container objects) the collector ran every few requests, walking the requests in flight and
moving them into the older generations, whose collections then walked them again. Garbage
cycles wait for a collection a little longer; an answered error leaves none
(``errors.forget_traceback``).
"""

from __future__ import annotations

import gc

#: Net new container objects between two young collections (Python's default: 700). A steady
#: load, whose live objects stay bounded, seldom reaches it.
YOUNG_COLLECTION_OBJECTS = 50_000


def collect_young_garbage_rarely() -> None:
    """Raise the young generation's threshold to ``YOUNG_COLLECTION_OBJECTS`` (the older
    generations' are kept)."""
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *gc.get_threshold()[1:])
