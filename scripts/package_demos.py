"""Package the demo models that show the built-in handlers: ``sentiment`` and ``digits_png``.

``python -m scripts.package_demos [--repository PATH]``. Deterministic: the seed, the corpus
and the torch version decide every byte, so running it again gives the same version ids.

- ``sentiment``: text in (the text handler and a WordPiece ``tokenizer.json`` packaged with
  the version), two inputs (``input_ids``, ``attention_mask``), two outputs (``logits`` with
  labels, ``embedding``). Trained here in a few seconds on ``scripts/sentiment_corpus.tsv``.
- ``digits_png``: the ``digits`` CNN's weights behind the image handler: a PNG or JPEG of a
  dark digit drawn on a light ground in, the digit out.
"""

from __future__ import annotations

import argparse
import string
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from service.config import BUNDLED_MODEL_REPOSITORY
from service.manifest import MANIFEST_FILE, Architecture, HandlerSpec, Manifest, TensorSpec
from service.models.sentiment import PAD_ID, SentimentClassifier
from service.packaging.package import Packager

CORPUS = Path(__file__).resolve().parent / "sentiment_corpus.tsv"
LABELS = ("negative", "positive")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")  # [PAD] is id 0 = PAD_ID
MAX_LENGTH = 64
WIDTH = 32
EPOCHS = 300
TEXT_HANDLER = "service.frontend.handlers.text:TextHandler"
IMAGE_HANDLER = "service.frontend.handlers.image:ImageHandler"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=BUNDLED_MODEL_REPOSITORY)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    store = Packager(args.repository)
    sentiment, tensors = package_sentiment(store, args.seed)
    print(f"sentiment {sentiment.version}")
    print(f"sentiment_tensors {tensors.version}")
    digits = package_digits_png(store, args.repository)
    print(f"digits_png {digits.version}")


def read_corpus(path: Path = CORPUS) -> list[tuple[str, int]]:
    """``(sentence, class index)`` pairs of the ``label<TAB>sentence`` corpus."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            label, sentence = line.split("\t", 1)
            pairs.append((sentence.strip(), LABELS.index(label)))
    return pairs


def build_tokenizer(sentences: list[str]) -> Tokenizer:
    """A BERT-style WordPiece tokenizer (lower case, ``[CLS] text [SEP]``) over the corpus.

    The vocabulary is counted here: every word of the corpus, most frequent first, then every
    printable ASCII character as a word start and as a ``##`` continuation, so an unseen word
    splits into known pieces instead of ``[UNK]``. (The ``tokenizers`` trainer breaks ties
    between equal counts in hash order: another vocabulary each run, hence another version.)
    """
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts = Counter(
        word
        for sentence in sentences
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(sentence))
    )
    words = sorted(counts, key=lambda word: (-counts[word], word))
    alphabet = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    pieces = [*SPECIAL_TOKENS, *words]
    pieces += [char for char in alphabet if char not in counts]
    pieces += [f"##{char}" for char in alphabet]
    tokenizer = Tokenizer(
        models.WordPiece({piece: index for index, piece in enumerate(pieces)}, unk_token="[UNK]")
    )
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", pieces.index("[CLS]")), ("[SEP]", pieces.index("[SEP]"))],
    )
    return tokenizer


def encode(tokenizer: Tokenizer, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded with ``PAD_ID`` as the text handler pads them."""
    encodings = tokenizer.encode_batch(sentences)
    longest = max(len(encoding.ids) for encoding in encodings)
    ids = torch.full((len(sentences), longest), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(sentences), longest), dtype=torch.int64)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
        mask[row, : len(encoding.ids)] = 1
    return ids, mask


