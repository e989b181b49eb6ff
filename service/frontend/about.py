"""This package's version, as the OpenAPI document and ``GET /v2`` give it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("batchserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
