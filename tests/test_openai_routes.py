"""The generation routes of a front end (OpenAI's and the generate extension's) over an engine
whose answers are known (``EchoingGenerator``: each prompt's ids again), through the app and
through a real uvicorn with the ``openai`` SDK: shapes, streams, stop strings, choices,
errors in each protocol's shape, and a client leaving mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from service import tracing
from service.bridge.interface import EngineStatus, ModelInfo
from service.config import Settings
from service.errors import NotReadyError, QueueFullError
from service.frontend.app import create_frontend_app
from service.frontend.generation.chat_template import render_chat
from service.frontend.state import FrontendState
from service.manifest import Manifest
from service.repository import ModelRepository
from tests.fixtures import EchoingGenerator, uvicorn_port, wait_until
from tests.generative_models import CHATML_TEMPLATE, byte_level_bpe, write_text_generation_version
from tests.test_requests import no_lifespan, tokens_model

TOKENIZER = byte_level_bpe()
PROMPT = "the quick brown fox"


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text).ids)


def echoed(prompt_ids: list[int], count: int) -> str:
    """What ``EchoingGenerator`` answers: the prompt's ids again, cycling, ``count`` of them."""
    return str(TOKENIZER.decode([prompt_ids[i % len(prompt_ids)] for i in range(count)]))


class Served:
    def __init__(self, tmp_path: Path, *, tokens_per_event: int = 1) -> None:
        self.manifest: Manifest = write_text_generation_version(tmp_path, tokenizer=TOKENIZER)
        self.model = ModelInfo(self.manifest, "cpu", "fp32", False, length_edges=())
        self.engine = EchoingGenerator(
            self.model, tokens_model(), tokens_per_event=tokens_per_event
        )
        self.frontend = FrontendState.over(
            self.engine,  # type: ignore[arg-type]
            Settings(request_timeout_ms=5000),
            repository=ModelRepository(tmp_path),
        )
        self.app: FastAPI = create_frontend_app(self.frontend, no_lifespan)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")


@pytest.fixture
def served(tmp_path: Path) -> Served:
    return Served(tmp_path)


async def post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    async with served.client() as client:
        return await client.post(path, content=orjson.dumps(body))


async def test_a_completion_is_the_generated_text_with_its_usage(served: Served) -> None:
    answer = await post(
        served, "/v1/completions", {"model": "writer", "prompt": PROMPT, "max_tokens": 7}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion"
    assert body["id"] == "cmpl-" + answer.headers["x-request-id"]
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": echoed(ids(PROMPT), 7),
        "logprobs": None,
        "finish_reason": "length",
    }
    prompt_tokens = len(ids(PROMPT))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 7,
        "total_tokens": prompt_tokens + 7,
    }
    assert answer.headers["x-model-version"] == f"writer@{served.manifest.version}"
    [request] = served.engine.requests
    assert request.prompt_ids == tuple(ids(PROMPT))
    assert (request.max_tokens, request.version) == (7, served.manifest.version)


async def test_texts_and_token_ids_are_prompts_each_with_n_choices(served: Served) -> None:
    answer = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": [ids(PROMPT), ids("lazy dog")], "n": 2, "seed": 5,
         "temperature": 0.7, "max_tokens": 3},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    texts = [echoed(ids(PROMPT), 3)] * 2 + [echoed(ids("lazy dog"), 3)] * 2
    assert [choice["text"] for choice in choices] == texts
    assert sorted(request.seed for request in served.engine.requests) == [5, 5, 6, 6]
    assert answer.json()["usage"]["prompt_tokens"] == len(ids(PROMPT)) + len(ids("lazy dog"))
    texts_answer = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": [PROMPT, "lazy dog"], "max_tokens": 3},
    )
    assert [choice["text"] for choice in texts_answer.json()["choices"]] == texts[::2]


async def test_a_stop_string_cuts_the_text_and_cancels_the_sequence(served: Served) -> None:
    answer = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": PROMPT, "max_tokens": 12, "stop": ["brown"]},
    )
    [choice] = answer.json()["choices"]
    assert choice["text"] == "the quick "
    assert choice["finish_reason"] == "stop"
    assert served.engine.cancelled == 1


async def test_a_stop_token_ends_the_choice_with_stop(served: Served) -> None:
    stop_id = ids(PROMPT)[2]
    answer = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": PROMPT, "max_tokens": 12, "stop_token_ids": [stop_id]},
    )
    [choice] = answer.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (echoed(ids(PROMPT), 3), "stop")


