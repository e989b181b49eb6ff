"""``batchserve package --hf DIR``: a ``save_pretrained`` folder as a version, with no code.

The folder's ``config.json``, read as ``transformers`` reads it (``AutoConfig``: default labels,
each model's own key names), says the task (its ``architectures``), the labels
(``id2label``) and what the model can hold (``max_position_embeddings``); its
``tokenizer.json`` or ``preprocessor_config.json`` becomes the handler's options. The files
serving reads (``hf_files``) are packaged and hashed with the version, ``model.safetensors``
as its artifact, loaded into the architecture ``service.engine.hf_model`` rebuilds from the
config; the rest (training state, other weights, code) is left out and named.

A ``sentence-transformers`` folder (``hf_sentence_transformers``) is an embedding model whose
pooling, dense and normalize steps go into the architecture's settings, and its Dense layers'
weights into the artifact beside the transformer's; a bare ``*Model`` is one with a mean
pooling. A ``*ForSequenceClassification`` with one label, or a folder ``CrossEncoder`` saved,
is a reranker (``text-ranking``): a (query, text) pair in, a score out.

A causal language model (``*ForCausalLM``, ``*LMHeadModel``) is ``text-generation``: the
engine generates from it token by token (``EngineClient.generate``), and as a tensor model it
answers each prompt's next-token logits. Its tokenizer files, chat template and
``generation_config.json`` are hashed into the version, which the front ends read to tokenize;
its end-of-sequence ids, context length and sampling defaults go into the manifest's
metadata.

An encoder-decoder (``*ForConditionalGeneration`` of T5 or BART) is ``text2text-generation``,
as ``transformers`` names the task: the engine encodes each prompt and generates the decoder's
tokens in cohorts (``engine/generation/cohorts.py``); as a tensor model it answers the first
decoded token's logits. Its files are hashed as a causal LM's; its ``decoder_start_token_id``
and context length (``max_position_embeddings``, else the tokenizer's ``model_max_length``)
must be named, or it is refused naming what is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from service.bridge.interface import ENCODER_DECODER_TASK
from service.manifest import Architecture, HandlerSpec, TensorSpec
from service.repository import one_line
from service.server.hf_files import folder_files, read_json_object
from service.server.hf_sentence_transformers import (
    SentenceTransformersFolder,
    cross_encoder_activation,
    sentence_transformers_folder,
    write_weights,
)

ARTIFACT = "model.safetensors"
#: The last words of ``config.architectures[0]`` -> the task served (and a model's bare
#: class, ``BertModel``, is ``feature-extraction``).
_TASK_SUFFIXES = (
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForImageClassification", "image-classification"),
)
#: Causal language-model heads: served as ``text-generation``.
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
#: Encoder-decoder heads: served as ``text2text-generation`` for the model types below.
_SEQ2SEQ_SUFFIXES = ("ForConditionalGeneration",)
#: Encoder-decoders over text whose cohorts are tested against ``generate``.
_SEQ2SEQ_MODEL_TYPES = frozenset({"t5", "bart"})
GENERATION_TASK = "text-generation"
TEXT2TEXT_TASK = ENCODER_DECODER_TASK
#: ``generation_config.json``'s settings of ``generate`` that serving does not apply, each with
#: the value that means "off".
_UNSERVED_GENERATION = (
    ("num_beams", 1),
    ("min_length", 0),
    ("min_new_tokens", 0),
    ("no_repeat_ngram_size", 0),
    ("encoder_no_repeat_ngram_size", 0),
    ("encoder_repetition_penalty", 1.0),
    ("bad_words_ids", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("sequence_bias", None),
    ("typical_p", 1.0),
    ("min_p", 0.0),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
    ("penalty_alpha", 0.0),
    ("exponential_decay_length_penalty", None),
    ("forced_bos_token_id", None),
    ("forced_eos_token_id", None),
)
#: Of those, what an encoder-decoder's cohorts apply (BART's checkpoints rely on them).
_ENCODER_DECODER_APPLIES = frozenset({"forced_bos_token_id", "forced_eos_token_id"})
#: A tokenizer's ``model_max_length`` above this is transformers' "no limit" placeholder.
_NO_LIMIT_TOKENS = 1_000_000
#: Keys of ``generation_config.json`` kept as the version's sampling defaults.
_GENERATION_DEFAULTS = (
    "max_new_tokens",
    "max_length",
    "temperature",
    "top_p",
    "top_k",
    "do_sample",
    "repetition_penalty",
)
#: Models whose positions start after the padding index (``padding_idx + 1``).
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer"})
#: PIL's resampling codes, as ``preprocessor_config.json`` writes them.
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box"}
#: Image processors that resize to a fixed size, rescale and normalise: what ``ImageHandler``
#: does, so its answers equal theirs.
_RESIZING_PROCESSORS = frozenset(
    {"ViTImageProcessor", "ViTImageProcessorFast", "DeiTImageProcessor"}
)
_IMAGE_TOP_K = 5  # the image-classification pipeline's default
#: Tasks whose answers name the config's labels.
_LABELLED_TASKS = frozenset({"text-classification", "token-classification", "image-classification"})


@dataclass(frozen=True)
class HFVersion:
    """What ``ModelStore.package`` takes for the folder (besides its name)."""

    task: str
    artifact: Path
    architecture: Architecture
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    handler: HandlerSpec | None
    """None for ``text-generation``: its front ends tokenize with the version's files."""
    files: tuple[Path, ...]
    metadata: dict[str, Any]
    left_out: tuple[str, ...] = ()
    """The folder's files left out of the version, each with why (``hf_files``)."""
    not_applied: tuple[str, ...] = ()
    """``generation_config.json``'s settings that serving does not apply, as ``key=value``."""


