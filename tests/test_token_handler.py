"""``TokenClassificationHandler``: raw text in, each token's label with its characters out
(and ``"simple"`` entities), as HF's token-classification pipeline answers; never a special
token or padding. A WordPiece tokenizer is trained here on a few sentences, and a tagger is
given weights that label chosen tokens, so every answer is computed by hand."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from service.config import Settings
from service.engine.model_store import ModelStore
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.tokens import TokenClassificationHandler
from service.frontend.inputs import InputLayout
from service.manifest import Architecture, HandlerSpec, Manifest
from service.packaging.package import Packager
from service.packaging.spec import check_handler, tensor_spec
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.torch_models import MaskedTokenTagger

SENTENCES = [
    "Alice moved to New York",
    "Bob visited Paris last year",
    "New York and Paris are big cities",
    "Alice and Bob like the shire of York",
]
LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
#: The label each token gets; every other token is "O".
TAGGED = {
    "alice": "B-PER", "bob": "B-PER", "new": "B-LOC", "paris": "B-LOC",
    "york": "I-LOC", "##s": "I-LOC", "##h": "I-LOC", "##ire": "I-LOC",
}  # fmt: skip
HANDLER = "service.frontend.handlers.tokens:TokenClassificationHandler"


def train_tokenizer(path: Path) -> Tokenizer:
    """A BERT-style WordPiece (lower case, ``[CLS] text [SEP]``) trained on ``SENTENCES``."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[(name, tokenizer.token_to_id(name)) for name in ("[CLS]", "[SEP]")],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(path))
    return tokenizer


def logit_of(token_id: int) -> float:
    """The chosen label's logit for a token (the others are 0): scores differ by token."""
    return 2.0 + token_id % 3


def score_of(token_id: int) -> float:
    """The softmax of ``logit_of`` against four zeros, by hand."""
    return math.exp(logit_of(token_id)) / (math.exp(logit_of(token_id)) + 4)


def package_ner(folder: Path, **options: Any) -> tuple[Manifest, Tokenizer]:
    """A tagger labelling ``TAGGED`` tokens, with the token handler, as ``ner``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(folder / "tokenizer.json")
    vocabulary = tokenizer.get_vocab_size()
    model = MaskedTokenTagger(vocabulary, len(LABELS))
    weights = torch.zeros(vocabulary, len(LABELS))
    for token_id in range(vocabulary):
        label = TAGGED.get(tokenizer.id_to_token(token_id) or "", "O")
        weights[token_id, LABELS.index(label)] = logit_of(token_id)
    model.embedding.weight.data.copy_(weights)
    save_file(dict(model.state_dict()), str(folder / "ner.safetensors"))
    limits = f"max_length=32:min_value=1:max_value={vocabulary - 1}:pad_value=0"
    manifest = Packager(folder / "models").package(
        name="ner",
        artifact=folder / "ner.safetensors",
        format="safetensors",
        architecture=Architecture(
            import_path="tests.torch_models:MaskedTokenTagger",
            kwargs={"vocabulary": vocabulary, "classes": len(LABELS)},
        ),
        inputs=(
            tensor_spec(f"input_ids:int64:-1,-1:{limits}"),
            tensor_spec("attention_mask:int64:-1,-1:max_length=32:min_value=0:max_value=1"),
        ),
        outputs=(tensor_spec(f"logits:float32:-1,-1,5:labels={','.join(LABELS)}"),),
        handler=HandlerSpec(import_path=HANDLER, options=options),
        files=(folder / "tokenizer.json",),
        check_version=check_handler,
    )
    return manifest, tokenizer


def by_hand(text: str, tokenizer: Tokenizer, ignore: tuple[str, ...] = ("O",)) -> list[Any]:
    """Each non-special token's entry, from the tokenizer's tokens and the weights' rule."""
    encoding = tokenizer.encode(text)
    entries = []
    for index, (token, token_id, (start, end)) in enumerate(
        zip(encoding.tokens, encoding.ids, encoding.offsets, strict=True)
    ):
        if token in ("[CLS]", "[SEP]"):
            continue
        label = TAGGED.get(token, "O")
        if label in ignore:
            continue
        word = text[start:end] if token == "[UNK]" else token
        entries.append(
            {
                "entity": label, "score": score_of(token_id), "index": index, "word": word,
                "start": start, "end": end,
            }
        )  # fmt: skip
    return entries


def assert_same(answer: list[Any], expected: list[Any]) -> None:
    assert len(answer) == len(expected), (answer, expected)
    for got, want in zip(answer, expected, strict=True):
        assert got.keys() == want.keys()
        assert got["score"] == pytest.approx(want["score"], rel=1e-6)
        assert {**got, "score": 0} == {**want, "score": 0}


