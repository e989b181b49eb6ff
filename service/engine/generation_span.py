"""The span of one traced generation stream in the engine.

A ``generate`` span is a child of the front end's span waiting for the stream (its
``traceparent``), from the request's arrival in the engine to its end: an event marks the first
token, and its attributes give the prompt's and the completion's token counts and how the
stream ended (``stop``, ``length``, ``error``, ``cancelled``, or a refusal's code). Only sampled
streams are traced; nothing is recorded when tracing is off.
"""

from __future__ import annotations

from opentelemetry import trace

from service import tracing


class StreamSpan:
    """One sampled stream's ``generate`` span."""

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    @classmethod
    def start(
        cls, traceparent: str | None, model: str, version: str, prompt_tokens: int
    ) -> StreamSpan | None:
        """The span of a stream asked for under ``traceparent``; None when it is not traced."""
        if tracing.current is None or traceparent is None or not tracing.is_sampled(traceparent):
            return None
        span = tracing.current.engine_tracer.start_span(
            "generate",
            context=tracing.parent_from(traceparent),
            attributes={
                "batchserve.model": model,
                "batchserve.model.version": version,
                "batchserve.generation.prompt_tokens": prompt_tokens,
            },
        )
        return cls(span)

    def first_token(self) -> None:
        self._span.add_event("first_token")

    def end(self, completion_tokens: int, outcome: str) -> None:
        self._span.set_attribute("batchserve.generation.completion_tokens", completion_tokens)
        self._span.set_attribute("batchserve.generation.finish_reason", outcome)
        if outcome not in ("stop", "length", "cancelled"):
            self._span.set_status(trace.StatusCode.ERROR, outcome)
        self._span.end()
