"""Locust users posting one 8x8 digit per request to ``/predict``, back to back (closed loop).

For people who prefer Locust to ``python -m loadtests.sweep`` (which uses wrk: one Locust
worker process tops out far below wrk on the same cores, so use this for behaviour, not for
the peak rate). Give the host on the command line and always a time limit:

    locust -f loadtests/locustfile.py --headless -u 64 -r 64 -t 30s --host http://127.0.0.1:8000

Only loopback hosts are accepted. The file is self-contained (Locust does not put the
repository root on ``sys.path``).
"""

from __future__ import annotations

import logging
import random
from typing import Any
from urllib.parse import urlsplit

import orjson
from locust import FastHttpUser, constant, events, task
from locust.env import Environment

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
BODY_COUNT = 64
HEADERS = {"Content-Type": "application/json"}


def _digit_bodies(seed: int = 0) -> list[bytes]:
    """Pixel intensities on scikit-learn's 1/16 grid, as in loadtests.configs.digits_bodies."""
    rng = random.Random(seed)
    return [
        orjson.dumps(
            {"instances": [[[rng.randint(0, 16) / 16 for _ in range(8)] for _ in range(8)]]}
        )
        for _ in range(BODY_COUNT)
    ]


BODIES = _digit_bodies()


@events.test_start.add_listener  # type: ignore[untyped-decorator]  # locust's is untyped
def _refuse_remote_hosts(environment: Environment, **_: Any) -> None:
    host = urlsplit(environment.host or "").hostname
    if host not in LOOPBACK_HOSTS:
        logging.error("load tests only target 127.0.0.1; got --host %r", environment.host)
        environment.process_exit_code = 2
        if environment.runner is not None:
            environment.runner.quit()


class DigitsUser(FastHttpUser):
    """One connection sending the next request as soon as the last one is answered."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.next_body = random.randrange(BODY_COUNT)

    @task
    def predict(self) -> None:
        body = BODIES[self.next_body]
        self.next_body = (self.next_body + 1) % BODY_COUNT
        with self.client.post(
            "/predict",
            data=body,  # type: ignore[arg-type]  # bytes are sent as they are; its hint omits them
            headers=HEADERS,
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