def hf_version(folder: Path, scratch: Path, max_length: int | None = None) -> HFVersion:
    """Read a ``save_pretrained`` folder; ``ValueError`` names what it lacks or what cannot be
    served. ``max_length`` (tokens) defaults to what the tokenizer and the model both hold.
    ``scratch``: a folder for the artifact of a sentence-transformers folder with Dense
    layers (its weights and theirs in one file), kept until the version is packaged."""
    if not folder.is_dir():
        raise ValueError(f"--hf needs a folder written by save_pretrained, got {str(folder)!r}")
    sentence_transformers = sentence_transformers_folder(folder)
    config = _json(folder / "config.json")
    if not (folder / ARTIFACT).is_file():
        others = sorted(path.name for path in folder.iterdir() if "model" in path.name)
        raise ValueError(
            f"{folder.name} has no single {ARTIFACT} (found {others}): load it with "
            "transformers and save it into a new folder, with its tokenizer (or image "
            "processor): model.save_pretrained(new) writes one model.safetensors (give a "
            "max_shard_size above its size; safe_serialization=True before transformers "
            "4.35), tokenizer.save_pretrained(new) its tokenizer.json; then package the new "
            "folder"
        )
    settings = _transformers_config(config)
    task = _task(config, settings)
    if task == "text-classification" and _ranks(settings):
        task = "text-ranking"
    if sentence_transformers is not None:
        _check_sentence_transformers_task(folder, config, task, sentence_transformers)
    modules = sentence_transformers.module_folders if sentence_transformers else ()
    contents = folder_files(folder, ARTIFACT, modules)
    if task == GENERATION_TASK:
        return _generative_version(folder, config, settings, contents.kept, contents.left_out)
    if task == TEXT2TEXT_TASK:
        return _encoder_decoder_version(
            folder, config, settings, max_length, contents.kept, contents.left_out
        )
    files = contents.kept
    labels = _labels(settings) if task in _LABELLED_TASKS else None
    metadata: dict[str, Any] = {"task": task, "source": "transformers save_pretrained"}
    if sentence_transformers is not None:
        metadata["source"] = f"sentence-transformers {sentence_transformers.model_type}"
    artifact = folder / ARTIFACT
    outputs: tuple[TensorSpec, ...]
    if task == "image-classification":
        inputs, handler_options = _image_input(folder, settings)
        model_class = "TransformersImageModel"
    else:
        sequence_length = sentence_transformers.max_seq_length if sentence_transformers else None
        inputs, handler_options = _text_inputs(folder, settings, max_length, sequence_length)
        model_class = "TransformersTextModel"
    architecture = Architecture(
        import_path=f"service.engine.hf_model:{model_class}",
        kwargs={"task": task, "config": config},
    )
    if task == "image-classification":
        assert labels is not None
        outputs = (
            TensorSpec(name="logits", dtype="float32", shape=(-1, len(labels)), labels=labels),
        )
        handler_options["top_k"] = min(_IMAGE_TOP_K, len(labels))
        import_path = "service.frontend.handlers.image:ImageHandler"
    elif task == "feature-extraction":
        hidden = _positive_int(settings, "hidden_size")
        outputs = (TensorSpec(name="embedding", dtype="float32", shape=(-1, hidden)),)
        import_path = "service.frontend.handlers.embedding:EmbeddingHandler"
        if sentence_transformers is not None:
            embedding = _sentence_embedding(sentence_transformers, config, hidden, inputs)
            architecture, inputs, outputs = embedding
            handler_options |= _prompt_options(sentence_transformers)
            if sentence_transformers.similarity_fn_name is not None:
                similarity = sentence_transformers.similarity_fn_name
                handler_options["similarity_fn_name"] = similarity
                metadata["similarity_fn_name"] = similarity
            if sentence_transformers.head_weights:
                artifact = scratch / ARTIFACT
                write_weights(folder / ARTIFACT, sentence_transformers.head_weights, artifact)
    elif task == "text-ranking":
        outputs = (TensorSpec(name="score", dtype="float32", shape=(-1,)),)
        import_path = "service.frontend.handlers.reranking:RerankHandler"
        activation = cross_encoder_activation(config)
        if sentence_transformers is not None:
            activation = sentence_transformers.activation or activation
            handler_options |= _prompt_options(sentence_transformers)
        handler_options["activation"] = activation or "Sigmoid"
    elif task == "token-classification":
        assert labels is not None
        outputs = (
            TensorSpec(
                name="logits",
                dtype="float32",
                shape=(-1, -1, len(labels)),
                labels=labels,
                length_of="input_ids",
            ),
        )
        handler_options["aggregation_strategy"] = "simple"
        import_path = "service.frontend.handlers.tokens:TokenClassificationHandler"
    else:
        assert labels is not None
        outputs = (
            TensorSpec(name="logits", dtype="float32", shape=(-1, len(labels)), labels=labels),
        )
        multi = settings.problem_type == "multi_label_classification"
        handler_options["scores"] = "sigmoid" if multi or len(labels) == 1 else "softmax"
        import_path = "service.frontend.handlers.hf_text:HFTextHandler"
    return HFVersion(
        task=task,
        artifact=artifact,
        architecture=architecture,
        inputs=inputs,
        outputs=outputs,
        handler=HandlerSpec(import_path=import_path, options=handler_options),
        files=files,
        metadata=metadata,
        left_out=contents.left_out,
    )


