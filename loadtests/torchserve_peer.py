"""TorchServe 0.12 serving the PEERS.md MLP, set up, started and stopped from this repository.

TorchServe lives in its own virtualenv outside the repository (``DEFAULT_VENV``; its Java
front end needs a JDK 17 or later on the path), made here with ``python3.11 -m venv`` and
pip. The model is the one batchserve serves in the load tests: ``service/models/mlp.py``
with the weights ``configs.MLP_MODEL`` packaged (``torch.manual_seed(0)``), archived with
``loadtests/peers/torchserve_mlp_handler.py`` as in PEERS.md: one Python worker, batches of
up to 64 requests, ``maxBatchDelay`` 5 ms. Every address (inference, management, metrics,
both gRPC ones) is bound to 127.0.0.1 on a free port, token authorisation is off (nothing
but this machine can reach it), and system metrics are off (their collector is a Python
process TorchServe starts every minute, which would load the 2 cores under test).

TorchServe runs as the leader of its own process group (its launcher, the Java front end
and the Python worker); ``serving`` stops the whole group when its block ends, on an
exception or Ctrl-C too, and waits until none of it is left.

    python -m loadtests.torchserve_peer --check   # set up, start, compare with batchserve, stop
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from loadtests import servers

DEFAULT_VENV = Path("/tmp/batchserve-torchserve-venv")
PACKAGES = (
    "torchserve==0.12.0",
    "torch-model-archiver==0.12.0",
    "torch==2.13.0",
    "pyyaml",
    "numpy",
)
"""TorchServe 0.12's worker imports yaml without declaring it; torch warns without numpy."""
IMPORTS_CHECK = "import ts.model_service_worker, model_archiver, torch, yaml, numpy"
VENV_PYTHON = "python3.11"
MINIMUM_JAVA = 17
MODEL_NAME = "mlp"
MAX_BATCH_REQUESTS = 64
MAX_BATCH_DELAY_MS = 5
HANDLER = Path(__file__).resolve().parent / "peers" / "torchserve_mlp_handler.py"
MODEL_SOURCE = Path(__file__).resolve().parents[1] / "service" / "models" / "mlp.py"
ANSWER_TOLERANCE = 1e-4
"""Absolute and relative: the same weights and input, but torch may sum in another order."""
ADDRESS_KEYS = ("inference", "management", "metrics", "grpc_inference", "grpc_management")


def java_major_version(version_text: str) -> int:
    """The major version in ``java -version``'s output (``1.8.0_x`` is 8, ``17.0.15`` is 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_text)
    if match is None:
        raise ValueError(f"no version in java's output: {version_text[:200]!r}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def check_java() -> str:
    """``java -version``'s first line; RuntimeError if there is no Java or it is too old."""
    java = shutil.which("java")
    if java is None:
        raise RuntimeError(f"TorchServe needs Java {MINIMUM_JAVA}+ on PATH; none found")
    output = subprocess.run(
        [java, "-version"], capture_output=True, text=True, timeout=30, check=False
    )
    text = output.stderr or output.stdout
    major = java_major_version(text)
    if major < MINIMUM_JAVA:
        raise RuntimeError(f"TorchServe 0.12 needs Java {MINIMUM_JAVA}+, {java} is {major}")
    return text.splitlines()[0]