async def test_completion_logprobs_have_openai_s_legacy_shape(served: Served) -> None:
    answer = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": PROMPT, "max_tokens": 4, "logprobs": 2},
    )
    [choice] = answer.json()["choices"]
    assert choice["text"] == echoed(ids(PROMPT), 4)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"] == [-1.0] * 4
    assert logprobs["tokens"] == [TOKENIZER.decode([token]) for token in ids(PROMPT)[:4]]
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])  # the fake's k are one token
    assert logprobs["text_offset"][0] == 0
    assert served.engine.requests[0].logprobs == 2
    echoing = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": PROMPT, "max_tokens": 4, "echo": True},
    )
    assert echoing.json()["choices"][0]["text"] == PROMPT + echoed(ids(PROMPT), 4)
    both = await post(
        served,
        "/v1/completions",
        {"model": "writer", "prompt": PROMPT, "echo": True, "logprobs": 1},
    )
    assert both.status_code == 400
    assert error_of(both)["param"] == "echo"


async def test_a_chat_is_rendered_with_the_version_s_template(served: Served) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = await post(
        served,
        "/v1/chat/completions",
        {"model": "writer", "messages": messages, "max_completion_tokens": 5, "logprobs": True,
         "top_logprobs": 1},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    rendered = render_chat(CHATML_TEMPLATE, messages, {})
    prompt = TOKENIZER.encode(rendered, add_special_tokens=False).ids
    [request] = served.engine.requests
    assert list(request.prompt_ids) == prompt
    body = answer.json()
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": echoed(prompt, 5)}
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert body["usage"]["completion_tokens"] == 5


async def test_a_chat_without_a_template_is_sent_to_completions(tmp_path: Path) -> None:
    manifest = write_text_generation_version(tmp_path, chat_template=None)
    served = Served.__new__(Served)
    Served.__init__(served, tmp_path / "other")
    served.engine._status = EngineStatus(
        phase="ready", models=(ModelInfo(manifest, "cpu", "fp32", False, ()),)
    )
    served.frontend.repository = ModelRepository(tmp_path)
    answer = await post(
        served,
        "/v1/chat/completions",
        {"model": "writer", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 400
    assert "/v1/completions" in answer.json()["error"]["message"]


def error_of(answer: httpx.Response) -> dict[str, Any]:
    body = answer.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "writer", "prompt": PROMPT, "temperature": 3}, 400, "temperature"),
        ({"model": "writer", "prompt": PROMPT, "best_of_n": 1}, 400, "best_of_n"),
        ({"model": "writer", "prompt": []}, 400, "prompt"),
        ({"model": "writer", "prompt": [10**7]}, 400, "prompt"),
        ({"model": "writer", "prompt": PROMPT, "n": 17}, 400, "n"),
        ({"model": "nobody", "prompt": PROMPT}, 404, None),
        ({"model": "tokens", "prompt": PROMPT}, 404, None),
    ],
)
async def test_bad_requests_are_answered_in_openai_s_shape(
    served: Served, body: dict[str, Any], status: int, param: str | None
) -> None:
    answer = await post(served, "/v1/completions", body)
    assert answer.status_code == status, answer.text
    error = error_of(answer)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert served.engine.requests == []


async def test_a_body_that_is_not_json_is_a_400(served: Served) -> None:
    async with served.client() as client:
        answer = await client.post("/v1/chat/completions", content=b"{nope")
    assert answer.status_code == 400
    assert error_of(answer)["code"] == "invalid_input"