def _ranks(settings: Any) -> bool:
    """A classifier of one label scores what it is given (a reranker's relevance of a
    pair, as ``CrossEncoder``), unless it is one of several independent labels."""
    return bool(settings.num_labels == 1 and settings.problem_type != "multi_label_classification")


def _check_sentence_transformers_task(
    folder: Path, config: dict[str, Any], task: str, found: SentenceTransformersFolder
) -> None:
    """A SentenceTransformer over a bare model; a CrossEncoder over a one-label classifier."""
    wanted, words = {
        "SentenceTransformer": ("feature-extraction", "over the bare model (feature extraction)"),
        "CrossEncoder": ("text-ranking", "over a *ForSequenceClassification with one label"),
    }[found.model_type]
    if task != wanted:
        raise ValueError(
            f"{folder.name} is a sentence-transformers {found.model_type} over "
            f"{config['architectures'][0]} ({task}); --hf serves one {words}"
        )


def _sentence_embedding(
    found: SentenceTransformersFolder,
    config: dict[str, Any],
    hidden: int,
    inputs: tuple[TensorSpec, ...],
) -> tuple[Architecture, tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The architecture running the folder's modules, its inputs (with each row's prompt
    length when the pooling leaves the prompt out) and its one output, the embedding."""
    if found.pooled_dimensions != hidden:
        raise ValueError(
            f"the folder's Pooling pools {found.pooled_dimensions} numbers a token, but the "
            f"transformer gives {hidden} (config.json's hidden_size)"
        )
    pooling = found.steps[0]
    if not pooling["include_prompt"]:
        longest = max(spec.max_length or 0 for spec in inputs)
        prompt_length = TensorSpec(
            name="prompt_length",
            dtype="int64",
            shape=(-1,),
            min_value=0,
            max_value=longest,
            default_value=0,
        )
        inputs = (*inputs, prompt_length)
    architecture = Architecture(
        import_path="service.engine.hf_model:SentenceTransformersModel",
        kwargs={"config": config, "steps": list(found.steps)},
    )
    assert found.dimensions is not None
    outputs = (TensorSpec(name="embedding", dtype="float32", shape=(-1, found.dimensions)),)
    return architecture, inputs, outputs


def _prompt_options(found: SentenceTransformersFolder) -> dict[str, Any]:
    """The handler's prompts, when the folder names any."""
    options: dict[str, Any] = {}
    if found.prompts:
        options["prompts"] = dict(found.prompts)
    if found.default_prompt_name is not None:
        options["default_prompt_name"] = found.default_prompt_name
    return options