def ensure_venv(venv: Path) -> Path:
    """``venv`` with ``PACKAGES`` installed (made, or completed, unless it imports them all);
    its bin/."""
    bin_dir = venv / "bin"
    if (bin_dir / "python").exists():
        found = subprocess.run(
            [str(bin_dir / "python"), "-c", IMPORTS_CHECK],
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        if found.returncode == 0:
            return bin_dir
    else:
        subprocess.run([VENV_PYTHON, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(bin_dir / "pip"), "install", "--quiet", *PACKAGES], check=True, timeout=1800
    )
    return bin_dir


@dataclass(frozen=True)
class Ports:
    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int

    @classmethod
    def free(cls) -> Ports:
        return cls(*(servers.free_port() for _ in ADDRESS_KEYS))


def config_properties(ports: Ports, model_store: Path) -> str:
    """TorchServe's ``config.properties``: every address on 127.0.0.1, the MLP loaded with
    one worker, PEERS.md's batching."""
    models = {
        MODEL_NAME: {
            "1.0": {
                "defaultVersion": True,
                "marName": f"{MODEL_NAME}.mar",
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": MAX_BATCH_REQUESTS,
                "maxBatchDelay": MAX_BATCH_DELAY_MS,
                "responseTimeout": 120,
            }
        }
    }
    lines = [
        f"inference_address=http://127.0.0.1:{ports.inference}",
        f"management_address=http://127.0.0.1:{ports.management}",
        f"metrics_address=http://127.0.0.1:{ports.metrics}",
        "grpc_inference_address=127.0.0.1",
        f"grpc_inference_port={ports.grpc_inference}",
        "grpc_management_address=127.0.0.1",
        f"grpc_management_port={ports.grpc_management}",
        f"model_store={model_store}",
        f"load_models={MODEL_NAME}.mar",
        f"models={json.dumps(models)}",
        "default_workers_per_model=1",
        "disable_token_authorization=true",
        "disable_system_metrics=true",
        "install_py_dep_per_model=false",
        "allowed_urls=file://.*",
    ]
    return "\n".join(lines) + "\n"


def archive(bin_dir: Path, weights: Path, folder: Path) -> Path:
    """``mlp.mar`` in ``folder``/model-store from batchserve's safetensors ``weights``."""
    import torch
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    state_dict = folder / "mlp.pt"
    torch.save(load_file(str(weights)), state_dict)
    # BaseHandler imports the model file by its name and builds its one nn.Module class.
    model_file = folder / "peer_mlp.py"
    model_file.write_text(MODEL_SOURCE.read_text())
    store = folder / "model-store"
    store.mkdir(exist_ok=True)
    subprocess.run(
        [str(bin_dir / "torch-model-archiver"), "--model-name", MODEL_NAME, "--version", "1.0",
         "--model-file", str(model_file), "--serialized-file", str(state_dict),
         "--handler", str(HANDLER), "--export-path", str(store), "--force"],
        check=True, timeout=300,
    )  # fmt: skip
    return store


@dataclass(frozen=True)
class TorchServe:
    """A running TorchServe: its process group's leader and its addresses."""

    process: subprocess.Popen[bytes]
    ports: Ports

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def predict_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.inference}/predictions/{MODEL_NAME}"


def wait_ready(
    server: TorchServe, probe: bytes, headers: Mapping[str, str], log: Path, timeout_s: float
) -> None:
    """Until ``probe`` is answered 200 (the front end is up and the worker has loaded)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise servers.ServerError(
                f"TorchServe exited with status {server.process.returncode}:\n{_tail(log)}"
            )
        with contextlib.suppress(httpx.TransportError):
            response = httpx.post(
                server.predict_url, content=probe, headers=dict(headers), timeout=10
            )
            if response.status_code == 200:
                return
            last = f"{response.status_code}: {response.text[:300]}"
        time.sleep(0.5)
    raise servers.ServerError(
        f"TorchServe not ready after {timeout_s:.0f} s ({last}):\n{_tail(log)}"
    )


def _tail(log: Path, characters: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-characters:]
    except OSError:
        return ""


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM to the whole group (launcher, Java, worker), SIGKILL to what is left after
    ``timeout_s``; returns once no process of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.poll() is None:
            process.wait(timeout=10)
        kill_deadline = time.monotonic() + 10
        while group_alive(process.pid) and time.monotonic() < kill_deadline:
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def serving(
    bin_dir: Path,
    model_store: Path,
    folder: Path,
    probe: bytes,
    headers: Mapping[str, str],
    ready_timeout_s: float = 180.0,
) -> Iterator[TorchServe]:
    """TorchServe with ``model_store``'s MLP until the block ends; its files in ``folder``."""
    ports = Ports.free()
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.properties"
    config.write_text(config_properties(ports, model_store))
    temporary = folder / "tmp"  # its pid file and Java's temporary files, not /tmp's
    temporary.mkdir(exist_ok=True)
    env = os.environ | {"TMPDIR": str(temporary), "TEMP": str(temporary)}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"  # the worker's Python is the venv's
    log = folder / "torchserve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [str(bin_dir / "torchserve"), "--start", "--foreground", "--ncs",
             "--ts-config", str(config), "--model-store", str(model_store),
             "--disable-token-auth"],
            cwd=folder, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        server = TorchServe(process, ports)
        wait_ready(server, probe, headers, log, ready_timeout_s)
        yield server
    finally:
        stop_group(process)


