"""Tiny ``transformers`` models written by ``save_pretrained``, built offline for the tests:
random weights from small configs, a WordPiece tokenizer built here from a few sentences (a
byte-level BPE trained here for GPT-2), a ViT image processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "Paris is in France and Berlin is in Germany",
    "I loved this movie, it was great fun",
    "a terrible film with a dull story",
    "Ada Lovelace wrote the first program in London",
]
TEXT_TASKS = ("text-classification", "token-classification", "feature-extraction")
TOKEN_LABELS = {0: "O", 1: "B-LOC", 2: "I-LOC", 3: "B-PER", 4: "I-PER"}
IMAGE_LABELS = {0: "cat", 1: "dog", 2: "bird"}
MAX_POSITIONS = 64


def tokenizer() -> Tokenizer:
    """A BERT-style WordPiece tokenizer whose vocabulary is ``CORPUS``'s words, then its
    letters and their ``##`` continuations, in sorted order: the same on every run (one the
    ``tokenizers`` trainer makes is not, so neither were the models' answers)."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    splitter = pre_tokenizers.BertPreTokenizer()
    words = sorted(
        {
            word
            for text in CORPUS
            for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text))
        }
    )
    letters = sorted({letter for word in words for letter in word})
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens = dict.fromkeys([*special, *words, *letters, *(f"##{letter}" for letter in letters)])
    vocabulary = {token: index for index, token in enumerate(tokens)}
    built = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    built.normalizer = normalizer
    built.pre_tokenizer = splitter
    built.decoder = decoders.WordPiece()
    built.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocabulary["[CLS]"]), ("[SEP]", vocabulary["[SEP]"])],
    )
    return built


def save_text_model(
    folder: Path, task: str, seed: int = 0, initializer_range: float = 0.02
) -> Path:
    """A two-layer BERT for ``task`` and its tokenizer, saved into ``folder``; a larger
    ``initializer_range`` makes its answers differ more from one text to another."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
        PreTrainedTokenizerFast,
    )

    trained = tokenizer()
    labels = TOKEN_LABELS if task == "token-classification" else {0: "negative", 1: "positive"}
    config = BertConfig(
        vocab_size=trained.get_vocab_size(),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=initializer_range,
        id2label=labels,
        label2id={label: index for index, label in labels.items()},
    )
    classes = {
        "text-classification": BertForSequenceClassification,
        "token-classification": BertForTokenClassification,
        "feature-extraction": BertModel,
    }
    torch.manual_seed(seed)
    classes[task](config).eval().save_pretrained(folder)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(folder)
    return folder


def save_image_model(folder: Path, seed: int = 0) -> Path:
    """A two-layer ViT over 32x32 RGB images and its image processor, saved into ``folder``."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        id2label=IMAGE_LABELS,
        label2id={label: index for index, label in IMAGE_LABELS.items()},
    )
    torch.manual_seed(seed)
    ViTForImageClassification(config).eval().save_pretrained(folder)
    processor = ViTImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25]
    )
    processor.save_pretrained(folder)
    return folder


def save_sentence_transformer(
    folder: Path,
    transformer: Path,
    pooling: str | tuple[str, ...] = "mean",
    then: tuple[str, ...] = (),
    max_seq_length: int | None = None,
    include_prompt: bool = True,
    **settings: Any,
) -> Path:
    """``transformer`` (a ``feature-extraction`` folder of ``save_text_model``) with a
    ``pooling_mode`` Pooling and then each module named in ``then`` (``"dense"``: 8 wide,
    tanh; ``"dense-gelu"``: as wide as the pooling, GELU, no bias, residual;
    ``"normalize"``), saved by ``SentenceTransformer.save`` into ``folder``. ``settings``:
    ``SentenceTransformer``'s (``prompts``, ``default_prompt_name``, ``truncate_dim``...)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    encoder = Transformer(str(transformer))
    if max_seq_length is not None:
        encoder.max_seq_length = max_seq_length
    pooled = Pooling(
        encoder.get_embedding_dimension(), pooling_mode=pooling, include_prompt=include_prompt
    )
    width = pooled.get_embedding_dimension()
    torch.manual_seed(1)
    after = {
        "dense": lambda: Dense(width, 8),
        "dense-gelu": lambda: Dense(
            width, width, bias=False, activation_function=torch.nn.GELU(), use_residual=True
        ),
        "normalize": Normalize,
    }
    modules = [encoder, pooled, *(after[name]() for name in then)]
    SentenceTransformer(modules=modules, device="cpu", **settings).save(str(folder))
    return folder


def save_cross_encoder(folder: Path, transformer: Path, **settings: Any) -> Path:
    """A reranker over ``transformer`` (a ``save_text_model`` folder): a one-label head (seeded
    weights, larger than the default so scores differ from pair to pair), saved by
    ``CrossEncoder.save`` into ``folder``. ``settings``: ``CrossEncoder``'s
    (``activation_fn``, ``prompts``, ``max_length``...)."""
    from sentence_transformers import CrossEncoder

    torch.manual_seed(2)
    reranker = CrossEncoder(str(transformer), num_labels=1, device="cpu", **settings)
    classifier = reranker.model.classifier
    torch.nn.init.normal_(classifier.weight, std=2.0)
    torch.nn.init.normal_(classifier.bias, std=0.5)
    reranker.save(str(folder))
    return folder


def save_distilbert_classifier(folder: Path, seed: int = 0) -> Path:
    """A one-layer DistilBERT fine-tuned without naming its labels: transformers 5 writes no
    ``id2label`` for the default two (``AutoConfig`` gives ``LABEL_0`` and ``LABEL_1``)."""
    from transformers import (
        DistilBertConfig,
        DistilBertForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    trained = tokenizer()
    config = DistilBertConfig(
        vocab_size=trained.get_vocab_size(),
        dim=16,
        n_layers=1,
        n_heads=2,
        hidden_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    DistilBertForSequenceClassification(config).eval().save_pretrained(folder)
    special = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]"}
    PreTrainedTokenizerFast(
        tokenizer_object=trained, sep_token="[SEP]", model_max_length=MAX_POSITIONS, **special
    ).save_pretrained(folder)
    return folder


def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2-style byte-level BPE trained on ``CORPUS``; ``<|endoftext|>`` is its id 0."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator(CORPUS * 5, trainer)
    return trained


def save_gpt2_model(folder: Path, head: bool = False, seed: int = 0) -> Path:
    """A one-layer GPT-2, bare (``GPT2Model``) or with its language-model head, and its
    tokenizer; its config names its length ``n_positions``, as GPT-2's does."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model, PreTrainedTokenizerFast

    trained = byte_level_tokenizer()
    config = GPT2Config(
        vocab_size=trained.get_vocab_size(),
        n_positions=MAX_POSITIONS,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    (GPT2LMHeadModel if head else GPT2Model)(config).eval().save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=trained,
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    ).save_pretrained(folder)
    return folder