def train_sentiment(
    tokenizer: Tokenizer, corpus: list[tuple[str, int]], seed: int
) -> SentimentClassifier:
    """Full-batch Adam on the corpus: a few seconds on one CPU thread (one thread keeps the
    sums, hence the weights and the version id, identical from run to run)."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = SentimentClassifier(vocab_size=tokenizer.get_vocab_size(), width=WIDTH)
    ids, mask = encode(tokenizer, [sentence for sentence, _ in corpus])
    targets = torch.tensor([label for _, label in corpus])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-4)
    for _ in range(EPOCHS):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids, mask)["logits"], targets)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(ids, mask)["logits"].argmax(-1) == targets).float().mean().item()
    if accuracy < 0.95:
        raise RuntimeError(f"the sentiment demo fits its corpus badly: accuracy {accuracy:.3f}")
    return model


def package_sentiment(store: Packager, seed: int) -> tuple[Manifest, Manifest]:
    """``sentiment`` (raw text in, labels out, through the text handler) and
    ``sentiment_tensors``: the same weights without a handler, for clients that tokenize
    themselves (two named inputs in, two named outputs out)."""
    corpus = read_corpus()
    tokenizer = build_tokenizer([sentence for sentence, _ in corpus])
    model = train_sentiment(tokenizer, corpus, seed)
    vocabulary = tokenizer.get_vocab_size()
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "sentiment.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
        tokenizer_file = Path(scratch) / "tokenizer.json"
        tokenizer.save(str(tokenizer_file))
        with_handler = store.package(
            name="sentiment",
            artifact=weights,
            format="safetensors",
            architecture=Architecture(
                import_path="service.models.sentiment:SentimentClassifier",
                kwargs={"vocab_size": vocabulary, "width": WIDTH},
            ),
            inputs=(
                TensorSpec(
                    name="input_ids",
                    dtype="int64",
                    shape=(-1, -1),
                    max_length=MAX_LENGTH,
                    min_value=1,
                    max_value=vocabulary - 1,
                    pad_value=PAD_ID,
                ),
                TensorSpec(
                    name="attention_mask",
                    dtype="int64",
                    shape=(-1, -1),
                    max_length=MAX_LENGTH,
                    min_value=0,
                    max_value=1,
                    pad_value=0,
                ),
            ),
            outputs=(
                TensorSpec(name="logits", dtype="float32", shape=(-1, 2), labels=LABELS),
                TensorSpec(name="embedding", dtype="float32", shape=(-1, WIDTH)),
            ),
            handler=HandlerSpec(
                import_path=TEXT_HANDLER,
                options={"tokenizer_file": tokenizer_file.name, "truncate": True},
            ),
            files=[tokenizer_file],
            metadata={
                "description": "Sentiment of short English sentences (reviews): mean of token "
                "embeddings over the attention mask, tanh projection (the 'embedding' output), "
                "linear layer to negative/positive logits. A demo of the text handler and of "
                "two inputs and two outputs, not a good sentiment model.",
                "training_data": f"scripts/{CORPUS.name} ({len(corpus)} sentences)",
                "tokenizer": f"WordPiece, lower case, [CLS] text [SEP], {vocabulary} pieces",
                "epochs": EPOCHS,
                "seed": seed,
            },
        )
        manifest = with_handler
        tensors = store.package(
            name="sentiment_tensors",
            artifact=weights,
            format=manifest.format,
            architecture=manifest.architecture,
            inputs=manifest.inputs,
            outputs=manifest.outputs,
            metadata={
                **manifest.metadata,
                "description": "The sentiment demo's weights without a handler: input_ids and "
                "attention_mask in (tokenize with the sentiment version's tokenizer.json), "
                "logits and embedding out.",
            },
        )
        return with_handler, tensors


def package_digits_png(store: Packager, repository: Path) -> Manifest:
    """The newest ``digits`` version's weights and tensors, behind the image handler."""
    digits = _newest_manifest(repository / "digits")
    folder = repository / "digits" / str(digits["version"])
    image = TensorSpec(**digits["inputs"][0])
    logits = TensorSpec(**{**digits["outputs"][0], "labels": [str(digit) for digit in range(10)]})
    return store.package(
        name="digits_png",
        artifact=folder / str(digits["artifact"]),
        format="safetensors",
        architecture=Architecture(**digits["architecture"]),
        inputs=(image,),
        outputs=(logits,),
        handler=HandlerSpec(
            import_path=IMAGE_HANDLER,
            # scikit-learn's digits are light ink (16) on a dark ground (0), counted in 4x4
            # blocks of a 32x32 bitmap: a dark drawing on white is inverted, and shrunk by
            # averaging boxes of pixels.
            options={
                "mode": "L",
                "layout": "HW",
                "invert": True,
                "fit_content": True,
                "resample": "box",
            },
        ),
        metadata={
            "description": "The digits CNN reading an uploaded PNG or JPEG: a dark digit drawn "
            "on a light ground, filling most of a square picture (it is shrunk to 8x8 grey "
            "pixels, as scikit-learn's digits were).",
            "weights": f"digits@{digits['version']}",
        },
    )


def _newest_manifest(model_folder: Path) -> dict[str, Any]:
    """The raw manifest of a model's newest version (read as JSON: older schemas too)."""
    manifests = [
        orjson.loads(path.read_bytes()) for path in model_folder.glob(f"*/{MANIFEST_FILE}")
    ]
    if not manifests:
        raise SystemExit(f"no version of {model_folder.name} in {model_folder.parent}")
    return max(manifests, key=lambda manifest: str(manifest["created_at"]))


if __name__ == "__main__":
    main()
