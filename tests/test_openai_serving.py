"""OpenAI's API over a real generative model served in one process: a tiny GPT-2 packaged
with ``batchserve package --hf`` (random weights, a tokenizer trained in the test, a chat
template), called with the ``openai`` SDK and plain HTTP. Greedy answers equal
``generate(do_sample=False)`` on each prompt alone, whole or streamed, at 16 concurrent
requests of mixed lengths; sampling with a seed repeats; a stop string cuts the text; a
client that leaves mid-stream frees its sequence."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from service.server.cli import main
from tests import generative_models
from tests.generation_streams import served
from tests.generative_models import CHATML_TEMPLATE, CONTEXT, TEXTS, byte_level_bpe

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

#: 16 prompts of mixed lengths, and as many max_tokens.
PROMPTS = [(" ".join(TEXTS) * 3)[: 4 + 23 * index] for index in range(16)]
MAX_TOKENS = [1, 3, 8, 17, 32, 5, 12, 2, 40, 9, 21, 6, 30, 4, 15, 11]
#: A step takes milliseconds; a loaded machine may pause the engine far longer.
FREED_WITHIN_S = 10.0
POLL_S = 0.05


def save_chat_model(folder: Path) -> Path:
    """The tiny GPT-2 of ``generative_models`` with a tokenizer that has a chat template."""
    from transformers import PreTrainedTokenizerFast

    generative_models.gpt2().save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(),
        eos_token="<|endoftext|>",
        model_max_length=CONTEXT,
        chat_template=CHATML_TEMPLATE,
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("openai")
    folder = save_chat_model(root / "folder")
    command = ["package", "--repository", str(root / "repo"), "--name", "lm", "--hf", str(folder)]
    assert main(command) == 0
    return root / "repo"


def reference_model() -> Any:
    """The same model in this process, and its tokenizer: what every answer is checked with."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe())
    return generative_models.gpt2(), tokenizer


@pytest.fixture(scope="module")
def reference() -> Any:
    return reference_model()


def greedy_text(reference: Any, prompt: str, max_tokens: int) -> str:
    """``generate(do_sample=False)`` on ``prompt`` alone, decoded."""
    model, tokenizer = reference
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=generative_models.EOS,
        )
    text: str = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    return text