def _json(path: Path, *, optional: bool = False) -> dict[str, Any]:
    return read_json_object(path, ": is it a save_pretrained folder?", optional=optional)


def _token_inputs(
    max_length: int, vocabulary: int, pad_value: int
) -> tuple[TensorSpec, TensorSpec]:
    """Token ids (padded with ``pad_value``) and their attention mask, up to ``max_length``."""
    ids = TensorSpec(
        name="input_ids",
        dtype="int64",
        shape=(-1, -1),
        max_length=max_length,
        min_value=0,
        max_value=vocabulary - 1,
        pad_value=pad_value,
    )
    mask = TensorSpec(
        name="attention_mask",
        dtype="int64",
        shape=(-1, -1),
        max_length=max_length,
        min_value=0,
        max_value=1,
        pad_value=0,
        default_value=1,
    )
    return ids, mask


def _transformers_config(config: dict[str, Any]) -> Any:
    """``config.json`` as ``transformers`` reads it (``AutoConfig``): default labels
    (``LABEL_0``...) where it names none, and each model's own key names mapped to the common
    ones (GPT-2's ``n_positions`` is ``max_position_embeddings``)."""
    from service.engine.hf_model import hf_config  # imports torch and transformers

    try:
        return hf_config(config)
    except Exception as error:  # transformers raises many kinds
        raise ValueError(f"transformers cannot read config.json: {one_line(error)}") from error


def _task(config: dict[str, Any], settings: Any) -> str:
    architectures = config.get("architectures") or []
    if not (
        isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    ):
        raise ValueError(f"config.json names no architectures (got {architectures!r})")
    name = architectures[0]
    for suffix, task in _TASK_SUFFIXES:
        if name.endswith(suffix):
            return task
    bare = _bare_model_names(settings)
    if name in bare:
        return "feature-extraction"
    if name.endswith(_CAUSAL_LM_SUFFIXES):
        return GENERATION_TASK
    if name.endswith(_SEQ2SEQ_SUFFIXES) and settings.model_type in _SEQ2SEQ_MODEL_TYPES:
        return TEXT2TEXT_TASK
    supported = ", ".join(f"*{suffix}" for suffix, _ in _TASK_SUFFIXES)
    raise ValueError(
        f"architecture {name!r} is not served by --hf; it serves {supported}, the bare "
        f"model ({' or '.join(bare) or 'its *Model'}) as feature extraction, causal "
        f"language models (*ForCausalLM, *LMHeadModel) as text generation, and the "
        f"encoder-decoders *ForConditionalGeneration of model_type "
        f"{' or '.join(sorted(_SEQ2SEQ_MODEL_TYPES))} (T5, BART) as text2text generation"
    )


def _generative_version(
    folder: Path,
    config: dict[str, Any],
    settings: Any,
    files: tuple[Path, ...],
    left_out: tuple[str, ...],
) -> HFVersion:
    """A causal LM: prompt ids in, the next token's logits out (the tensor path); generated
    by the engine from the metadata's end-of-sequence ids and context length."""
    from service.engine.generation.model_limits import context_tokens, eos_token_ids
    from service.engine.hf_model import model_class

    name = config["architectures"][0]
    _check_fast_tokenizer(folder)
    try:
        model_class(config)
        context = context_tokens(settings)
    except ValueError as error:
        raise ValueError(
            f"architecture {name!r} cannot be served for generation: {error}; served are "
            "the causal LMs of transformers (*ForCausalLM, *LMHeadModel) with full or "
            "sliding-window attention"
        ) from error
    generation_config = _json(folder / "generation_config.json", optional=True)
    eos = eos_token_ids(generation_config, config)
    vocabulary = _positive_int(settings, "vocab_size")
    pad = settings.pad_token_id
    pad_value = pad if isinstance(pad, int) and 0 <= pad < vocabulary else (eos or (0,))[0]
    return _generating_version(
        GENERATION_TASK,
        folder,
        Architecture(
            import_path="service.engine.hf_model:TransformersCausalLM",
            kwargs={"config": config},
        ),
        _TokenLimits(eos, context, vocabulary, pad_value),
        generation_config,
        files=files,
        left_out=left_out,
    )


