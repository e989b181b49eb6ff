"""Engine capacity: synthetic front ends drive one engine process over the real bridge.

No HTTP: each synthetic front end is a process with one connection to the engine's socket,
sending pre-encoded request frames (closed loop: ``--window`` frames of ``--per-frame``
requests in flight, each resent as soon as all its requests are answered). The model costs
nothing (``Passthrough``: its input back), so what is measured is the engine's own cost per
request: the bridge, the batcher, the device-thread hand-off, collation and splitting. The
engine is pinned to one CPU (``--engine-cpu``), the front ends to the others.

The figure to quote is the engine's CPU per request (``/proc`` CPU time of the engine process
over the run, divided by the requests answered) and its inverse, requests per second of one
core: on a shared machine the throughput moves with the neighbours, the CPU per request much
less. ``--protocol old`` speaks the bridge of the commit before the coalesced frames (one JSON
SUBMIT frame per request, one RESULT frame per answer), so the same bench measures an engine
started from another checkout (``--checkout``).

    python -m loadtests.capacity --out docs/bench/engine-cost
    python -m loadtests.capacity --checkout /path/to/an/older/checkout --protocol old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

_PREFIX = struct.Struct("<IIB")
STATUS, OLD_SUBMIT, OLD_RESULT, OLD_ERROR, SUBMITS, ANSWERS = 13, 1, 11, 12, 4, 15
FEATURES = 4


PASSTHROUGH = """
import torch


class Passthrough(torch.nn.Module):
    \"\"\"A model that costs nothing: its input back.\"\"\"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
"""


def package(repository: Path) -> None:
    """The zero-cost model, its module written beside the repository (on the engine's
    path whatever the checkout)."""
    (repository.parent / "capacity_passthrough.py").write_text(PASSTHROUGH)
    sys.path.insert(0, str(repository.parent))
    from safetensors.torch import save_file

    from service.manifest import Architecture, TensorSpec
    from service.packaging.package import Packager

    weights = repository.parent / "empty.safetensors"
    save_file({}, str(weights))
    Packager(repository).package(
        name="zero",
        artifact=weights,
        format="safetensors",
        architecture=Architecture(import_path="capacity_passthrough:Passthrough"),
        inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
        outputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
    )


def cpu_seconds(pid: int) -> float:
    return sum(user_system_seconds(pid))


def user_system_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds a process spent in user space and in the kernel (system calls, wake-ups)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user and system) of a process's main thread (the engine's event loop)
    and of its other threads together (the device thread, torch's and uvloop's)."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1]
        except OSError:
            continue  # the thread ended
        name = "loop" if task.name == str(pid) else "other threads"
        ticks = fields.split()
        found[name] = found.get(name, 0.0) + (int(ticks[11]) + int(ticks[12])) / tick
    return found


def frames_in(buffer: bytearray) -> tuple[list[tuple[int, bytes]], int]:
    """Whole frames at the start of ``buffer`` (kind, header) and the bytes they took."""
    frames, offset = [], 0
    while len(buffer) - offset >= _PREFIX.size:
        header_length, data_length, kind = _PREFIX.unpack_from(buffer, offset)
        end = offset + _PREFIX.size + header_length + data_length
        if len(buffer) < end:
            break
        start = offset + _PREFIX.size
        frames.append((kind, bytes(buffer[start : start + header_length])))
        offset = end
    return frames, offset


def ready_version(path: str, timeout_s: float = 120.0) -> str:
    """Wait for the engine's first ready STATUS frame; its model's version."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
                buffer = bytearray()
                while time.monotonic() < deadline_s:
                    buffer += sock.recv(1 << 20)
                    frames, used = frames_in(buffer)
                    del buffer[:used]
                    for kind, header in frames:
                        status = json.loads(header)
                        if kind == STATUS and status["phase"] == "ready":
                            return str(status["models"][0]["manifest"]["version"])
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the engine did not become ready")


def encoded_frame(protocol: str, version: str, first_id: int, count: int) -> bytes:
    """``count`` one-row requests, ids from ``first_id``: one SUBMITS frame (new) or
    ``count`` SUBMIT frames (old)."""
    row = np.ones((1, FEATURES), dtype=np.float32).tobytes()
    deadline_s = time.monotonic() + 1e6
    if protocol == "old":
        frames = []
        for call_id in range(first_id, first_id + count):
            header = orjson.dumps(
                {
                    "arrays": [["x", "<f4", [1, FEATURES], 0]],
                    "id": call_id,
                    "model": "zero",
                    "version": version,
                    "group": [FEATURES],
                    "cost": 0,
                    "priority": "normal",
                    "deadline": deadline_s,
                    "request_id": "bench",
                    "load": 64,
                }
            )
            frames.append(_PREFIX.pack(len(header), len(row), OLD_SUBMIT) + header + row)
        return b"".join(frames)
    from service.bridge import contract

    packer = contract.DataPacker()
    named = __import__("service.tensors", fromlist=["NamedArrays"]).NamedArrays
    submits = [
        contract.Submit(
            id=call_id,
            model="zero",
            version=version,
            priority="normal",
            deadline_s=deadline_s,
            request_id="bench",
            arrays=packer.pack(named({"x": np.ones((1, FEATURES), dtype=np.float32)})),
        )
        for call_id in range(first_id, first_id + count)
    ]
    header = contract.encode(contract.Submits(load=64, requests=submits))
    data = b"".join(bytes(part) for part in packer.buffers)
    return _PREFIX.pack(len(header), len(data), SUBMITS) + header + data


