"""Model instances per device, as Triton's instance groups: K device threads fed by one
batcher, torch's intra-op threads shared out between them.

One instance (the default) runs one batch at a time, which is what a GPU wants (one stream
of kernels, batches as full as the load allows). On a CPU host one instance leaves cores idle
while the batcher collects the next batch and the answers are written; K instances let K
batches run at once, each on ``torch_threads // K`` threads, so one engine (one copy of the
model) uses every core without a model copy per front end.

The event loop hands a batch to the threads through a ``SimpleQueue`` and gets its result
back with ``call_soon_threadsafe`` (``DeviceThreads.run``): no ``concurrent.futures.Future``,
work item, condition variable and callback chain per batch, as ``run_in_executor`` on a
``ThreadPoolExecutor`` costs. ``submit`` stays for the rest (warm-ups, tuning).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

#: A batch for the device threads: the call, and where its result goes (an asyncio future on
#: ``loop``, or a ``concurrent.futures.Future``).
_Work = tuple[
    Callable[[], Any],
    asyncio.AbstractEventLoop | None,
    "asyncio.Future[Any] | concurrent.futures.Future[Any]",
]


class DeviceThreads(concurrent.futures.Executor):
    """``instances`` device threads, each on ``torch_threads`` intra-op threads."""

    def __init__(self, instances: int, torch_threads: int) -> None:
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(torch_threads,),
                name=f"batchserve-device_{index}",
                daemon=True,  # shut_down joins them; a crashed engine must still exit
            )
            for index in range(instances)
        ]
        for thread in self._threads:
            thread.start()

    def run(self, call: Callable[..., R], *args: Any) -> asyncio.Future[R]:
        """``call(*args)`` on a device thread; its result (or exception) on this event loop.
        Cancelling the future before a thread takes the call means it never runs."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._put((functools.partial(call, *args), loop, future))
        return future

    def submit(
        self, fn: Callable[..., R], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[R]:
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        self._put((functools.partial(fn, *args, **kwargs), None, future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Run what is queued, then stop the threads (once)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._work.put(None)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _put(self, work: _Work) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run a batch on device threads that were shut down")
            self._work.put(work)

    def _serve(self, torch_threads: int) -> None:
        _share_threads(torch_threads)
        while True:
            work = self._work.get()
            if work is None:
                return
            call, loop, future = work
            if loop is None:
                assert isinstance(future, concurrent.futures.Future)
                _run_for_thread(call, future)
            else:
                assert isinstance(future, asyncio.Future)
                _run_for_loop(call, loop, future)
            del work, call, future  # free the batch before waiting for the next


def _run_for_thread(call: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except BaseException as error:  # as ThreadPoolExecutor: the caller gets every error
        future.set_exception(error)
    else:
        future.set_result(result)


def _run_for_loop(
    call: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]
) -> None:
    if future.cancelled():  # its caller gave up while it was queued: never run it
        return
    try:
        result = call()
    except BaseException as error:
        _hand_back(loop, _set_exception, future, error)
    else:
        _hand_back(loop, _set_result, future, result)


def _hand_back(
    loop: asyncio.AbstractEventLoop,
    settle: Callable[[asyncio.Future[Any], Any], None],
    future: asyncio.Future[Any],
    value: object,
) -> None:
    # RuntimeError: the loop has closed, and nobody is left to take the result.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle, future, value)


def _set_result(future: asyncio.Future[Any], result: object) -> None:
    if not future.done():  # cancelled meanwhile
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def device_threads(instances: int, torch_threads: int) -> DeviceThreads:
    """The device's ``instances`` threads; each uses ``torch_threads // instances`` intra-op
    threads (at least one). Set in every device thread, one instance too: OpenMP's count is
    per calling thread, and a thread never given one runs BLAS on OpenMP's default (a worker
    per CPU, spinning between batches)."""
    return DeviceThreads(instances, max(1, torch_threads // instances))


def _share_threads(threads: int) -> None:
    import torch  # in the device thread only: the module stays importable without torch

    torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
