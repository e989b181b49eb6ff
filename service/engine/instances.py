"""Model instances per device, as Triton's instance groups: K device threads fed by one
batcher, torch's intra-op threads shared out between them.

One instance (the default) runs one batch at a time, which is what a GPU wants (one stream
of kernels, batches as full as the load allows). On a CPU host one instance leaves cores idle
while the batcher collects the next batch and the answers are written; K instances let K
batches run at once, each on ``torch_threads // K`` threads, so one engine (one copy of the
model) uses every core without a model copy per front end.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def device_threads(instances: int, torch_threads: int) -> ThreadPoolExecutor:
    """The executor of the device's ``instances`` threads; each uses ``torch_threads //
    instances`` intra-op threads (at least one). Set in every device thread, one instance
    too: OpenMP's count is per calling thread, and a thread never given one runs BLAS on
    OpenMP's default (a worker per CPU, spinning between batches)."""
    return ThreadPoolExecutor(
        instances,
        thread_name_prefix="batchserve-device",
        initializer=_share_threads,
        initargs=(max(1, torch_threads // instances),),
    )


def _share_threads(threads: int) -> None:
    import torch  # in the device thread only: the module stays importable without torch

    torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
