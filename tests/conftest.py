"""Shared pytest configuration; fakes live in fixtures.py and torch_models.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny generative models on a shared machine: a second intra-op thread only spins
    against the other processes, many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