async def streamed_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    pieces = []
    async for chunk in await client.completions.create(
        model="lm", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        pieces.extend(choice.text for choice in chunk.choices)
    return "".join(pieces)


async def whole_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    answer = await client.completions.create(
        model="lm", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return answer.choices[0].text


async def test_the_openai_sdk_gets_greedy_parity_and_every_feature_in_one_process(
    repository: Path, reference: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service.frontend.generation.serving")
    expected = [greedy_text(reference, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    async with (
        served(repository, ("lm",), kv_cache_mb=64) as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        for way in (whole_text, streamed_text):
            answers = await asyncio.gather(
                *(way(client, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True))
            )
            for index, (got, wanted) in enumerate(zip(answers, expected, strict=True)):
                assert got == wanted, (way.__name__, index, PROMPTS[index], MAX_TOKENS[index])

        # Sampling with a seed repeats; n choices each get their own seed.
        sampled = [
            await client.completions.create(
                model="lm", prompt=PROMPTS[5], max_tokens=12, temperature=1.0, seed=3, n=2
            )
            for _ in range(2)
        ]
        texts = [[choice.text for choice in answer.choices] for answer in sampled]
        assert texts[0] == texts[1]

        # A stop string: the greedy text cut before its first occurrence.
        full = expected[8]
        assert len(full) >= 4, full  # 40 tokens of a model that never ends early
        cut_at = full[len(full) // 2 : len(full) // 2 + 2]
        stopped = await client.completions.create(
            model="lm", prompt=PROMPTS[8], max_tokens=40, temperature=0, stop=[cut_at]
        )
        assert stopped.choices[0].text == full[: full.index(cut_at)]
        assert stopped.choices[0].finish_reason == "stop"

        # Logprobs: one per token, the top k beside each.
        scored = await client.completions.create(
            model="lm", prompt=PROMPTS[3], max_tokens=4, temperature=0, logprobs=3
        )
        logprobs = scored.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == scored.usage.completion_tokens  # type: ignore[union-attr]
        assert all(value <= 0.0 for value in logprobs.token_logprobs)
        assert logprobs.top_logprobs is not None
        assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)

        # Chat, whole and streamed: the template's prompt, greedy.
        messages: Any = [{"role": "user", "content": "Where is Zürich?"}]
        chat = await client.chat.completions.create(
            model="lm", messages=messages, max_completion_tokens=10, temperature=0
        )
        prompt_text = reference[1].apply_chat_template(
            messages, chat_template=CHATML_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        assert chat.choices[0].message.content == greedy_text(reference, prompt_text, 10)
        deltas = []
        async for chunk in await client.chat.completions.create(
            model="lm", messages=messages, max_completion_tokens=10, temperature=0, stream=True
        ):
            deltas.extend(choice.delta.content or "" for choice in chunk.choices)
        assert "".join(deltas) == chat.choices[0].message.content

        # Bad input: OpenAI's error shape with its status.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="lm", prompt="hi", max_tokens=CONTEXT * 2)
        assert refused.value.status_code == 400
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nothing", prompt="hi")

        # The generate extension, whole and streamed: the same greedy text.
        async with httpx.AsyncClient() as http:
            document = {"text_input": PROMPTS[9], "parameters": {"max_tokens": MAX_TOKENS[9],
                        "temperature": 0}}  # fmt: skip
            whole = await http.post(url + "/v2/models/lm/generate", json=document)
            assert whole.json()["text_output"] == expected[9]
            streamed = await http.post(url + "/v2/models/lm/generate_stream", json=document)
            events = [
                orjson.loads(line.removeprefix("data: "))
                for line in streamed.text.split("\n\n")
                if line
            ]
            assert "".join(event["text_output"] for event in events) == expected[9]

        await leave_mid_stream(url, caplog)
        await run_the_page_s_examples(url)


async def leave_mid_stream(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A client leaves a stream after its first event: its sequence stops long before the
    context is full (the engine would otherwise generate until it is), and the engine runs
    no sequence soon after."""
    body = orjson.dumps(
        {"model": "lm", "prompt": PROMPTS[2], "max_tokens": None, "stream": True,
         "ignore_eos": True, "temperature": 0}
    )  # fmt: skip
    headers = {"X-Request-ID": "leaving-client"}

    def finished() -> list[logging.LogRecord]:
        return [
            record
            for record in caplog.records
            if record.getMessage() == "generation_finished"
            and getattr(record, "request_id", None) == "leaving-client"
        ]

    async with httpx.AsyncClient() as client:

        async def running() -> float:
            text = (await client.get(url + "/metrics")).text
            return sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "batchserve_running_sequences"
            )

        url_path = url + "/v1/completions"
        async with client.stream("POST", url_path, content=body, headers=headers) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(int(FREED_WITHIN_S / POLL_S)):
            if finished() and await running() == 0:
                break
            await asyncio.sleep(POLL_S)
        else:
            raise AssertionError(f"the sequence still ran {FREED_WITHIN_S} s after its client left")
    [record] = finished()
    assert record.completion_tokens < (CONTEXT - record.prompt_tokens) // 2  # type: ignore[attr-defined]


PAGE = Path(__file__).parent.parent / "docs" / "generation.md"
MARKER = "<!-- run by tests/test_openai_serving.py -->"


async def run_the_page_s_examples(url: str) -> None:
    """docs/generation.md's marked Python blocks run as written, against this server (its
    address for ``localhost:8000``, this model for ``mylm``), in a thread: they block."""
    blocks = PAGE.read_text().split(MARKER)[1:]
    assert len(blocks) == 2
    for block in blocks:
        code = block.split("```python\n", 1)[1].split("```", 1)[0]
        code = code.replace("http://localhost:8000", url).replace('"mylm"', '"lm"')
        printed: list[str] = []

        def run(code: str = code, printed: list[str] = printed) -> None:
            exec(code, {"print": lambda *words, **_: printed.append(" ".join(map(str, words)))})

        await asyncio.to_thread(run)
        assert printed, code