def _encoder_decoder_version(
    folder: Path,
    config: dict[str, Any],
    settings: Any,
    max_length: int | None,
    files: tuple[Path, ...],
    left_out: tuple[str, ...],
) -> HFVersion:
    """A T5 or BART: prompt ids in, the first decoded token's logits out (the tensor path);
    generated by the engine in cohorts from the metadata's start and end ids and context."""
    from service.engine.generation.model_limits import eos_token_ids

    name = config["architectures"][0]
    _check_fast_tokenizer(folder)
    generation_config = _json(folder / "generation_config.json", optional=True)
    start = generation_config.get("decoder_start_token_id", settings.decoder_start_token_id)
    vocabulary = _positive_int(settings, "vocab_size")
    if isinstance(start, bool) or not (isinstance(start, int) and 0 <= start < vocabulary):
        raise ValueError(
            f"{name} in {folder.name} names no decoder_start_token_id (generation_config.json "
            f"or config.json), which its decoder starts from; got {start!r}, want an id in "
            f"[0, {vocabulary})"
        )
    context = _encoder_decoder_context(folder, settings)
    if max_length is not None:
        if context is not None and max_length > context:
            raise ValueError(
                f"max_length {max_length} is more than {name} holds ({context} tokens); give "
                f"at most {context}"
            )
        context = max_length
    if context is None:
        raise ValueError(
            f"{name} in {folder.name} names no context length: neither config.json's "
            "max_position_embeddings nor tokenizer_config.json's model_max_length; save the "
            "tokenizer with model_max_length, or give --max-length"
        )
    eos = eos_token_ids(generation_config, config)
    pad = settings.pad_token_id
    pad_value = pad if isinstance(pad, int) and 0 <= pad < vocabulary else start
    return _generating_version(
        TEXT2TEXT_TASK,
        folder,
        Architecture(
            import_path="service.engine.hf_model:TransformersSeq2SeqLM",
            kwargs={"config": config, "decoder_start_token_id": start},
        ),
        _TokenLimits(eos, context, vocabulary, pad_value),
        generation_config,
        files=files,
        left_out=left_out,
        metadata={"decoder_start_token_id": start}
        | _forced_tokens(generation_config, config, vocabulary),
        applied=_ENCODER_DECODER_APPLIES,
    )


def _check_fast_tokenizer(folder: Path) -> None:
    """A generative folder's ``tokenizer.json``: the front ends tokenize prompts with it."""
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{folder.name} has no tokenizer.json, which the front ends tokenize prompts "
            "with; save the tokenizer with a fast tokenizer (tokenizer.save_pretrained on a "
            "PreTrainedTokenizerFast)"
        )


class _TokenLimits(NamedTuple):
    eos: tuple[int, ...]
    context: int
    vocabulary: int
    pad_value: int


def _generating_version(
    task: str,
    folder: Path,
    architecture: Architecture,
    limits: _TokenLimits,
    generation_config: dict[str, Any],
    *,
    files: tuple[Path, ...],
    left_out: tuple[str, ...],
    metadata: dict[str, Any] | None = None,
    applied: frozenset[str] = frozenset(),
) -> HFVersion:
    """A generative version: prompt ids and their mask in, the next token's logits out (the
    tensor path); the engine generates from the metadata's end-of-sequence ids, context
    length and ``generation_config.json``'s defaults (plus ``metadata``). ``applied``: the
    settings of ``_UNSERVED_GENERATION`` that this kind of model is served with."""
    penalty = generation_config.get("repetition_penalty")
    if penalty is not None and not _positive_number(penalty):
        raise ValueError(
            f"generation_config.json's repetition_penalty must be a number above 0 (1 for "
            f"none), got {penalty!r}"
        )
    ids, mask = _token_inputs(limits.context, limits.vocabulary, limits.pad_value)
    logits = TensorSpec(name="next_token_logits", dtype="float32", shape=(-1, limits.vocabulary))
    defaults = {
        key: generation_config[key] for key in _GENERATION_DEFAULTS if key in generation_config
    }
    return HFVersion(
        task=task,
        artifact=folder / ARTIFACT,
        architecture=architecture,
        inputs=(ids, mask),
        outputs=(logits,),
        handler=None,
        files=files,
        metadata={
            "task": task,
            "source": "transformers save_pretrained",
            "tokenizer_file": "tokenizer.json",
            "eos_token_ids": list(limits.eos),
            "context_tokens": limits.context,
            "generation_defaults": defaults,
        }
        | (metadata or {}),
        left_out=left_out,
        not_applied=_not_applied(generation_config, applied),
    )


