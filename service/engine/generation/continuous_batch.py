"""Continuous (iteration-level) batching of a causal LM: sequences join and leave between
steps, and each step gives every running sequence its next token.

A device thread runs each iteration in two halves, each one forward: ``prefill``, over the
prompt chunks the admission policy chose (``admission.py``), where a sequence whose prompt is
then whole gets its first token; then ``decode``, over every sequence whose prompt is cached
(one token each), those just prefilled included. Prefill goes first so that a new request's
first token is handed out before the running sequences' decode, not after it. Rows of
different lengths share a forward through the slot cache (``kv_cache.py``) and explicit
positions and masks (``forward_inputs.py``), so each sequence's tokens are those it would get
alone.

Nothing here is thread-safe: ``submit``, ``cancel`` and ``step`` are called from the one
thread that owns the model (a cancelled sequence's slot is free for the next step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Ordered
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from service.config import Precision
from service.engine.generation.admission import (
    StepLimits,
    new_tokens_allowed,
    plan_prefill,
    waiting_position,
)
from service.engine.generation.forward_inputs import Row, forward_inputs
from service.engine.generation.kv_cache import SlotKVCache, probe_kv_layout, slots_for_budget
from service.engine.generation.model_limits import context_tokens
from service.engine.generation.sampling import new_generator
from service.engine.generation.sequences import (
    GenerationRequest,
    RunningSequence,
    TokenEvent,
    accept_next,
)
from service.errors import InvalidInputError, QueueFullError

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ContinuousBatch:
    """The running batch of one causal LM on its device, and the sequences waiting to join.

    ``kv_budget_bytes``: device memory for the KV cache, allocated at once; it holds as many
    slots of ``tokens_per_slot`` tokens (default and at most: the model's context) as fit,
    and no more than ``limits.max_running_sequences``. ``max_waiting_sequences``: how many
    may wait for a slot when every slot is taken (0: refuse with 429 as soon as the cache is
    full). ``eos_token_ids``: what ends a sequence (``model_limits.eos_token_ids``).
    ``precision``: ``bf16`` and ``fp16`` hold the model's weights in that dtype, cast once
    here (``hold_in_precision``).
    """

    def __init__(
        self,
        model: Any,
        *,
        kv_budget_bytes: int,
        limits: StepLimits,
        max_waiting_sequences: int,
        eos_token_ids: Iterable[int] = (),
        tokens_per_slot: int | None = None,
        precision: Precision = "fp32",
    ) -> None:
        # A boolean 4-D mask is what scaled_dot_product_attention takes as given.
        model.set_attn_implementation("sdpa")
        hold_in_precision(model, precision)
        self._model = model
        self._device: torch.device = next(model.parameters()).device
        self.limits = limits
        self.max_waiting_sequences = max_waiting_sequences
        self._eos_ids = frozenset(eos_token_ids)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.context_tokens = context_tokens(model.config)
        slot_tokens = min(tokens_per_slot or self.context_tokens, self.context_tokens)
        layout = probe_kv_layout(model)
        slots = min(
            slots_for_budget(layout, kv_budget_bytes, slot_tokens), limits.max_running_sequences
        )
        if slots < 1:
            needed = layout.bytes_per_token * slot_tokens
            raise ValueError(
                f"a KV cache budget of {kv_budget_bytes} bytes holds no sequence of "
                f"{slot_tokens} tokens ({needed} bytes each); raise it or lower tokens_per_slot"
            )
        self._cache = SlotKVCache(layout, slots, slot_tokens)
        self._slots: list[RunningSequence | None] = [None] * slots
        self._decoding = 0
        """Sequences decoding: they hold slots 0..n-1."""
        self._prefilling: list[RunningSequence] = []
        """Sequences joined whose prompt is not all cached yet, in the order they joined."""
        self._waiting: deque[RunningSequence] = deque()
        self._known: dict[Hashable, RunningSequence] = {}

    @property
    def tokens_per_slot(self) -> int:
        return self._cache.tokens_per_slot

    @property
    def kv_cache_bytes(self) -> int:
        return self._cache.bytes

    @property
    def slots(self) -> int:
        return self._cache.slots

    @property
    def running(self) -> int:
        return self._decoding + len(self._prefilling)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        return self.slots - self.running

    def check(self, request: GenerationRequest) -> int:
        """The new tokens ``request`` may generate, or its refusal whatever else runs (422):
        ids outside the vocabulary, or a prompt and ``max_tokens`` that never fit. Reads only
        what never changes, so any thread may ask."""
        bad = [token for token in request.prompt_ids if not 0 <= token < self._vocab_size]
        if bad:
            raise InvalidInputError(
                f"prompt token ids must be in [0, {self._vocab_size}), got {bad[:5]}"
            )
        return new_tokens_allowed(
            len(request.prompt_ids), request.max_tokens, self.context_tokens, self.tokens_per_slot
        )

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request to join at a coming step, behind the waiting requests of its
        priority and higher ones (``admission.waiting_position``). Refused at once: a request
        that can never fit (422), or one that would wait beyond ``max_waiting_sequences`` for
        a slot (429 with Retry-After)."""
        if request.request_id in self._known:
            raise ValueError(f"request {request.request_id!r} is already generating")
        max_new_tokens = self.check(request)
        if len(self._waiting) >= self.free_slots + self.max_waiting_sequences:
            raise QueueFullError(
                f"the KV cache's {self.slots} slots are taken ({self.running} sequences "
                f"generate) and {len(self._waiting)} wait, the most allowed "
                f"(max_waiting_sequences={self.max_waiting_sequences}); retry later"
            )
        stop_ids = frozenset(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self._eos_ids
        generator = new_generator(request.sampling, self._device)
        sequence = RunningSequence(request, max_new_tokens, stop_ids, generator)
        line = [waiting.request.priority for waiting in self._waiting]
        self._waiting.insert(waiting_position(line, request.priority), sequence)
        self._known[request.request_id] = sequence

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a request, waiting or running; its slot is free at once. False when it is
        not here (finished, or never submitted)."""
        sequence = self._known.get(request_id)
        if sequence is None:
            return False
        if sequence.slot < 0:
            self._waiting.remove(sequence)
            del self._known[request_id]
        else:
            self._release(sequence)
        return True

    @property
    def prefill_due(self) -> bool:
        """A prompt is waiting or partly cached: ``prefill`` has work."""
        return bool(self._waiting or self._prefilling)

    def step(self) -> list[TokenEvent]:
        """One iteration: ``prefill`` then ``decode``, the events of both. Should the decode
        forward raise, the prefill's events are lost with it: a driver that hands tokens out
        calls the two itself (``generation_loop``)."""
        return self.prefill() + self.decode()

    def prefill(self) -> list[TokenEvent]:
        """The first half of an iteration: the waiting sequences that fit join, the next
        prompt chunks are cached in one forward, and each sequence whose prompt is now whole
        gets its first token and decodes from the ``decode`` after this on. Run before the
        decode, so that a new request's first token waits for no decode step of the others:
        its time to first token beside running streams stays near its time alone. A forward
        that raises leaves the sequences as they were (those that joined stay joined)."""
        plan = plan_prefill(
            [sequence.prompt_left for sequence in self._prefilling],
            [len(sequence.request.prompt_ids) for sequence in self._waiting],
            self.running,
            self.free_slots,
            self.limits,
        )
        for _ in plan.joining:
            self._place(self._waiting.popleft())
        chunks = [
            (sequence, tokens)
            for sequence, tokens in zip(
                self._prefilling, plan.prefilling + plan.joining, strict=True
            )
            if tokens
        ]
        if not chunks:
            return []
        with torch.inference_mode():
            prefilled, logits = self._prefill(chunks)
            events = accept_next(prefilled, logits) if prefilled else []
        self._settle(prefilled, events)
        for sequence in prefilled:
            if sequence.slot >= 0:
                self._promote(sequence)
        return events

    def decode(self) -> list[TokenEvent]:
        """The second half of an iteration: a token for every sequence whose prompt is
        cached, in one forward. Finished sequences (their event has a ``finish_reason``) have
        left the batch when it returns; a forward that raises leaves them as they were."""
        decoding = [sequence for sequence in self._slots[: self._decoding] if sequence]
        if not decoding:
            return []
        rows = [
            Row(sequence.slot, sequence.cached_tokens, [sequence.generated[-1]])
            for sequence in decoding
        ]
        with torch.inference_mode():
            logits = self._forward(rows)
            events = accept_next(decoding, logits)
        self._settle(decoding, events)
        return events

    def _settle(self, sequences: list[RunningSequence], events: list[TokenEvent]) -> None:
        """Finished sequences leave the batch (a failed one's slot is zeroed)."""
        for sequence, event in zip(sequences, events, strict=True):
            if event.finish_reason is not None:
                self._release(sequence, clear=event.finish_reason == "error")

    def _prefill(
        self, chunks: list[tuple[RunningSequence, int]]
    ) -> tuple[list[RunningSequence], torch.Tensor]:
        """Cache the chosen prompt chunks; the sequences whose prompt is now whole, and
        their logits."""
        rows = []
        for sequence, tokens in chunks:
            start = sequence.prefilled
            rows.append(
                Row(sequence.slot, start, sequence.request.prompt_ids[start : start + tokens])
            )
        logits = self._forward(rows)
        for sequence, tokens in chunks:
            sequence.prefilled += tokens
        whole = [index for index, (sequence, _) in enumerate(chunks) if not sequence.prompt_left]
        return [chunks[index][0] for index in whole], logits[whole]

    def _forward(self, rows: Ordered[Row]) -> torch.Tensor:
        inputs = forward_inputs(rows, self._device)
        self._cache.plan = inputs.plan
        output = self._model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = output.logits[:, -1, :].float()
        return logits

    def _place(self, sequence: RunningSequence) -> None:
        """Give a joining sequence a free slot (all are at or after the decoding ones)."""
        slot = self._slots.index(None, self._decoding)
        self._slots[slot] = sequence
        sequence.slot = slot
        self._prefilling.append(sequence)

    def _promote(self, sequence: RunningSequence) -> None:
        """A sequence whose prompt is cached joins the decoding ones in slot ``n``."""
        self._prefilling.remove(sequence)
        target = self._decoding
        if sequence.slot != target:
            other = self._slots[target]
            other_tokens = other.cached_tokens if other else 0
            self._cache.swap(sequence.slot, target, sequence.cached_tokens, other_tokens)
            self._slots[sequence.slot] = other
            if other:
                other.slot = sequence.slot
            self._slots[target] = sequence
            sequence.slot = target
        self._decoding += 1

    def _release(self, sequence: RunningSequence, *, clear: bool = False) -> None:
        """Free a sequence's slot (zeroed when ``clear``: it held non-finite values); the
        last decoding sequence moves into a decoding hole."""
        slot = sequence.slot
        if clear:
            self._cache.clear(slot)
        if slot < self._decoding:
            last = self._decoding - 1
            mover = self._slots[last]
            if slot != last and mover is not None:
                self._cache.move(last, slot, mover.cached_tokens)
                self._slots[slot] = mover
                mover.slot = slot
            self._slots[last] = None
            self._decoding -= 1
        else:
            self._slots[slot] = None
            self._prefilling.remove(sequence)
        sequence.slot = -1
        del self._known[sequence.request.request_id]


def hold_in_precision(model: torch.nn.Module, precision: Precision) -> None:
    """Cast ``model``'s weights to ``precision``'s dtype (nothing for fp32), as ``transformers``
    and vLLM load a model in bf16 or fp16. Autocast would cast every weight again at every
    step, and a decode step's matrix products are small beside its weights: it would cost
    more than the step itself."""
    dtype = _DTYPES.get(precision)
    if dtype is not None:
        model.to(dtype)


def precision_context(
    precision: Precision, device: torch.device
) -> Callable[[], AbstractContextManager[object]]:
    """What a forward runs under: nothing for fp32, else autocast to the precision's dtype."""
    dtype = _DTYPES.get(precision)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
