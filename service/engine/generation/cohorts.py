"""Encoder-decoder models (T5, BART: ``*ForConditionalGeneration``), batched in cohorts.

Their decoders in ``transformers`` take one position for the whole batch (the cache's
length; T5's relative position bias is computed from it), so a sequence cannot join a running
batch at its own position as in ``continuous_batch.py``. Instead, the requests waiting at a
step form a cohort: their prompts are encoded together, padded, and they decode together, one
token each per step, with the library's own ``EncoderDecoderCache``. A finished or cancelled
sequence leaves its cohort at once through the cache's public ``batch_select_indices``. Each
step runs one forward per cohort, so a request waits at most one step to start, and at most
``max_cohorts`` forwards share a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from service.config import Precision
from service.engine.generation.admission import new_tokens_allowed, waiting_position
from service.engine.generation.continuous_batch import precision_context
from service.engine.generation.sampling import new_generator
from service.engine.generation.sequences import (
    GenerationRequest,
    RunningSequence,
    TokenEvent,
    accept_next,
)
from service.errors import InvalidInputError, QueueFullError

_NEVER = -1e9
"""A forced row's score of every other token: its probability is zero in float32, and a
row of them sums to a finite number."""


class _Cohort:
    """Sequences that decode together: their encoder states, mask and cache, row by row."""

    def __init__(
        self,
        sequences: list[RunningSequence],
        encoded: torch.Tensor,
        mask: torch.Tensor,
        start_token_id: int,
    ) -> None:
        self.sequences = sequences
        self.encoded = encoded
        self.mask = mask
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.start_token_id = start_token_id

    def next_inputs(self) -> list[int]:
        return [
            sequence.generated[-1] if sequence.generated else self.start_token_id
            for sequence in self.sequences
        ]

    def keep(self, kept: list[RunningSequence]) -> None:
        """Drop every row but ``kept`` (in their order) from the cohort and its cache."""
        if len(kept) == len(self.sequences):
            return
        rows = [self.sequences.index(sequence) for sequence in kept]
        self.sequences = kept
        if not kept:
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.encoded = self.encoded[index]
        self.mask = self.mask[index]
        self.cache.batch_select_indices(index)


class CohortBatch:
    """The running cohorts of one encoder-decoder model, and the requests waiting to start.

    ``submit``, ``cancel`` and ``step`` as ``ContinuousBatch``'s, called from one thread
    (``max_waiting_sequences``: how many may wait beyond ``slots``). A prompt is the
    encoder's input; ``max_tokens`` counts the decoder's tokens after its start token.
    ``context_tokens``: the most tokens an encoder input or a decoder sequence may hold, and
    no more than the config's ``max_position_embeddings`` (T5's relative positions have no
    limit of their own; its tokenizer's ``model_max_length`` is the usual one).
    ``kv_budget_bytes``: the memory its caches may take: ``slots`` is as many sequences of
    the whole context (prompt and decoder) as it holds, and at most
    ``max_running_sequences`` (None: no budget). ``forced_bos_token_id``: the first token of
    every sequence; ``forced_eos_token_ids``: its last within ``max_tokens`` (one of them), as
    ``generate``'s forcing logits processors choose them (BART's checkpoints name both).
    """

    def __init__(
        self,
        model: Any,
        *,
        max_running_sequences: int,
        max_waiting_sequences: int,
        max_cohorts: int = 4,
        eos_token_ids: Iterable[int] = (),
        decoder_start_token_id: int | None = None,
        context_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        forced_bos_token_id: int | None = None,
        forced_eos_token_ids: Iterable[int] = (),
        precision: Precision = "fp32",
    ) -> None:
        self._model = model
        self._device: torch.device = next(model.parameters()).device
        self._precision = precision_context(precision, self._device)
        self.max_running_sequences = max_running_sequences
        self.max_waiting_sequences = max_waiting_sequences
        self.max_cohorts = max_cohorts
        self._eos_ids = frozenset(eos_token_ids)
        self._forced_bos = () if forced_bos_token_id is None else (forced_bos_token_id,)
        self._forced_eos = tuple(forced_eos_token_ids)
        start = decoder_start_token_id
        if start is None:
            start = model.generation_config.decoder_start_token_id
        if not isinstance(start, int):
            raise ValueError(
                f"{type(model).__name__} names no decoder_start_token_id (generation_config "
                f"or config), got {start!r}"
            )
        self._start_token_id = start
        named = getattr(model.config, "max_position_embeddings", None)
        limits = [
            value for value in (named, context_tokens) if isinstance(value, int) and value > 0
        ]
        limit = min(limits) if limits else None
        if limit is None or limit < 2:
            raise ValueError(
                f"{type(model).__name__}'s config names no context length: pass "
                f"context_tokens (at least 2), got {limit!r}"
            )
        self.context_tokens = limit
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._slots = max_running_sequences
        if kv_budget_bytes is not None:
            per_sequence = self.context_tokens * self._bytes_per_token()
            self._slots = min(max_running_sequences, kv_budget_bytes // per_sequence)
            if self._slots < 1:
                raise ValueError(
                    f"a KV cache budget of {kv_budget_bytes} bytes holds no sequence of "
                    f"{self.context_tokens} tokens ({per_sequence} bytes each); raise it"
                )
        self._cohorts: list[_Cohort] = []
        self._started: _Cohort | None = None
        """The cohort the last ``prefill`` started, which the next ``decode`` skips."""
        self._waiting: deque[RunningSequence] = deque()
        self._known: dict[Hashable, RunningSequence] = {}

    @property
    def slots(self) -> int:
        """Sequences that may decode at once."""
        return self._slots

    @property
    def running(self) -> int:
        return sum(len(cohort.sequences) for cohort in self._cohorts)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def cohorts(self) -> int:
        return len(self._cohorts)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request to start at a coming step, in priority order; refused at once as
        ``ContinuousBatch.submit`` refuses."""
        if request.request_id in self._known:
            raise ValueError(f"request {request.request_id!r} is already generating")
        max_new_tokens = self.check(request)
        room = self._slots - self.running
        if len(self._waiting) >= room + self.max_waiting_sequences:
            raise QueueFullError(
                f"{self.running} sequences generate, the most at once, and "
                f"{len(self._waiting)} wait, the most allowed "
                f"(max_waiting_sequences={self.max_waiting_sequences}); retry later"
            )
        stop_ids = frozenset(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self._eos_ids
        generator = new_generator(request.sampling, self._device)
        sequence = RunningSequence(
            request, max_new_tokens, stop_ids, generator, context_ids=(self._start_token_id,)
        )
        line = [waiting.request.priority for waiting in self._waiting]
        self._waiting.insert(waiting_position(line, request.priority), sequence)
        self._known[request.request_id] = sequence

    def check(self, request: GenerationRequest) -> int:
        """The new tokens ``request`` may generate, or its refusal whatever else runs (422),
        as ``ContinuousBatch.check``. Reads only what never changes, so any thread may ask."""
        prompt = len(request.prompt_ids)
        if not 1 <= prompt <= self.context_tokens:
            raise InvalidInputError(
                f"the prompt must hold 1 to {self.context_tokens} tokens, got {prompt}"
            )
        bad = [token for token in request.prompt_ids if not 0 <= token < self._vocab_size]
        if bad:
            raise InvalidInputError(
                f"prompt token ids must be in [0, {self._vocab_size}), got {bad[:5]}"
            )
        # The decoder holds its start token and the generated ones.
        return new_tokens_allowed(1, request.max_tokens, self.context_tokens, self.context_tokens)

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a request, waiting or running; False when it is not here."""
        sequence = self._known.pop(request_id, None)
        if sequence is None:
            return False
        if sequence in self._waiting:
            self._waiting.remove(sequence)
            return True
        for cohort in self._cohorts:
            if sequence in cohort.sequences:
                cohort.keep([other for other in cohort.sequences if other is not sequence])
        self._cohorts = [cohort for cohort in self._cohorts if cohort.sequences]
        return True

    @property
    def prefill_due(self) -> bool:
        """Requests wait and a cohort may start: ``prefill`` has work."""
        room = self._slots - self.running
        return bool(self._waiting) and room > 0 and len(self._cohorts) < self.max_cohorts

    def step(self) -> list[TokenEvent]:
        """One token for every running sequence: ``prefill`` then ``decode``."""
        return self.prefill() + self.decode()

    def prefill(self) -> list[TokenEvent]:
        """The first half of an iteration: the waiting requests that fit start as a new
        cohort, their prompts encoded together, and get their first tokens (as
        ``ContinuousBatch.prefill``, so a driver may hand them out before ``decode``)."""
        if not self.prefill_due:
            return []
        with torch.inference_mode():
            cohort = self._start_cohort()
            events = self._decode(cohort)
        self._started = cohort
        self._cohorts = [cohort for cohort in self._cohorts if cohort.sequences]
        return events

    def decode(self) -> list[TokenEvent]:
        """The second half: a token for every sequence of the other cohorts (the one
        ``prefill`` started has its token of this iteration)."""
        started, self._started = self._started, None
        events: list[TokenEvent] = []
        with torch.inference_mode():
            for cohort in self._cohorts:
                if cohort is not started:
                    events += self._decode(cohort)
        self._cohorts = [cohort for cohort in self._cohorts if cohort.sequences]
        return events

    def _bytes_per_token(self) -> int:
        """What one token of a sequence holds at most, measured on a prompt of one token
        decoded one step: its keys and values in every decoder layer's self-attention cache,
        and as a prompt token its encoder state and keys and values of cross-attention."""
        ids = torch.tensor([[self._start_token_id]], device=self._device)
        mask = torch.ones_like(ids)
        with torch.inference_mode(), self._precision():
            encoded = self._model.get_encoder()(input_ids=ids, attention_mask=mask)
            cohort = _Cohort([], encoded.last_hidden_state, mask, self._start_token_id)
            self._model(
                encoder_outputs=encoded,
                attention_mask=mask,
                decoder_input_ids=ids,
                cache=cohort.cache,
                use_cache=True,
            )
        caches = (cohort.cache.self_attention_cache, cohort.cache.cross_attention_cache)
        layers: list[Any] = [layer for cache in caches for layer in cache.layers]
        held: list[torch.Tensor] = [cohort.encoded]
        held += [tensor for layer in layers for tensor in (layer.keys, layer.values)]
        return sum(tensor.nelement() * tensor.element_size() for tensor in held)

    def _start_cohort(self) -> _Cohort:
        room = self._slots - self.running
        joining = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        longest = max(len(sequence.request.prompt_ids) for sequence in joining)
        ids = torch.zeros((len(joining), longest), dtype=torch.long)
        mask = torch.zeros((len(joining), longest), dtype=torch.long)
        for row, sequence in enumerate(joining):
            prompt = sequence.request.prompt_ids
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        with self._precision():
            encoded = self._model.get_encoder()(input_ids=ids, attention_mask=mask)
        hidden: torch.Tensor = encoded.last_hidden_state
        cohort = _Cohort(joining, hidden, mask, self._start_token_id)
        self._cohorts.append(cohort)
        return cohort

    def _decode(self, cohort: _Cohort) -> list[TokenEvent]:
        tokens = torch.tensor(cohort.next_inputs(), device=self._device).unsqueeze(1)
        with self._precision():
            output = self._model(
                encoder_outputs=BaseModelOutput(last_hidden_state=cohort.encoded),
                attention_mask=cohort.mask,
                decoder_input_ids=tokens,
                cache=cohort.cache,
                use_cache=True,
            )
        sequences = cohort.sequences
        events = accept_next(sequences, self._forced(sequences, output.logits[:, -1, :]))
        kept = []
        for sequence, event in zip(sequences, events, strict=True):
            if event.finish_reason is None:
                kept.append(sequence)
            else:
                del self._known[sequence.request.request_id]
        cohort.keep(kept)
        return events

    def _forced(self, sequences: list[RunningSequence], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the forced tokens' rows made certain, as ``generate``'s processors
        make them (the first token's, then the last's, which wins when both are the same
        token): theirs zero, every other token's far below. Far below rather than minus
        infinity, which ``accept_next`` would take for a failed row; a row already not finite
        is left to fail."""
        first = [row for row, sequence in enumerate(sequences) if not sequence.generated]
        last = [
            row
            for row, sequence in enumerate(sequences)
            if len(sequence.generated) == sequence.max_new_tokens - 1
        ]
        forcing = [
            (ids, rows)
            for ids, rows in ((self._forced_bos, first), (self._forced_eos, last))
            if ids and rows
        ]
        if not forcing:
            return logits
        logits = logits.float().clone()
        finite: list[bool] = torch.isfinite(logits.sum(dim=-1)).tolist()
        for ids, rows in forcing:
            index = torch.tensor([row for row in rows if finite[row]], device=logits.device)
            logits[index] = _NEVER
            logits[index.unsqueeze(1), torch.tensor([ids], device=logits.device)] = 0.0
        return logits
