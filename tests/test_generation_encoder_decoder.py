"""Encoder-decoders (T5, BART) packaged with ``batchserve package --hf`` and served: each
greedy stream equals ``generate(do_sample=False)`` on its prompt alone, for concurrent
requests of mixed prompt lengths and ``max_tokens``, in process, over the bridge and over
``/v1/completions`` (streamed and whole); a folder without what its decoder needs is
refused naming it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service.bridge.interface import GenerateRequest
from service.config import Settings
from service.engine.generation.cohorts import CohortBatch
from service.engine.generation.sequences import TokenEvent
from service.engine.model_store import ModelStore
from service.server.cli import main
from service.server.draining import uvicorn_config
from service.server.single import create_app
from tests import generative_models
from tests.fixtures import uvicorn_port
from tests.generation_streams import collect, over_the_bridge, package, started
from tests.generative_models import TEXTS, VOCAB, byte_level_bpe, save_folder

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


def forcing_bart() -> Any:
    """The tiny BART, forcing its first and last tokens as BART's checkpoints do."""
    model = generative_models.bart()
    model.generation_config.forced_bos_token_id = 0
    model.generation_config.forced_eos_token_id = 2
    return model


MODELS = {"t5": generative_models.t5, "bart": forcing_bart}
PROMPT_LENGTHS = (1, 3, 9, 17, 30, 46, 64, 100)
MAX_TOKENS = (1, 4, 12, 20, 7, 30, 2, 16)
READY_TIMEOUT_S = 120.0
POLL_S = 0.05


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny T5 (``t5``) and BART (``bart``) of ``generative_models``, packaged."""
    root = tmp_path_factory.mktemp("encdec")
    for name, build in MODELS.items():
        package(save_folder(root / name, build()), root / "repo", name)
    return root / "repo"


@contextlib.asynccontextmanager
async def serving(repository: Path, model: str) -> AsyncIterator[httpx.AsyncClient]:
    """``model`` served by one process on a free port, once ready: a client of it."""
    settings = Settings(
        model_repository=repository,
        models=(model,),
        device="cpu",
        torch_threads=1,
        warmup_batch_sizes=(1,),
    )
    config = uvicorn_config(create_app(settings), settings)
    config.host, config.port = "127.0.0.1", 0
    async with uvicorn_port(config) as port, httpx.AsyncClient() as client:
        client.base_url = httpx.URL(f"http://127.0.0.1:{port}")
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while (await client.get("/readyz")).status_code != 200:  # loading, warming up
            assert time.monotonic() < deadline_s, f"not ready within {READY_TIMEOUT_S} s"
            await asyncio.sleep(POLL_S)
        yield client


def generated_alone(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens)
    tokens: list[int] = output[0, 1:].tolist()  # after the decoder's start token
    return tokens


def mixed_prompts(seed: int) -> list[tuple[list[int], int]]:
    chooser = random.Random(seed)
    return [
        ([chooser.randrange(3, VOCAB) for _ in range(length)], most)
        for length, most in zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True)
    ]


def test_packaging_keeps_the_decoders_start_end_and_context(repository: Path) -> None:
    store = ModelStore(repository)
    t5, bart = store.resolve("t5"), store.resolve("bart")
    for manifest in (t5, bart):
        assert manifest.metadata["task"] == "text2text-generation"
        assert {"tokenizer.json", "generation_config.json", "config.json"} <= set(manifest.files)
    assert t5.metadata["decoder_start_token_id"] == 0
    assert t5.metadata["eos_token_ids"] == [1]
    assert t5.metadata["context_tokens"] == generative_models.CONTEXT  # model_max_length
    assert bart.metadata["decoder_start_token_id"] == 2
    assert bart.metadata["context_tokens"] == 128  # max_position_embeddings
    assert bart.metadata["forced_bos_token_id"] == 0
    assert bart.metadata["forced_eos_token_ids"] == [2]
    assert "forced_bos_token_id" not in t5.metadata


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ("tokenizer_config.json", "names no context length"),
        ("generation_config.json", "names no decoder_start_token_id"),
    ],
)
def test_an_encoder_decoder_without_what_it_needs_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str, named: str
) -> None:
    folder = save_folder(tmp_path / "t5", generative_models.t5())
    path = folder / edit
    document = json.loads(path.read_text())
    if edit == "tokenizer_config.json":
        document.pop("model_max_length", None)
    else:
        document["decoder_start_token_id"] = None
        config = json.loads((folder / "config.json").read_text())
        config["decoder_start_token_id"] = None
        (folder / "config.json").write_text(json.dumps(config))
    path.write_text(json.dumps(document))
    capsys.readouterr()
    command = ["package", "--repository", str(tmp_path / "r"), "--name", "x", "--hf", str(folder)]
    assert main(command) == 1
    error = capsys.readouterr().err
    assert "T5ForConditionalGeneration" in error
    assert named in error


def test_generate_settings_not_served_are_named_when_packaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = forcing_bart()
    model.generation_config.num_beams = 4
    model.generation_config.no_repeat_ngram_size = 3
    folder = save_folder(tmp_path / "bart", model)
    capsys.readouterr()
    command = ["package", "--repository", str(tmp_path / "r"), "--name", "x", "--hf", str(folder)]
    assert main(command) == 0
    error = capsys.readouterr().err
    assert "generates without generation_config.json's num_beams=4, no_repeat_ngram_size=3" in error


async def test_concurrent_greedy_streams_equal_generate_alone_in_process_and_bridged(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    references = {name: build() for name, build in MODELS.items()}
    cohort_rows = []
    decode = CohortBatch._decode

    def counted_decode(batch: CohortBatch, cohort: Any) -> list[TokenEvent]:
        cohort_rows.append(len(cohort.sequences))
        return decode(batch, cohort)

    monkeypatch.setattr(CohortBatch, "_decode", counted_decode)
    settings: dict[str, Any] = {"models": tuple(MODELS), "max_running_sequences": 6}
    async with started(repository, **settings) as engine, over_the_bridge(engine) as bridged:
        jobs = []
        for seed, name in enumerate(MODELS):
            model = engine.status().find(name)
            assert model is not None
            for index, (prompt, most) in enumerate(mixed_prompts(seed)):
                request = GenerateRequest(
                    model=name,
                    version=model.manifest.version,
                    prompt_ids=tuple(prompt),
                    max_tokens=most,
                    temperature=0.0,
                )
                client = bridged if index % 2 else engine  # TOKENS frames, or in process
                jobs.append((name, prompt, most, collect(client, request)))
        streams = await asyncio.gather(*(job for *_, job in jobs))
    for (name, prompt, most, _), items in zip(jobs, streams, strict=True):
        tokens = [token for item in items for token in item.token_ids]
        assert tokens == generated_alone(references[name], prompt, most), (name, len(prompt))
        eos = references[name].generation_config.eos_token_id
        assert items[-1].finish_reason == ("stop" if tokens[-1] == eos else "length")
        assert all(item.finish_reason is None for item in items[:-1])
    assert max(cohort_rows) >= 4  # sequences decoded together, not one at a time


async def test_completions_streamed_and_whole_and_oip_generate_equal_generate_alone(
    repository: Path,
) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe())
    reference = generative_models.t5()
    prompts = [(" ".join(TEXTS) * 3)[: 3 + 29 * index] for index in range(8)]

    def expected(prompt: str, most: int) -> str:
        tokens = generated_alone(reference, tokenizer(prompt)["input_ids"], most)
        text: str = tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    async def whole(client: httpx.AsyncClient, prompt: str, most: int) -> str:
        body = {"model": "t5", "prompt": prompt, "max_tokens": most, "temperature": 0}
        answer = await client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        text: str = answer.json()["choices"][0]["text"]
        return text

    async def streamed(client: httpx.AsyncClient, prompt: str, most: int) -> str:
        body = {"model": "t5", "prompt": prompt, "max_tokens": most, "temperature": 0}
        pieces = []
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as sse:
            assert sse.status_code == 200
            async for line in sse.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [choice["text"] for choice in json.loads(line[6:])["choices"]]
        return "".join(pieces)

    async with serving(repository, "t5") as client:
        texts = await asyncio.gather(
            *(
                (streamed if index % 2 else whole)(client, prompt, most)
                for index, (prompt, most) in enumerate(zip(prompts, MAX_TOKENS, strict=True))
            )
        )
        oip = await client.post(
            "/v2/models/t5/generate",
            json={"text_input": prompts[3], "parameters": {"max_tokens": 9, "temperature": 0}},
        )
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "t5", "messages": [{"role": "user", "content": "hi"}]},
        )
    for prompt, most, text in zip(prompts, MAX_TOKENS, texts, strict=True):
        assert text == expected(prompt, most), (len(prompt), most)
    assert oip.status_code == 200, oip.text
    assert oip.json()["text_output"] == expected(prompts[3], 9)
    assert chat.status_code == 400, chat.text
    assert "chat template" in chat.json()["error"]["message"]
