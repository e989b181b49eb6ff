"""The sampling settings a generation request may set, and the engine requests they make.

Checked once here for every route (OpenAI's and the generate extension's): the ranges are
OpenAI's where it has one. Where a request sets nothing, the version's
``generation_config.json`` decides (``text_model.GenerationDefaults``), then OpenAI's
defaults (a version's ``repetition_penalty`` applies to every request that sets none, as
``transformers``' pipeline applies it). ``n`` choices are ``n`` sequences; with a ``seed``,
choice ``i`` samples with ``seed + i``, so each choice is reproducible and the choices
differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.bridge.interface import GenerateRequest
from service.errors import InvalidParameterError
from service.frontend.generation.text_model import TextModel
from service.types import Priority

MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_FREQUENCY_PENALTY = 2.0
"""OpenAI's bound on ``frequency_penalty`` and ``presence_penalty``, either sign."""


@dataclass(frozen=True)
class SamplingSettings:
    """What a request asked for (None: not set)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: none; ``k``: each token's log-probability and the top ``k`` beside it."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None

    def check(self) -> None:
        """422 for a value out of its range, naming it and the range (OpenAI's routes
        answer it as 400)."""
        _at_least("max_tokens", self.max_tokens, 1)
        _within("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _at_least("top_k", self.top_k, 1)
        _within("seed", self.seed, 0, MAX_SEED)
        _within("n", self.n, 1, MAX_CHOICES)
        _within("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        _within(
            "frequency_penalty",
            self.frequency_penalty,
            -MAX_FREQUENCY_PENALTY,
            MAX_FREQUENCY_PENALTY,
        )
        _within(
            "presence_penalty", self.presence_penalty, -MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY
        )
        penalty = self.repetition_penalty
        if penalty is not None and not (math.isfinite(penalty) and penalty > 0.0):
            raise InvalidParameterError(
                "repetition_penalty",
                f"repetition_penalty must be above 0 (1 for none), got {penalty}",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError(
                "stop",
                f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are accepted",
            )
        for index, candidate in enumerate(self.stop):
            if len(candidate) > MAX_STOP_CHARS:
                raise InvalidParameterError(
                    "stop",
                    f"stop[{index}] is {len(candidate)} characters; at most {MAX_STOP_CHARS}",
                )

    def engine_requests(
        self,
        text_model: TextModel,
        prompt_ids: tuple[int, ...],
        *,
        priority: Priority,
        deadline_s: float,
        request_id: str,
        stream_deadline_s: float = float("inf"),
        traceparent: str | None = None,
    ) -> list[GenerateRequest]:
        """One engine request per choice. Without ``max_tokens``, the version's
        ``max_new_tokens``, else as many as the context leaves. ``deadline_s`` bounds the
        wait for the first token, ``stream_deadline_s`` the whole stream."""
        self.check()
        text_model.check_ids(self.stop_token_ids, "stop_token_ids")
        defaults = text_model.defaults
        temperature = _first(self.temperature, defaults.temperature, 1.0)
        top_p = _first(self.top_p, defaults.top_p, 1.0)
        repetition_penalty = _first(self.repetition_penalty, defaults.repetition_penalty, 1.0)
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = defaults.max_new_tokens
        manifest = text_model.manifest
        return [
            GenerateRequest(
                model=manifest.name,
                version=manifest.version,
                prompt_ids=prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=self.top_k if self.top_k is not None else defaults.top_k,
                seed=None if self.seed is None else (self.seed + index) % (MAX_SEED + 1),
                logprobs=self.logprobs,
                frequency_penalty=self.frequency_penalty or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                repetition_penalty=repetition_penalty,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                priority=priority,
                deadline_s=deadline_s,
                stream_deadline_s=max(deadline_s, stream_deadline_s),
                request_id=request_id if self.n == 1 else f"{request_id}-{index}",
                traceparent=traceparent,
            )
            for index in range(self.n)
        ]


def _first(value: float | None, default: float | None, fallback: float) -> float:
    if value is not None:
        return value
    return default if default is not None else fallback


def _at_least(name: str, value: int | None, least: int) -> None:
    if value is not None and value < least:
        raise InvalidParameterError(name, f"{name} must be at least {least}, got {value}")


def _within(name: str, value: float | None, least: float, most: float) -> None:
    if value is not None and not least <= value <= most:
        raise InvalidParameterError(name, f"{name} must be between {least} and {most}, got {value}")