@pytest.fixture
async def ner(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Tokenizer]]:
    manifest, tokenizer = package_ner(tmp_path)
    assert manifest.outputs[0].length_of == "input_ids"  # found by packaging
    app = create_app(
        Settings(
            model_repository=tmp_path / "models", model_name="ner", device="cpu", max_wait_ms=20
        )
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, tokenizer


TEXTS = ["Alice moved to New York", "Bob visited Paris", "Alice visited Yorkshire €"]


async def test_each_token_is_answered_with_its_label_score_and_characters(
    ner: tuple[httpx.AsyncClient, Tokenizer],
) -> None:
    client, tokenizer = ner
    response = await client.post("/predict", json={"instances": TEXTS})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert len(predictions) == len(TEXTS)
    for text, answer in zip(TEXTS, predictions, strict=True):
        assert_same(answer, by_hand(text, tokenizer))
    # Written out for the first text: offsets into the text, never [CLS], [SEP] or padding.
    york = tokenizer.token_to_id("york")
    assert [(e["entity"], e["index"], e["word"], e["start"], e["end"]) for e in predictions[0]] == [
        ("B-PER", 1, "alice", 0, 5),
        ("B-LOC", 4, "new", 15, 18),
        ("I-LOC", 5, "york", 19, 23),
    ]
    assert predictions[0][2]["score"] == pytest.approx(score_of(york), rel=1e-6)
    single = await client.post(
        "/predict", content=TEXTS[1].encode(), headers={"content-type": "text/plain"}
    )
    assert single.json()["predictions"] == [predictions[1]]


async def test_simple_aggregation_groups_adjacent_tokens_of_one_entity(
    ner: tuple[httpx.AsyncClient, Tokenizer],
) -> None:
    client, tokenizer = ner
    response = await client.post("/predict?aggregation_strategy=simple", json={"instances": TEXTS})
    assert response.status_code == 200, response.text
    first, second, third = response.json()["predictions"]

    def score(*tokens: str) -> float:
        return sum(score_of(tokenizer.token_to_id(token) or 0) for token in tokens) / len(tokens)

    expected = [
        [("PER", "alice", 0, 5, score("alice")), ("LOC", "new york", 15, 23, score("new", "york"))],
        [("PER", "bob", 0, 3, score("bob")), ("LOC", "paris", 12, 17, score("paris"))],
        [
            ("PER", "alice", 0, 5, score("alice")),
            ("LOC", "yorkshire", 14, 23, score("york", "##s", "##h", "##ire")),
        ],
    ]
    for answer, entities in zip((first, second, third), expected, strict=True):
        assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in answer] == [
            entity[:4] for entity in entities
        ]
        assert [e["score"] for e in answer] == pytest.approx([e[4] for e in entities], rel=1e-6)
    # Two entities that begin (B-) side by side stay two, as in HF.
    adjacent = await client.post(
        "/predict?aggregation_strategy=simple", json={"instances": ["Alice Bob moved"]}
    )
    assert [
        (e["entity_group"], e["word"], e["start"], e["end"])
        for e in adjacent.json()["predictions"][0]
    ] == [("PER", "alice", 0, 5), ("PER", "bob", 6, 9)]
    refused = await client.post("/predict?aggregation_strategy=max", json={"instances": TEXTS})
    assert refused.status_code == 422
    assert "'none' or 'simple', got 'max'" in refused.json()["error"]["message"]


def handler_of(manifest: Manifest, folder: Path, **options: Any) -> TokenClassificationHandler:
    context = HandlerContext(manifest=manifest, folder=folder, layout=InputLayout(manifest))
    return TokenClassificationHandler(context, **options)


def test_with_no_ignored_label_every_token_but_the_special_ones_is_answered(
    tmp_path: Path,
) -> None:
    manifest, tokenizer = package_ner(tmp_path)
    folder = ModelStore(tmp_path / "models").version_folder("ner", manifest.version)
    handler = handler_of(manifest, folder, ignore_labels=[])
    request = HandlerRequest(
        body=b'{"instances": ["Alice visited Yorkshire \\u20ac", "Bob"]}',
        media_type="application/json",
        content_type="application/json",
    )
    inputs = handler.preprocess(request)
    assert inputs["input_ids"].shape == (2, 9)  # the short text is padded
    model = MaskedTokenTagger(tokenizer.get_vocab_size(), len(LABELS))
    model.load_state_dict(load_file(str(folder / manifest.artifact)))
    with torch.inference_mode():
        logits = model(
            torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["attention_mask"])
        )["logits"].numpy()
    answers = handler.postprocess(NamedArrays.of(logits=logits), request)
    texts = ["Alice visited Yorkshire €", "Bob"]
    for text, answer in zip(texts, answers, strict=True):
        assert_same(answer, by_hand(text, tokenizer, ignore=()))
    assert [entry["word"] for entry in answers[0]] == [
        "alice", "visited", "york", "##s", "##h", "##ire", "€",
    ]  # fmt: skip
    assert all(
        texts[0][e["start"] : e["end"]].lower() in (e["word"].removeprefix("##"), "€")
        for e in answers[0]
    )
    assert len(answers[1]) == 1  # "bob": no padding, no [CLS] or [SEP]


def test_the_handler_needs_per_token_scores_tied_to_the_ids(tmp_path: Path) -> None:
    manifest, _ = package_ner(tmp_path)
    folder = ModelStore(tmp_path / "models").version_folder("ner", manifest.version)
    untied = manifest.model_copy(
        update={"outputs": (manifest.outputs[0].model_copy(update={"length_of": None}),)}
    )
    with pytest.raises(ValueError, match="length_of='input_ids'"):
        handler_of(untied, folder)
    with pytest.raises(ValueError, match="'none' or 'simple', got 'first'"):
        handler_of(manifest, folder, aggregation_strategy="first")
