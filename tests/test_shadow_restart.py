"""A shadow is recorded with the published version record, beside the split's weights: an
engine started later (a replacement after a crash) resumes it, rather than serving without
one until ``batchserve rollout`` starts it again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.bridge.published import read_published
from service.config import Settings
from service.engine.engine import Engine
from service.processes import RUN_DIR_ENV
from service.server.single import create_app
from tests.apps import engine_of
from tests.digits_versions import DIGITS, add_digits_variant, copy_bundled_digits
from tests.fixtures import lifespan


async def engine_serving(root: Path) -> AsyncIterator[Engine]:
    app = create_app(Settings(model_repository=root, model_version=DIGITS.version, device="cpu"))
    async with lifespan(app):
        await app.state.loading
        yield engine_of(app)


async def test_an_engine_started_later_resumes_the_recorded_shadow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    candidate = add_digits_variant(root, {3: 0.25})
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    async for engine in engine_serving(root):
        await engine.start_shadow("digits", candidate, 25)
    async for engine in engine_serving(root):  # a replacement: the record, not model_version
        report = await engine.shadow_report("digits")
        assert (report.version, report.percent) == (candidate, 25)
        assert report.served_version == DIGITS.version
        await engine.stop_shadow("digits")
    recorded = read_published()
    assert recorded is not None
    assert [(entry.name, entry.shadow) for entry in recorded] == [("digits", None)]