async def test_engine_refusals_keep_their_status_and_retry_after(served: Served) -> None:
    served.engine.refusal = QueueFullError("the KV cache is full", retry_after_s=2)
    answer = await post(served, "/v1/completions", {"model": "writer", "prompt": PROMPT})
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "2"
    assert error_of(answer) == {
        "message": "the KV cache is full",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    served.engine.refusal = NotReadyError("loading")
    answer = await post(served, "/v1/completions", {"model": "writer", "prompt": PROMPT})
    assert answer.status_code == 503
    assert error_of(answer)["type"] == "server_error"


async def test_no_engine_ready_is_a_503_in_openai_s_shape(served: Served) -> None:
    served.engine._status = EngineStatus(phase="loading")
    answer = await post(served, "/v1/chat/completions", {"model": "writer", "messages": []})
    assert answer.status_code == 400  # the body is checked before the model is looked up
    answer = await post(
        served,
        "/v1/chat/completions",
        {"model": "writer", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 503
    assert answer.headers["retry-after"]
    assert error_of(answer)["code"] == "not_ready"


async def test_models_lists_the_generative_models_served(served: Served) -> None:
    async with served.client() as client:
        answer = await client.get("/v1/models")
    assert answer.json() == {
        "object": "list",
        "data": [
            {
                "id": "writer",
                "object": "model",
                "created": int(served.manifest.created_at.timestamp()),
                "owned_by": "batchserve",
            }
        ],
    }


async def test_the_generate_extension_answers_text_output(served: Served) -> None:
    answer = await post(
        served,
        "/v2/models/writer/generate",
        {"text_input": PROMPT, "parameters": {"max_tokens": 4, "temperature": 0}},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "model_name": "writer",
        "model_version": served.manifest.version,
        "text_output": echoed(ids(PROMPT), 4),
        "finish_reason": "length",
    }
    assert served.engine.requests[0].temperature == 0.0
    refused = await post(served, "/v2/models/writer/generate", {"text_input": 3})
    assert refused.status_code == 400
    assert set(refused.json()) == {"error"}
    unknown = await post(served, "/v2/models/writer/versions/000000000000/generate", {})
    assert unknown.status_code == 404


def events_of(text: str) -> list[Any]:
    """The data of each server-sent event, ``[DONE]`` as the string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def test_generate_stream_sends_the_text_as_events(served: Served) -> None:
    async with served.client() as client:
        answer = await client.post(
            "/v2/models/writer/generate_stream",
            content=orjson.dumps({"text_input": PROMPT, "parameters": {"max_tokens": 5}}),
        )
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = events_of(answer.text)
    assert "".join(event["text_output"] for event in events) == echoed(ids(PROMPT), 5)
    assert [event["finish_reason"] for event in events] == [None] * 4 + ["length"]


async def test_a_streamed_completion_is_chunks_then_usage_then_done(tmp_path: Path) -> None:
    served = Served(tmp_path, tokens_per_event=2)
    async with served.client() as client:
        answer = await client.post(
            "/v1/completions",
            content=orjson.dumps(
                {"model": "writer", "prompt": PROMPT, "max_tokens": 5, "stream": True,
                 "stream_options": {"include_usage": True}}
            ),
        )  # fmt: skip
    events = events_of(answer.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert len(chunks) == 3  # 2 + 2 + 1 tokens: one chunk per coalesced event
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == echoed(ids(PROMPT), 5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


@pytest.fixture
async def server(served: Served) -> AsyncIterator[str]:
    config = uvicorn.Config(served.app, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    async with uvicorn_port(config) as port:
        yield f"http://127.0.0.1:{port}/v1"


async def test_the_openai_sdk_completes_and_chats_whole_and_streamed(
    served: Served, server: str
) -> None:
    async with openai.AsyncOpenAI(base_url=server, api_key="unused", max_retries=0) as client:
        completion = await client.completions.create(model="writer", prompt=PROMPT, max_tokens=6)
        assert completion.choices[0].text == echoed(ids(PROMPT), 6)
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 6
        pieces = []
        async for chunk in await client.completions.create(
            model="writer", prompt=PROMPT, max_tokens=6, stream=True
        ):
            pieces.append(chunk.choices[0].text)
        assert "".join(pieces) == echoed(ids(PROMPT), 6)

        messages: Any = [{"role": "user", "content": "Hi there"}]
        prompt = TOKENIZER.encode(
            render_chat(CHATML_TEMPLATE, messages, {}), add_special_tokens=False
        )
        chat = await client.chat.completions.create(model="writer", messages=messages, max_tokens=4)
        assert chat.choices[0].message.content == echoed(prompt.ids, 4)
        assert chat.choices[0].finish_reason == "length"
        deltas = []
        roles = []
        usage = None
        async for chunk in await client.chat.completions.create(
            model="writer",
            messages=messages,
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        ):
            for choice in chunk.choices:
                roles.append(choice.delta.role)
                deltas.append(choice.delta.content or "")
            usage = chunk.usage or usage
        assert "".join(deltas) == echoed(prompt.ids, 4)
        assert roles[0] == "assistant"
        assert usage is not None
        assert usage.completion_tokens == 4

        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nobody", prompt=PROMPT)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="writer", prompt=PROMPT, temperature=9)
        assert refused.value.param == "temperature"
        served.engine.refusal = QueueFullError("the KV cache is full")
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="writer", prompt=PROMPT)


async def test_a_client_that_leaves_mid_stream_cancels_its_sequence(
    served: Served, server: str
) -> None:
    gate = served.engine.gate = asyncio.Event()  # each sequence waits after its first event
    body = {"model": "writer", "prompt": PROMPT, "max_tokens": 50, "stream": True, "n": 2}
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", server + "/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                break  # one event came; leave with the stream open
        # An open stream is a request in flight, as one waiting for its answer.
        assert served.frontend.receiving == 1
        assert served.frontend.request_tally.in_flight == 1
    try:
        await wait_until(lambda: served.engine.cancelled == 2, timeout_s=10.0)
        assert served.engine.finished == 0
        await wait_until(lambda: served.frontend.receiving == 0, timeout_s=10.0)
        assert served.frontend.request_tally.in_flight == 0
    finally:
        gate.set()  # whatever failed, the server can stop


async def test_a_sequence_that_fails_is_a_500_whole_and_an_error_event_streamed(
    served: Served,
) -> None:
    served.engine.failing_after = 2
    body = {"model": "writer", "prompt": PROMPT, "max_tokens": 8}
    whole = await post(served, "/v1/completions", body)
    assert whole.status_code == 500
    assert error_of(whole)["code"] == "inference_failed"
    async with served.client() as client:
        streamed = await client.post(
            "/v1/completions", content=orjson.dumps({**body, "stream": True})
        )
    assert streamed.status_code == 200  # sent before the failure
    events = events_of(streamed.text)
    assert [event["choices"][0]["text"] for event in events[:2]] == [
        echoed(ids(PROMPT), 1),
        echoed(ids(PROMPT), 2)[len(echoed(ids(PROMPT), 1)) :],
    ]
    assert events[2]["error"]["code"] == "inference_failed"
    assert events[3] == "[DONE]"


async def test_a_traced_request_hands_its_span_to_the_engine_with_its_token_counts(
    served: Served,
) -> None:
    exporter = InMemorySpanExporter()
    tracing.start([SimpleSpanProcessor(exporter)], role="frontend")
    try:
        answer = await post(
            served, "/v1/completions", {"model": "writer", "prompt": PROMPT, "max_tokens": 3}
        )
    finally:
        tracing.stop()
    assert answer.status_code == 200
    [span] = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.SERVER]
    assert span.name == "POST /v1/completions"
    assert span.attributes is not None
    assert span.attributes["gen_ai.usage.input_tokens"] == len(ids(PROMPT))
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    [request] = served.engine.requests
    assert span.context is not None
    assert request.traceparent is not None
    assert request.traceparent.startswith(
        f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"
    )


async def test_a_client_that_leaves_before_the_first_token_cancels_its_sequences(
    served: Served, server: str
) -> None:
    gate = served.engine.first_gate = asyncio.Event()  # the sequences wait, as when queued
    body = {"model": "writer", "prompt": PROMPT, "n": 3, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.5)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server + "/completions", json=body)
        await wait_until(lambda: served.engine.cancelled == 3, timeout_s=10.0)
        await wait_until(lambda: served.frontend.receiving == 0, timeout_s=10.0)
    finally:
        gate.set()  # whatever failed, the server can stop


async def test_a_path_or_method_the_api_lacks_is_answered_in_openai_s_shape(
    served: Served,
) -> None:
    async with served.client() as client:
        wrong_method = await client.get("/v1/completions")
        no_route = await client.post("/v1/responses", content=b"{}")
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert error_of(wrong_method)["code"] == "method_not_allowed"
    assert no_route.status_code == 404
    assert error_of(no_route)["type"] == "invalid_request_error"


async def test_x_priority_reaches_the_engine_and_a_bad_one_is_a_400(served: Served) -> None:
    body = orjson.dumps({"model": "writer", "prompt": PROMPT, "max_tokens": 1})
    async with served.client() as client:
        high = await client.post("/v1/completions", content=body, headers={"X-Priority": "high"})
        bad = await client.post("/v1/completions", content=body, headers={"X-Priority": "now"})
    assert high.status_code == 200
    assert [request.priority for request in served.engine.requests] == ["high"]
    assert bad.status_code == 400
    assert "X-Priority" in error_of(bad)["message"]
