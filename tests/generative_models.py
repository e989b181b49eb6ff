"""Tiny causal LMs with random weights, built from configs for the generation tests, and the
tokenizers their text is checked with (trained here: nothing from a hub)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

if TYPE_CHECKING:
    from service.manifest import Manifest

VOCAB = 300
EOS = 0
CONTEXT = 512

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "naïve café, déjà vu: 日本語のテキストです",
    "emoji 🙂🚀 and ümlauts in Zürich",
    "Paris is in France and Berlin is in Germany",
    "def add(a, b):\n    return a + b\n",
]


def gpt2(seed: int = 0, *, layers: int = 2, width: int = 64, heads: int = 4) -> Any:
    """A GPT-2 (``GPT2LMHeadModel``), ``layers`` x ``width``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        initializer_range=0.2,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def llama(seed: int = 0) -> Any:
    """A Llama-shaped ``LlamaForCausalLM`` with grouped-query attention (4 heads, 2 KV)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_decoder_settings())).eval()


def qwen2(seed: int = 0) -> Any:
    """A Qwen2-shaped ``Qwen2ForCausalLM`` (biased q/k/v projections), grouped-query."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_decoder_settings())).eval()


def t5(seed: int = 0) -> Any:
    """A T5 (``T5ForConditionalGeneration``): relative positions, no context of its own."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=EOS,
        pad_token_id=EOS,
        eos_token_id=1,
        initializer_factor=4.0,
    )
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config).eval()


def bart(seed: int = 0) -> Any:
    """A BART (``BartForConditionalGeneration``) without its forced end-of-sequence token
    (a logits processor of ``generate``, not part of the model)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        init_std=0.2,
        forced_eos_token_id=None,
    )
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config).eval()


def _decoder_settings() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CONTEXT,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }


def byte_level_bpe() -> Tokenizer:
    """GPT-2's kind of tokenizer: byte-level BPE, so a character of several UTF-8 bytes can
    span several tokens."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    trained.train_from_iterator(TEXTS * 5, trainer)
    return trained


def metaspace_bpe() -> Tokenizer:
    """Llama's kind: SentencePiece-style BPE over "▁"-marked words, whose decoder drops the
    leading space of a text's first word."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.NFKC()
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(TEXTS * 5, trainer)
    return trained


def save_folder(folder: Path, model: Any, tokenizer: Tokenizer | None = None) -> Path:
    """``model`` and a tokenizer (GPT-2's kind unless given) as ``save_pretrained`` writes
    them, into ``folder``: what ``batchserve package --hf`` takes."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or byte_level_bpe(),
        eos_token="<|endoftext|>",
        model_max_length=CONTEXT,
    ).save_pretrained(folder)
    return folder


#: A ChatML-shaped chat template, as Qwen's.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_text_generation_version(
    root: Path,
    name: str = "writer",
    *,
    tokenizer: Tokenizer | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    generation_config: dict[str, Any] | None = None,
) -> Manifest:
    """A text-generation version in the repository at ``root`` holding what a front end reads
    (its tokenizer, tokenizer_config.json with the chat template, generation_config.json) and
    placeholder weights: for front-end tests with a fake engine."""
    import hashlib
    from datetime import UTC, datetime

    import orjson

    from service.manifest import MANIFEST_FILE, Architecture, Manifest, TensorSpec

    trained = tokenizer or byte_level_bpe()
    config: dict[str, Any] = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    contents = {
        "model.safetensors": b"placeholder",
        "tokenizer.json": trained.to_str().encode(),
        "tokenizer_config.json": orjson.dumps(config),
        "generation_config.json": orjson.dumps(generation_config or {"eos_token_id": EOS}),
    }
    manifest = Manifest.create(
        name=name,
        format="safetensors",
        artifact="model.safetensors",
        files={file: hashlib.sha256(data).hexdigest() for file, data in contents.items()},
        architecture=Architecture(import_path="transformers:GPT2LMHeadModel"),
        inputs=(TensorSpec(name="input_ids", dtype="int64", shape=(-1, -1)),),
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, -1, VOCAB)),),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        metadata={"task": "text-generation"},
    )
    folder = root / name / manifest.version
    folder.mkdir(parents=True)
    for file, data in contents.items():
        (folder / file).write_bytes(data)
    (folder / MANIFEST_FILE).write_text(manifest.model_dump_json())
    return manifest
