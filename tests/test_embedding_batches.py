"""Many texts a request beside many one-text requests, on a sentence-transformers embedding
model: batches within the token budget, every caller answered its own rows in order (each
equal to ``SentenceTransformer.encode`` on the text alone), and the padding counted and kept
low (the request's rows sorted by length into its buckets, not padded to its longest)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.config import Settings
from service.server.cli import main
from service.server.single import create_app
from tests.apps import engine_of, registry_of, runner_of
from tests.fixtures import lifespan, sample_total
from tests.hf_folders import CORPUS, save_sentence_transformer, save_text_model

pytest.importorskip("sentence_transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MAX_BATCH_TOKENS = 512
BIG_REQUEST = 256
SMALL_REQUESTS = 64


def texts(count: int, seed: int) -> list[str]:
    """``count`` texts of 1 to 50 words of the corpus (3 to about 60 tokens)."""
    rng = np.random.default_rng(seed)
    words = " ".join(CORPUS).split()
    return [" ".join(rng.choice(words, size=rng.integers(1, 51))) for _ in range(count)]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedding")
    bert = save_text_model(root / "bert", "feature-extraction")
    folder = save_sentence_transformer(root / "st", bert, then=("normalize",))
    assert main(["package", "--repository", str(root / "repository"), "--name", "st", "--hf",
                 str(folder)]) == 0  # fmt: skip
    return root


async def test_a_request_of_256_texts_beside_64_one_text_requests(repository: Path) -> None:
    """Each batch holds at most ``max_batch_tokens`` padded positions; the 256 texts (sent to
    ``/v1/embeddings``) come back in order and each one-text request (``/embed`` or
    ``/predict``) gets its own text's embedding; every row equals
    ``encode`` on that text alone (1e-5). The padding is counted per batch, and is at most a
    third of the positions (46 % when the 256 texts were padded to their longest)."""
    from sentence_transformers import SentenceTransformer

    many = texts(BIG_REQUEST, seed=1)
    singles = texts(SMALL_REQUESTS, seed=2)
    model = SentenceTransformer(str(repository / "st"), device="cpu")
    app = create_app(
        Settings(
            model_repository=repository / "repository",
            model_name="st",
            device="cpu",
            max_wait_ms=20.0,
            max_batch_tokens=MAX_BATCH_TOKENS,
            warmup_batch_sizes=(1,),
            request_timeout_ms=120_000.0,  # the machine may be shared
        )
    )
    batches: list[tuple[int, int]] = []
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        runner = runner_of(app)
        counted = runner.count_positions
        assert counted is not None

        def record(real: int, padded: int) -> None:
            batches.append((real, padded))
            counted(real, padded)

        runner.count_positions = record
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            # The large request over OpenAI's route, the small ones over TEI's and /predict.
            big = client.post("/v1/embeddings", json={"model": "st", "input": many}, timeout=120)
            small = [
                client.post("/embed", json={"inputs": text})
                if index % 2
                else client.post("/predict", json={"instances": [text]})
                for index, text in enumerate(singles)
            ]
            responses = await asyncio.gather(big, *small)
        registry = registry_of(app)
        real = sample_total(registry, "batchserve_batch_tokens_total", {"kind": "real"})
        padding = sample_total(registry, "batchserve_batch_tokens_total", {"kind": "padding"})
        ratios = sample_total(registry, "batchserve_batch_padding_ratio_count")
    assert all(response.status_code == 200 for response in responses), responses[0].text
    want = model.encode(many + singles)
    got = [item["embedding"] for item in responses[0].json()["data"]]
    got += [
        response.json()[0] if index % 2 else response.json()["predictions"][0]
        for index, response in enumerate(responses[1:])
    ]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(padded <= MAX_BATCH_TOKENS for _, padded in batches), batches
    tokens = sum(len(encoding) for encoding in model.tokenizer(many + singles)["input_ids"])
    assert real == sum(real for real, _ in batches) == tokens
    assert padding == sum(padded - real for real, padded in batches)
    assert ratios == len(batches)
    print(f"{len(batches)} batches, padding {padding / (real + padding):.1%} of positions")
    assert padding / (real + padding) < 1 / 3
