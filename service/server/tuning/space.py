"""The settings ``tune`` searches over, as one candidate configuration.

A candidate holds only the tuned settings; every other setting comes from the environment
``tune`` runs in. Rendered as ``BATCHSERVE_*`` variables, a candidate is what a trial server
starts with and what the ``--out`` file holds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from service.config import ENV_PREFIX, BatchPolicy, Settings

#: The settings ``tune`` chooses; the rest are left as the environment sets them.
TUNED_FIELDS = (
    "engine_mode",
    "workers",
    "torch_threads",
    "max_batch_size",
    "max_wait_ms",
    "batch_policy",
    "length_buckets",
    "max_batch_tokens",
)


@dataclass(frozen=True)
class Candidate:
    """One configuration of the tuned settings (``Settings``' defaults unless changed)."""

    engine_mode: str = "auto"
    workers: int = 1
    torch_threads: int = 0
    max_batch_size: int = 64
    max_wait_ms: float = 5.0
    batch_policy: BatchPolicy = "adaptive"
    length_buckets: tuple[int, ...] = ()
    max_batch_tokens: int = 16_384

    def changed(self, **changes: object) -> Candidate:
        return replace(self, **changes)  # type: ignore[arg-type]

    def environment(self) -> dict[str, str]:
        """Every tuned setting as a ``BATCHSERVE_*`` variable, as ``serve`` reads it."""
        return {ENV_PREFIX + name.upper(): _render(getattr(self, name)) for name in TUNED_FIELDS}

    def label(self) -> str:
        """A short description that names what differs from the defaults."""
        defaults = Candidate()
        parts = [
            f"{_SHORT[name]}={_render(getattr(self, name)) or '-'}"
            for name in TUNED_FIELDS
            if getattr(self, name) != getattr(defaults, name)
        ]
        return " ".join(parts) or "defaults"

    def settings(self, **others: object) -> Settings:
        """Validated settings of this candidate (plus ``others``): raises if invalid."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return Settings(**(values | others))


_SHORT = {
    "engine_mode": "mode",
    "workers": "workers",
    "torch_threads": "threads",
    "max_batch_size": "batch",
    "max_wait_ms": "wait_ms",
    "batch_policy": "policy",
    "length_buckets": "buckets",
    "max_batch_tokens": "tokens",
}


def _render(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def defaults_candidate() -> Candidate:
    """``Settings``' own defaults for the tuned fields (what ``serve`` uses unless told)."""
    schema = Settings.model_fields
    return Candidate(**{name: schema[name].default for name in TUNED_FIELDS})
