"""Shared pytest configuration. Fakes live in tests/fixtures.py (batcher) and tests/torch_models.py."""