def predictions(url: str, body: bytes, headers: Mapping[str, str]) -> np.ndarray:
    response = httpx.post(url, content=body, headers=dict(headers), timeout=60)
    if response.status_code != 200:
        raise servers.ServerError(f"{url} answered {response.status_code}: {response.text[:500]}")
    return np.asarray(response.json()["predictions"], dtype=np.float64)


def check_same_answers(
    torchserve_url: str, batchserve_url: str, bodies: Sequence[bytes], headers: Mapping[str, str]
) -> float:
    """The largest difference between the two servers' logits over ``bodies``; ServerError
    if any exceeds ``ANSWER_TOLERANCE`` (another model or other weights)."""
    largest = 0.0
    for body in bodies:
        theirs = predictions(torchserve_url, body, headers)
        ours = predictions(batchserve_url, body, headers)
        if theirs.shape != ours.shape or not np.allclose(
            theirs, ours, rtol=ANSWER_TOLERANCE, atol=ANSWER_TOLERANCE
        ):
            raise servers.ServerError(
                f"TorchServe and batchserve disagree on the same input: shapes {theirs.shape} "
                f"and {ours.shape}, TorchServe {theirs.ravel()[:4]}, batchserve {ours.ravel()[:4]}"
            )
        largest = max(largest, float(np.max(np.abs(theirs - ours))))
    return largest


def packaged_weights(repository: Path, model_name: str) -> Path:
    """The safetensors file ``configs.PackagedModel.package`` wrote beside ``repository``."""
    weights = repository.parent / f"{model_name}.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no weights at {weights} beside the repository {repository}")
    return weights


def main(argv: Sequence[str] | None = None) -> int:
    """``--check``: set up TorchServe, start it and one batchserve, compare answers, stop."""
    import tempfile

    from loadtests import configs, sweep

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--check", action="store_true", help="start both and compare answers")
    args = parser.parse_args(argv)
    print(check_java(), file=sys.stderr)
    bin_dir = ensure_venv(args.venv)
    if not args.check:
        return 0
    workload = configs.MLP
    with tempfile.TemporaryDirectory(prefix="torchserve-peer-") as scratch:
        harness = sweep.Sweep(sweep.parse_args(["--warmup-s", "0"]), Path(scratch), Path(scratch))
        repository = harness.ensure_repository(configs.MLP_MODEL)
        store = archive(
            bin_dir, packaged_weights(repository, configs.MLP_MODEL.name), Path(scratch) / "ts"
        )
        bodies = workload.bodies()
        with (
            servers.ServerPool() as pool,
            serving(
                bin_dir, store, Path(scratch) / "ts", bodies[0], workload.headers()
            ) as torchserve,
        ):
            contender = harness.start_contender(pool, configs.CONFIGURATIONS["mlp-single"], None)
            largest = check_same_answers(
                torchserve.predict_url,
                contender.server.url + "/predict",
                bodies[:8],
                workload.headers(),
            )
            print(f"same answers: largest difference {largest:.2e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