def front_end(
    path: str,
    protocol: str,
    version: str,
    window: int,
    per_frame: int,
    duration_s: float,
    cpus: list[int],
    results: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    os.sched_setaffinity(0, cpus)
    frames = [encoded_frame(protocol, version, j * per_frame + 1, per_frame) for j in range(window)]

    async def run() -> int:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
        answered = 0
        owed = [per_frame] * window  # answers still due per frame in flight
        for frame in frames:
            writer.write(frame)
        buffer = bytearray()
        stop_s = time.monotonic() + duration_s
        from service.bridge import contract

        while time.monotonic() < stop_s:
            buffer += await reader.read(1 << 20)
            got, used = frames_in(buffer)
            del buffer[:used]
            for kind, header in got:
                if kind in (OLD_RESULT, OLD_ERROR):
                    ids = [int(json.loads(header)["id"])]
                elif kind == ANSWERS:
                    ids = [answer.id for answer in contract.decode_answers(header).answers]
                else:
                    continue
                for call_id in ids:
                    slot = (call_id - 1) // per_frame
                    owed[slot] -= 1
                    answered += 1
                    if owed[slot] == 0:
                        owed[slot] = per_frame
                        writer.write(frames[slot])
        writer.close()
        return answered

    results.put(asyncio.run(run()))


def engine_env(checkout: Path, scratch: Path, socket_path: str) -> dict[str, str]:
    """The variables of an engine process of ``checkout`` serving the zero-cost model packaged
    under ``scratch`` on ``socket_path``, with no multiprocess metrics directory."""
    env = os.environ | {
        "PYTHONPATH": f"{checkout}:{scratch}",
        "BATCHSERVE_MODEL_REPOSITORY": str(scratch / "models"),
        "BATCHSERVE_MODEL_NAME": "zero",
        "BATCHSERVE_DEVICE": "cpu",
        "BATCHSERVE_TORCH_THREADS": "1",
        "BATCHSERVE_MAX_BATCH_SIZE": "64",
        "BATCHSERVE_MAX_QUEUE_SIZE": "100000",
        "BATCHSERVE_LOG_LEVEL": "warning",
        "_BATCHSERVE_ENGINE_SOCKET": socket_path,
        "_BATCHSERVE_ENGINE_DEVICE": "cpu",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--protocol", choices=["new", "old"], default="new")
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--window", type=int, default=4, help="frames in flight per front end")
    parser.add_argument("--per-frame", type=int, default=32, help="requests per frame")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--engine-cpu", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append a JSON line here")
    parser.add_argument("--label", default="")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw output file")
    parser.add_argument("--profile-rate", type=int, default=300, help="py-spy samples a second")
    parser.add_argument("--profile-native", action="store_true", help="py-spy --native")
    parser.add_argument(
        "--profile-gil", action="store_true", help="py-spy --gil: samples holding the GIL only"
    )
    args = parser.parse_args(argv)
    others = [cpu for cpu in os.sched_getaffinity(0) if cpu != args.engine_cpu] or [0]
    with tempfile.TemporaryDirectory(prefix="capacity-") as scratch:
        repository = Path(scratch) / "models"
        package(repository)
        path = str(Path(scratch) / "engine.sock")
        env = engine_env(args.checkout, Path(scratch), path)
        engine = subprocess.Popen(
            [sys.executable, "-m", "service.engine.process"],
            cwd=args.checkout,
            env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, [args.engine_cpu]),
        )
        try:
            version = ready_version(path)
            results: multiprocessing.Queue[int] = multiprocessing.Queue()
            workers = [
                multiprocessing.Process(
                    target=front_end,
                    args=(path, args.protocol, version, args.window, args.per_frame,
                          args.duration_s, others, results),
                )
                for _ in range(args.frontends)
            ]  # fmt: skip
            user_before, system_before = user_system_seconds(engine.pid)
            threads_before = thread_seconds(engine.pid)
            started_s = time.monotonic()
            for worker in workers:
                worker.start()
            spy = None
            if args.profile is not None:
                spy = subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record",
                     "-r", str(args.profile_rate), "-d", str(int(args.duration_s) - 1),
                     "-f", "raw", "--threads",
                     *(["--native"] if args.profile_native else []),
                     *(["--gil"] if args.profile_gil else []),
                     "-p", str(engine.pid), "-o", str(args.profile)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            answered = sum(results.get(timeout=args.duration_s + 60) for _ in workers)
            elapsed_s = time.monotonic() - started_s
            user_after, system_after = user_system_seconds(engine.pid)
            threads_after = thread_seconds(engine.pid)
            user_s, system_s = user_after - user_before, system_after - system_before
            cpu_s = user_s + system_s
            for worker in workers:
                worker.join()
            if spy is not None:
                spy.wait(timeout=60)
        finally:
            engine.terminate()
            engine.wait(timeout=30)
    figures = {
        "label": args.label or f"{args.checkout.name}/{args.protocol}",
        "frontends": args.frontends,
        "per_frame": args.per_frame,
        "window": args.window,
        "requests_per_s": round(answered / elapsed_s),
        "engine_cpu_us_per_request": round(cpu_s / max(1, answered) * 1e6, 2),
        "engine_system_us_per_request": round(system_s / max(1, answered) * 1e6, 2),
        "requests_per_s_per_engine_core": round(answered / cpu_s) if cpu_s else None,
        "engine_cores_used": round(cpu_s / elapsed_s, 2),
        "engine_thread_us_per_request": {
            name: round((seconds - threads_before.get(name, 0.0)) / max(1, answered) * 1e6, 2)
            for name, seconds in sorted(threads_after.items())
            if seconds - threads_before.get(name, 0.0) > 0
        },
    }
    print(json.dumps(figures))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "capacity.jsonl").open("a") as log:
            log.write(json.dumps(figures) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
