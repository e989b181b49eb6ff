"""OpenAI's API through ``batchserve serve --workers 2``: two front ends (gunicorn workers, no
torch) tokenizing and detokenizing, one engine process generating, tokens coalesced over the
bridge. The synchronous ``openai`` SDK, 16 concurrent completions of mixed prompt lengths and
``max_tokens``, whole and streamed: each equals ``generate(do_sample=False)`` on its prompt
alone; a client that leaves mid-stream stops its sequence."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.server.cli import main
from tests.generative_models import CONTEXT
from tests.processes import Running, logged, serve_with_engines, wait_for, wait_until_serving
from tests.test_openai_serving import (
    MAX_TOKENS,
    PROMPTS,
    greedy_text,
    reference_model,
    save_chat_model,
)

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WORKERS = 2


def completion(client: openai.OpenAI, prompt: str, max_tokens: int, stream: bool) -> str:
    if not stream:
        answer = client.completions.create(
            model="lm", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return answer.choices[0].text
    chunks = client.completions.create(
        model="lm", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(choice.text for chunk in chunks for choice in chunk.choices)


def test_two_front_ends_and_an_engine_answer_as_the_model_alone(tmp_path: Path) -> None:
    folder = save_chat_model(tmp_path / "folder")
    repository = tmp_path / "repo"
    command = ["package", "--repository", str(repository), "--name", "lm", "--hf", str(folder)]
    assert main(command) == 0
    with serve_with_engines(
        tmp_path,
        WORKERS,
        BATCHSERVE_MODEL_REPOSITORY=str(repository),
        BATCHSERVE_MODELS="lm",
        BATCHSERVE_KV_CACHE_MB="64",
        BATCHSERVE_SPARE_ENGINE="false",
    ) as server:
        # Computed while the server starts.
        reference = reference_model()
        expected = [greedy_text(reference, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
        wait_until_serving(server, WORKERS)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with client, ThreadPoolExecutor(len(PROMPTS)) as pool:
            for stream in (False, True):
                answers = list(
                    pool.map(
                        lambda p, m, s=stream: completion(client, p, m, s), PROMPTS, MAX_TOKENS
                    )
                )
                for index, (got, wanted) in enumerate(zip(answers, expected, strict=True)):
                    assert got == wanted, (stream, index, PROMPTS[index], MAX_TOKENS[index])

        # A client that leaves after the first event: its sequence stops long before the
        # context is full (the engine would otherwise generate until it is).
        body = {"model": "lm", "prompt": PROMPTS[2], "max_tokens": None, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        headers = {"X-Request-ID": "leaving-client"}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=headers
        ) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    break
        wait_for(
            lambda: any(record["request_id"] == "leaving-client" for record in finished(server)),
            "the leaving client's stream ended",
            server,
            timeout_s=10.0,
        )
        [record] = [r for r in finished(server) if r["request_id"] == "leaving-client"]
        assert record["completion_tokens"] < (CONTEXT - record["prompt_tokens"]) // 2, record


def finished(server: Running) -> list[dict[str, Any]]:
    return logged(server, "generation_finished")