def _positive_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def _not_applied(generation_config: dict[str, Any], applied: frozenset[str]) -> tuple[str, ...]:
    """``generation_config.json``'s settings of ``generate`` set to anything but "off" that
    serving does not apply (beyond ``applied``), as ``key=value``: the CLI names them."""
    return tuple(
        f"{key}={generation_config[key]!r}"
        for key, off in _UNSERVED_GENERATION
        if key not in applied and generation_config.get(key, off) not in (off, None)
    )


def _forced_tokens(
    generation_config: dict[str, Any], config: dict[str, Any], vocabulary: int
) -> dict[str, Any]:
    """The first and last tokens ``generate`` forces (BART's checkpoints name both), from
    ``generation_config.json``, else ``config.json``; none when neither names them."""
    forced: dict[str, Any] = {}
    for key in ("forced_bos_token_id", "forced_eos_token_id"):
        value = generation_config.get(key, config.get(key))
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(_token_id(token, vocabulary) for token in ids):
            raise ValueError(
                f"{key} must be a token id in [0, {vocabulary}) or a list of them, got {value!r}"
            )
        forced[key] = value
    if "forced_eos_token_id" in forced:
        eos = forced.pop("forced_eos_token_id")
        forced["forced_eos_token_ids"] = eos if isinstance(eos, list) else [eos]
    return forced


