"""A traffic split outlives its engine: set with ``batchserve traffic`` on a server of two
front ends and an engine process, it is served the same after the engine is killed (SIGKILL)
and restarted, as the published record says."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from service.server.cli import main
from service.traffic_split import bucket_of, version_for
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.processes import (
    Running,
    alive,
    engine_pids,
    free_port,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)

TOKEN = "traffic-restart-token-0123456789"
ONE_DIGIT = {"instances": [[[(row * 8 + col) / 64 for col in range(8)] for row in range(8)]]}
KEYS = [f"user-{index}" for index in range(16)]
ANSWER_TIMEOUT_S = 60.0


def answered_version(server: Running, key: str) -> str:
    """The version that answers a request with routing key ``key``, once one is answered
    (a front end that has not reconnected to the restarted engine answers 503 meanwhile)."""
    deadline_s = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        response = httpx.post(
            f"{server.url}/predict", json=ONE_DIGIT, headers={"x-routing-key": key}, timeout=10
        )
        if response.status_code == 200:
            version = str(response.json()["version"])
            assert response.headers["x-model-version"] == f"digits@{version}"
            return version
        assert response.status_code == 503, response.text
        assert time.monotonic() < deadline_s, f"no answer after {ANSWER_TIMEOUT_S} s"
        time.sleep(0.1)


def grpc_version(address: str, key: str) -> str:
    """The version that answers a gRPC ModelInfer with routing key ``key`` (metadata)."""
    client = triton_grpc.InferenceServerClient(address)
    try:
        image = triton_grpc.InferInput("image", [1, 8, 8], "FP32")
        image.set_data_from_numpy(np.asarray(ONE_DIGIT["instances"], dtype=np.float32))
        answer = client.infer("digits", [image], headers={"x-routing-key": key})
        return str(answer.get_response().model_version)
    finally:
        client.close()


def traffic(server: Running, *flags: str) -> int:
    return main(["traffic", "--url", server.url, "--token", TOKEN, "--model", "digits", *flags])


def test_a_split_is_served_the_same_after_its_engine_is_killed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    original = DIGITS.version
    weights = {original: 60, retrained: 40}
    expected = {key: version_for(weights, bucket_of("digits", key)) for key in KEYS}
    assert set(expected.values()) == {original, retrained}
    grpc_address = f"127.0.0.1:{free_port()}"
    with serve_with_engines(
        tmp_path,
        2,
        BATCHSERVE_MODEL_REPOSITORY=str(root),
        BATCHSERVE_MODEL_VERSION=original,
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
        BATCHSERVE_SPARE_ENGINE="false",
        BATCHSERVE_GRPC_PORT=grpc_address.rsplit(":", 1)[1],
    ) as server:
        wait_until_serving(server, 2)
        assert traffic(server, "--set", f"{original}=50,{retrained}=40") == 1
        assert "got 90" in capsys.readouterr().err
        assert traffic(server, "--set", f"{original}=60,{retrained}=40") == 0, server.output()
        capsys.readouterr()
        for key in KEYS:
            assert answered_version(server, key) == expected[key], key
        for key in KEYS[:8]:  # gRPC: the key as metadata
            assert grpc_version(grpc_address, key) == expected[key], key

        (engine,) = engine_pids(server)
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: not alive(engine), "the engine killed", server)
        for key in KEYS:
            assert answered_version(server, key) == expected[key], key
        assert engine_pids(server) != [engine]

        assert traffic(server, "--show") == 0
        shown = capsys.readouterr().out
        assert f'"{retrained}": 40' in shown
        assert traffic(server, "--clear") == 0
        capsys.readouterr()
        for key in KEYS[:4]:
            assert answered_version(server, key) == original
