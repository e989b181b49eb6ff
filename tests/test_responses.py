"""The JSON answers of ``frontend/responses.py``."""

from __future__ import annotations

import numpy as np

from service.frontend.responses import json_answer, json_response


def test_a_prepared_answer_carries_what_starlettes_response_would() -> None:
    """The inference answer built from raw headers (no ``init_headers``) has the body and
    the headers, in the order, of the ``Response`` it replaced."""
    document = {"model": "m", "version": "1", "predictions": np.arange(3, dtype=np.float32)}
    prepared = json_answer(document, (b"x-model-version", b"m@1"))
    plain = json_response(document, headers={"X-Model-Version": "m@1"})
    assert prepared.body == plain.body
    assert prepared.raw_headers == plain.raw_headers
    assert prepared.status_code == plain.status_code == 200