def _token_id(value: object, vocabulary: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocabulary


def _encoder_decoder_context(folder: Path, settings: Any) -> int | None:
    """The most tokens a prompt or a generated sequence may hold: the position embeddings'
    (BART), else the tokenizer's ``model_max_length`` (T5's relative positions have none)."""
    positions = getattr(settings, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return positions
    declared = _json(folder / "tokenizer_config.json", optional=True).get("model_max_length")
    if isinstance(declared, int) and 1 < declared < _NO_LIMIT_TOKENS:
        return declared
    return None


def _bare_model_names(settings: Any) -> tuple[str, ...]:
    """The class ``AutoModel`` builds for the config: the model without a head."""
    import transformers

    try:
        found = transformers.MODEL_MAPPING[type(settings)]
    except KeyError:
        return ()
    classes = found if isinstance(found, tuple) else (found,)
    return tuple(cls.__name__ for cls in classes if cls is not None)


def _labels(settings: Any) -> tuple[str, ...]:
    id2label = settings.id2label or {}
    try:
        indexed = {int(index): str(label) for index, label in id2label.items()}
    except (AttributeError, ValueError):
        raise ValueError(
            f"config.json's id2label must map class indices to names, got {id2label!r}"
        ) from None
    if sorted(indexed) != list(range(len(indexed))) or not indexed:
        raise ValueError(
            f"config.json's id2label must name classes 0 to n-1, got {sorted(indexed)}"
        )
    return tuple(indexed[index] for index in range(len(indexed)))


def _positive_int(settings: Any, key: str) -> int:
    value = getattr(settings, key, None)
    if not (isinstance(value, int) and value > 0):
        named = settings.attribute_map.get(key, key)
        raise ValueError(f"config.json's {named} must be a positive integer, got {value!r}")
    return value


def model_positions(settings: Any) -> int:
    """The most tokens the model's position embeddings hold."""
    positions = _positive_int(settings, "max_position_embeddings")
    if settings.model_type in _OFFSET_POSITIONS:
        positions -= int(settings.pad_token_id or 0) + 1
    return positions


def _text_inputs(
    folder: Path, settings: Any, max_length: int | None, sequence_length: int | None
) -> tuple[tuple[TensorSpec, ...], dict[str, Any]]:
    """Token ids, attention mask and type ids (BERT-like configs whose tokenizer gives them),
    and the handler's options.
    ``sequence_length`` (sentence-transformers' ``max_seq_length``) overrides the tokenizer's
    ``model_max_length``, as it does in ``SentenceTransformer``."""
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{folder.name} has no tokenizer.json; save the tokenizer with a fast tokenizer "
            "(tokenizer.save_pretrained on a PreTrainedTokenizerFast)"
        )
    positions = model_positions(settings)
    tokenizer_config = _json(folder / "tokenizer_config.json", optional=True)
    declared = sequence_length or tokenizer_config.get("model_max_length")
    if max_length is None:
        max_length = min(positions, declared) if isinstance(declared, int) else positions
    elif max_length > positions:
        raise ValueError(
            f"max_length {max_length} is more than the model can hold: its position embeddings "
            f"cover {positions} tokens (config.json's max_position_embeddings); give at most "
            f"{positions}"
        )
    vocabulary = _positive_int(settings, "vocab_size")
    inputs = list(_token_inputs(max_length, vocabulary, int(settings.pad_token_id or 0)))
    type_vocabulary = getattr(settings, "type_vocab_size", None)
    if (
        isinstance(type_vocabulary, int)
        and type_vocabulary > 0
        and "token_type_ids" in _tokenizer_outputs(folder)
    ):
        inputs.append(
            TensorSpec(
                name="token_type_ids",
                dtype="int64",
                shape=(-1, -1),
                max_length=max_length,
                min_value=0,
                max_value=type_vocabulary - 1,
                pad_value=0,
                default_value=0,
            )
        )
    return tuple(inputs), {"tokenizer_file": "tokenizer.json"}


def _tokenizer_outputs(folder: Path) -> list[str]:
    """What ``transformers``' tokenizer of the folder gives the model (``model_input_names``),
    as its pipeline loads it: a tokenizer of no model's own class gives no type ids, and the
    model then takes zeros, also for a text pair."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # transformers raises many kinds
        raise ValueError(
            f"transformers cannot load the tokenizer of {folder.name}: {one_line(error)}"
        ) from error
    return list(tokenizer.model_input_names)


def _image_input(folder: Path, settings: Any) -> tuple[tuple[TensorSpec, ...], dict[str, Any]]:
    """The pixel values input and ``ImageHandler`` options equal to the image processor."""
    processor = _json(folder / "preprocessor_config.json")
    kind = processor.get("image_processor_type")
    if kind not in _RESIZING_PROCESSORS:
        raise ValueError(
            f"image processor {kind!r} is not served by --hf; it serves "
            f"{sorted(_RESIZING_PROCESSORS)} (resize, rescale, normalise)"
        )
    if processor.get("do_center_crop"):
        raise ValueError("preprocessor_config.json asks for do_center_crop, which --hf does not do")
    size = processor.get("size") or {}
    if not (
        processor.get("do_resize", True)
        and isinstance(size, dict)
        and set(size) == {"height", "width"}
    ):
        raise ValueError(
            f"--hf serves image processors resizing to a fixed {{height, width}}, got size {size!r}"
        )
    rescale = processor.get("do_rescale", True), processor.get("rescale_factor", 1 / 255)
    if not rescale[0] or abs(float(rescale[1]) - 1 / 255) > 1e-12:
        raise ValueError(
            "--hf serves image processors scaling pixels to [0, 1] (do_rescale with "
            f"rescale_factor 1/255), got do_rescale={rescale[0]!r}, rescale_factor={rescale[1]!r}"
        )
    resample = processor.get("resample", 2)
    if resample not in _RESAMPLE_NAMES:
        raise ValueError(f"resample {resample!r} is not one of PIL's {sorted(_RESAMPLE_NAMES)}")
    channels = int(getattr(settings, "num_channels", 3))
    if channels != 3:
        raise ValueError(f"--hf serves RGB image models (num_channels 3), got {channels}")
    options: dict[str, Any] = {
        "mode": "RGB",
        "layout": "CHW",
        "resample": _RESAMPLE_NAMES[resample],
    }
    if processor.get("do_normalize", True):
        options["mean"] = [float(value) for value in processor["image_mean"]]
        options["std"] = [float(value) for value in processor["image_std"]]
    spec = TensorSpec(
        name="pixel_values",
        dtype="float32",
        shape=(-1, channels, int(size["height"]), int(size["width"])),
    )
    return (spec,), options
