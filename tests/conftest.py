"""Shared pytest configuration; fakes live in fixtures.py and torch_models.py."""
