"""What the generation loop steps: a causal LM's ``ContinuousBatch`` or an encoder-decoder's
``CohortBatch``, both driven from one device thread the same way."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from service.engine.generation.sequences import GenerationRequest, TokenEvent


class SteppedBatch(Protocol):
    """Sequences that join, step a token at a time and leave (``continuous_batch.py``,
    ``cohorts.py``)."""

    max_waiting_sequences: int
    """How many may wait beyond ``slots`` before a request is refused with 429."""

    @property
    def slots(self) -> int:
        """Sequences that may run at once."""
        ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def check(self, request: GenerationRequest) -> int:
        """The new tokens ``request`` may generate, or its refusal (422); any thread."""
        ...

    def submit(self, request: GenerationRequest) -> None: ...

    def cancel(self, request_id: Hashable) -> bool: ...

    def step(self) -> list[TokenEvent]: ...
