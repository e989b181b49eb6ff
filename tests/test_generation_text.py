"""A front end's text side of generation, without a server: chat templates rendered as
``transformers`` renders them, a choice's text cut at stop strings, the sampling settings
checked and turned into engine requests, and server-sent events framed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from pydantic import ValidationError

from service.bridge.interface import GeneratedTokens
from service.errors import HandlerError, InferenceError, InvalidInputError, InvalidParameterError
from service.frontend.generation.chat_template import TemplateRenderError, render_chat
from service.frontend.generation.choices import ChoiceText
from service.frontend.generation.sampling import SamplingSettings
from service.frontend.generation.serving import (
    SHORT_PROMPT_CHARS,
    text_model_of,
    tokenized_nearby,
)
from service.frontend.generation.text_model import TextModel, load_text_model
from service.frontend.openai.errors import invalid_request, openai_error_response
from service.frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from service.frontend.sse import DONE, event
from service.repository import ModelRepository
from tests.generative_models import CHATML_TEMPLATE, byte_level_bpe, write_text_generation_version

#: Llama-2's template: a system message folded into the first user turn, roles checked with
#: raise_exception, the bos_token from the special tokens.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
#: Whitespace control (trim_blocks, lstrip_blocks), tojson and a {% generation %} block.
INDENTED_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'assistant' %}
        {% generation %}A: {{ message['content'] | tojson }}{% endgeneration %}
    {% else %}
        {{ message['role'] }}: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Où est Zürich? 🙂"},
    {"role": "assistant", "content": 'It is in "Switzerland".'},
    {"role": "user", "content": "And Paris?"},
]


def hf_render(template: str, messages: list[dict[str, str]]) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(), bos_token="<s>", eos_token="</s>"
    )
    rendered: str = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return rendered


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA2_TEMPLATE, INDENTED_TEMPLATE])
def test_a_chat_renders_as_transformers_renders_it(template: str) -> None:
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render_chat(template, CHAT, special) == hf_render(template, CHAT)


def test_a_chat_the_template_refuses_is_a_400_with_its_message() -> None:
    out_of_order = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateRenderError, match="roles must alternate") as refused:
        render_chat(LLAMA2_TEMPLATE, out_of_order, {"bos_token": "<s>", "eos_token": "</s>"})
    assert openai_error_response(refused.value).status_code == 400


def test_a_template_that_does_not_compile_is_the_model_s_fault() -> None:
    with pytest.raises(HandlerError, match="cannot be compiled"):
        render_chat("{% for %}", CHAT, {})


def test_the_template_cannot_reach_python_internals() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidInputError):
        render_chat(escape, CHAT, {})


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> TextModel:
    root: Path = tmp_path_factory.mktemp("repository")
    manifest = write_text_generation_version(root)
    return load_text_model(
        manifest, ModelRepository(root).version_folder("writer", manifest.version)
    )


def ids_of(text_model: TextModel, text: str) -> list[int]:
    return text_model.encode(text, add_special_tokens=False)


def streamed(
    text_model: TextModel, ids: list[int], stop: tuple[str, ...], reason: str = "length"
) -> tuple[list[str], ChoiceText, int]:
    """``ids`` one token an event, the last with ``reason``: the texts sent, the choice, and
    the events taken before it finished."""
    choice = ChoiceText(0, text_model, [], stop)
    sent = []
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        update = choice.take(GeneratedTokens((token,), finish_reason=reason if last else None))
        sent.append(update.text)
        if update.finish_reason is not None:
            return sent, choice, position + 1
    raise AssertionError("the choice never finished")


def test_text_stops_exactly_before_a_stop_string_split_over_tokens(text_model: TextModel) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = ids_of(text_model, text)
    sent, choice, taken = streamed(text_model, ids, ("brown fox",))
    assert "".join(sent) == "the quick "
    assert choice.finish_reason == "stop"
    assert taken < len(ids)  # ended at the stop string: the caller cancels the rest
    # Nothing a stop string could still claim was ever sent.
    assert all("brown"[:1] not in piece or piece == "" for piece in sent[-2:])


def test_without_a_stop_string_the_text_is_the_decode_of_every_token(
    text_model: TextModel,
) -> None:
    text = "emoji 🙂🚀 and ümlauts in Zürich"
    ids = ids_of(text_model, text)
    sent, choice, _ = streamed(text_model, ids, ("never there",), reason="length")
    assert "".join(sent) == text_model.decode(ids) == text
    assert choice.finish_reason == "length"
    assert choice.token_count == len(ids)


def test_an_end_of_sequence_finishes_with_stop_and_a_failed_sequence_raises(
    text_model: TextModel,
) -> None:
    choice = ChoiceText(0, text_model, [])
    assert choice.take(GeneratedTokens((5, 0), finish_reason="stop")).finish_reason == "stop"
    with pytest.raises(InferenceError):
        ChoiceText(0, text_model, []).take(GeneratedTokens((5,), finish_reason="error"))


def test_logprobs_come_per_token_taken_with_offsets(text_model: TextModel) -> None:
    ids = ids_of(text_model, "Paris is in France and Berlin")
    choice = ChoiceText(0, text_model, [], ("France",))
    update = choice.take(
        GeneratedTokens(
            tuple(ids),
            logprobs=tuple(-float(i) for i in range(len(ids))),
            top_logprobs=tuple(((token, -0.5),) for token in ids),
            finish_reason="length",
        )
    )
    assert update.text == "Paris is in "
    assert update.logprobs is not None
    assert len(update.logprobs) == update.token_count < len(ids)
    assert [entry.token_id for entry in update.logprobs] == ids[: update.token_count]
    assert update.logprobs[0].text_offset == 0
    offsets = [entry.text_offset for entry in update.logprobs]
    assert offsets == sorted(offsets)


def test_each_choice_samples_with_its_own_seed(text_model: TextModel) -> None:
    settings = SamplingSettings(n=3, seed=7, temperature=0.8, max_tokens=5, stop=("x",))
    requests = settings.engine_requests(
        text_model,
        (1, 2),
        priority="normal",
        deadline_s=10.0,
        request_id="r",
    )
    assert [request.seed for request in requests] == [7, 8, 9]
    assert {request.temperature for request in requests} == {0.8}
    assert [request.request_id for request in requests] == ["r-0", "r-1", "r-2"]
    assert all(request.max_tokens == 5 for request in requests)
    unseeded = SamplingSettings(n=2).engine_requests(
        text_model, (1,), priority="normal", deadline_s=1.0, request_id="r"
    )
    assert [request.seed for request in unseeded] == [None, None]
    assert (unseeded[0].max_tokens, unseeded[0].temperature) == (None, 1.0)


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        (SamplingSettings(temperature=2.5), "temperature"),
        (SamplingSettings(top_p=0.0), "top_p"),
        (SamplingSettings(max_tokens=0), "max_tokens"),
        (SamplingSettings(n=17), "n"),
        (SamplingSettings(seed=-1), "seed"),
        (SamplingSettings(logprobs=21), "logprobs"),
        (SamplingSettings(stop=("a",) * 17), "stop"),
        (SamplingSettings(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_a_setting_out_of_range_names_itself(
    text_model: TextModel, settings: SamplingSettings, param: str
) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        settings.engine_requests(
            text_model, (1,), priority="normal", deadline_s=1.0,
            request_id="r",
        )  # fmt: skip
    assert refused.value.param == param
    body = orjson.loads(openai_error_response(refused.value).body)
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"


def test_generation_config_sets_what_the_request_leaves_out(tmp_path: Path) -> None:
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 40}
    manifest = write_text_generation_version(tmp_path, generation_config=config)
    loaded = load_text_model(
        manifest, ModelRepository(tmp_path).version_folder("writer", manifest.version)
    )
    [request] = SamplingSettings().engine_requests(
        loaded, (1,), priority="normal", deadline_s=1.0, request_id="r"
    )
    assert (request.temperature, request.top_p, request.top_k, request.max_tokens) == (
        0.6, 0.9, 20, 40,
    )  # fmt: skip
    [chosen] = SamplingSettings(temperature=0.0, max_tokens=3).engine_requests(
        loaded, (1,), priority="normal", deadline_s=1.0, request_id="r"
    )
    assert (chosen.temperature, chosen.max_tokens) == (0.0, 3)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"model": "m", "prompt": "a", "best_of_n": 2}', "best_of_n", "unknown field"),
        (b'{"model": "m", "prompt": "a", "temperature": "hot"}', "temperature", "valid number"),
        (b'{"model": "m", "prompt": [1, "a"]}', "prompt", "prompt"),
        (b'{"prompt": "a"}', "model", "required"),
    ],
)
def test_a_body_off_the_schema_is_one_400_naming_its_first_problem(
    body: bytes, param: str, words: str
) -> None:
    with pytest.raises(ValidationError) as problems:
        CompletionRequest.model_validate_json(body)
    error = invalid_request(problems.value)
    assert error.param == param
    assert words in error.message
    assert openai_error_response(error).status_code == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 2, "max_completion_tokens": 3}, "max_tokens"),
    ],
)
def test_a_setting_batchserve_cannot_apply_is_refused(
    fields: dict[str, object], param: str
) -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )
    with pytest.raises(InvalidParameterError) as refused:
        request.check_unsupported()
    assert refused.value.param == param


def test_chat_messages_are_given_to_the_template_as_text() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert [message.for_template() for message in request.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
    ]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]}
        )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})


def test_an_event_is_one_data_line_of_json_and_a_blank_line() -> None:
    framed = event({"text": "two\nlines"})
    assert framed == b'data: {"text":"two\\nlines"}\n\n'
    assert framed.count(b"\n") == 2
    assert DONE == b"data: [DONE]\n\n"


def test_a_prompt_is_tokenized_whole_whatever_padding_or_truncation_was_saved(
    tmp_path: Path,
) -> None:
    saved = byte_level_bpe()
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64)
    manifest = write_text_generation_version(tmp_path, tokenizer=saved)
    folder = ModelRepository(tmp_path).version_folder("writer", manifest.version)
    text = "the quick brown fox jumps over the lazy dog"
    assert load_text_model(manifest, folder).encode(text) == byte_level_bpe().encode(text).ids


async def test_a_version_s_text_model_once_read_is_taken_without_a_handler_thread(
    text_model: TextModel,
) -> None:
    """The first request of a version reads its tokenizer on a handler thread; the next ones
    take it as it is, so a request beside busy streams waits for no thread hop."""
    reads: list[str] = []
    handler_pool = ThreadPoolExecutor(1)
    cache: dict[str, TextModel] = {}

    def text_model_for(model: Any) -> TextModel:
        reads.append(model.manifest.version)
        cache[model.manifest.version] = text_model
        return text_model

    frontend = SimpleNamespace(
        handler_pool=handler_pool,
        text_model_for=text_model_for,
        loaded_text_model=lambda model: cache.get(model.manifest.version),
    )
    model = SimpleNamespace(manifest=SimpleNamespace(version="v1"))
    try:
        assert await text_model_of(cast(Any, frontend), cast(Any, model)) is text_model
    finally:
        handler_pool.shutdown()
    # A shut pool refuses work: the second request never asks for a thread.
    assert await text_model_of(cast(Any, frontend), cast(Any, model)) is text_model
    assert reads == ["v1"]


def test_a_prompt_s_ids_are_the_tokenizer_s_with_and_without_special_tokens(
    text_model: TextModel,
) -> None:
    text = "The quick brown fox, é and 汉字 <|endoftext|> again"
    for special in (True, False):
        expected = text_model.tokenizer.encode(text, add_special_tokens=special).ids
        assert text_model.encode(text, add_special_tokens=special) == expected


def test_tokenizing_a_long_prompt_leaves_other_threads_running(text_model: TextModel) -> None:
    """A front end tokenizes on a handler thread so that the event loop goes on meanwhile:
    the tokenizer must let go of the GIL while it works (``Tokenizer.encode`` does not; a
    long prompt held every other thread for as long as it took)."""
    text = "the cat sat on the mat and looked at the dog " * 40_000
    ticks: list[float] = []
    done = threading.Event()

    def ticking() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=ticking)
    ticker.start()
    try:
        started_s = time.perf_counter()
        text_model.encode(text)
        took_s = time.perf_counter() - started_s
    finally:
        done.set()
        ticker.join()
    during = [tick for tick in ticks if started_s <= tick <= started_s + took_s]
    longest_gap_s = max(
        (
            later - earlier
            for earlier, later in zip(
                [started_s, *during], [*during, started_s + took_s], strict=True
            )
        ),
        default=took_s,
    )
    assert longest_gap_s < took_s / 2, (longest_gap_s, took_s)


async def test_a_short_prompt_is_tokenized_on_the_event_loop_and_a_long_one_on_a_thread() -> None:
    loop_thread = threading.get_ident()
    handler_pool = ThreadPoolExecutor(1)
    frontend = cast(Any, SimpleNamespace(handler_pool=handler_pool))
    try:
        short = await tokenized_nearby(frontend, SHORT_PROMPT_CHARS, threading.get_ident)
        long = await tokenized_nearby(frontend, SHORT_PROMPT_CHARS + 1, threading.get_ident)
    finally:
        handler_pool.shutdown()
    assert short == loop_thread
    assert long != loop_thread
