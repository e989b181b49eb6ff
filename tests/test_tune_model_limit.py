"""``tuning.model_limit``: what the model limit measures within its budget."""

from __future__ import annotations

from service.config import Settings
from service.server.tuning.model_limit import measure_limit


async def test_batch_one_is_measured_even_when_loading_took_the_whole_budget() -> None:
    """The budget counts from before the load; on a busy host the load alone can take it
    all, and a limit of 0 rows/s then misled every later estimate."""
    settings = Settings(model_name="digits", device="cpu", warmup_batch_sizes=(1,))
    limit, manifest = await measure_limit(
        settings, lengths=[None], largest_batch=8, slowest_batch_ms=1000.0, budget_s=0.0
    )
    assert manifest.name == "digits"
    assert limit.rows_per_s[None][1] > 0
    assert set(limit.rows_per_s[None]) == {1}, "the budget still bounds the larger batches"
