"""A folder ``sentence-transformers`` saved, read for ``--hf`` so that it answers as the library.

``SentenceTransformer.encode`` runs every module ``modules.json`` lists, in order: the
transformer (saved in the folder itself), a ``Pooling`` (CLS, mean, max, last token, weighted
mean, mean over the square root of the length, or several concatenated; with or without the
prompt's tokens), then ``Dense`` layers and ``Normalize`` in any order, and the folder's
``truncate_dim``. They become the version's ``steps`` (``service/engine/sentence_modules.py``
runs them), each ``Dense``'s ``model.safetensors`` goes into the version's artifact beside the
transformer's weights, and ``config_sentence_transformers.json`` gives the named prompts, the
default one and the similarity function. A folder ``CrossEncoder`` saved (a transformer alone,
``model_type`` ``CrossEncoder``) is a reranker: its activation is read here too, also from the
``config.json`` of a ``CrossEncoder`` saved before sentence-transformers 6.

Anything else (another module, lower-casing, a module of your own, a pickled ``Dense``) is
refused, naming it: served without it, every answer would be wrong. The transformer's
``max_seq_length``, when the folder sets one, is the length it truncates to, as ``encode``
truncates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from service.server.hf_files import read_json, read_json_object

MODULES_FILE = "modules.json"
SETTINGS_FILE = "config_sentence_transformers.json"
MODULE_WEIGHTS = "model.safetensors"
_NAMED_BY_MODULES = f", which {MODULES_FILE} names"
ModelType = Literal["SentenceTransformer", "CrossEncoder"]
#: What the Transformer module of each model type hands on (``sentence_bert_config.json``).
_TRANSFORMER_OUTPUTS: dict[str, dict[str, Any]] = {
    "SentenceTransformer": {
        "transformer_task": "feature-extraction",
        "modality_config": {
            "text": {"method": "forward", "method_output_name": "last_hidden_state"}
        },
        "module_output_name": "token_embeddings",
    },
    "CrossEncoder": {
        "transformer_task": "sequence-classification",
        "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
        "module_output_name": "scores",
    },
}
#: The Transformer module's settings that leave the answers as --hf gives them.
_PLAIN_TRANSFORMER_SETTINGS: dict[str, Any] = {
    "processing_kwargs": {},
    "do_lower_case": False,
    "query_length": None,
    "document_length": None,
    "query_expansion": None,
}
#: Settings that change how it runs, not what it answers.
_NEUTRAL_TRANSFORMER_SETTINGS = frozenset({"unpad_inputs", "max_seq_length"})
#: Pooling's boolean flags before sentence-transformers 6 (``pooling_mode_mean_tokens``...).
_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_POOLING_KEYS = frozenset(
    {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt"}
    | set(_LEGACY_POOLING_FLAGS)
)
_DENSE_KEYS = frozenset(
    {
        "in_features",
        "out_features",
        "bias",
        "activation_function",
        "module_input_name",
        "module_output_name",
        "use_residual",
    }
)
_VECTOR = "sentence_embedding"
#: Activations a reranker's scores may get (the front end applies them).
SCORE_ACTIVATIONS = frozenset({"Identity", "Sigmoid", "Tanh"})
_SIMILARITIES = frozenset({"cosine", "dot", "euclidean", "manhattan"})
#: ``config_sentence_transformers.json``'s keys, by what they change.
_SETTINGS_READ = frozenset(
    {"model_type", "prompts", "default_prompt_name", "similarity_fn_name", "truncate_dim"}
    | {"activation_fn"}
)
#: ``keep_in_fp32_modules``: runs layers in fp32 under autocast; the answers at fp32 are the same.
_SETTINGS_NEUTRAL = frozenset({"__version__", "keep_in_fp32_modules"})
SERVED = (
    "--hf serves sentence-transformers folders whose modules.json lists a Transformer saved in "
    "the folder itself, then a Pooling (any pooling_mode), then Dense (weights in "
    "model.safetensors) and Normalize modules; and CrossEncoder folders (a Transformer alone)"
)


@dataclass(frozen=True)
class SentenceTransformersFolder:
    """What ``encode`` (or ``CrossEncoder.predict``) does beyond the transformer."""

    model_type: ModelType
    max_seq_length: int | None
    """The transformer's ``max_seq_length`` from ``sentence_bert_config.json``, when set."""
    steps: tuple[dict[str, Any], ...] = ()
    """A SentenceTransformer's pooling, then its vector steps (``sentence_modules``)."""
    dimensions: int | None = None
    """The length of its embeddings: what the last step gives."""
    pooled_dimensions: int | None = None
    """What its pooling is given per token (the transformer's hidden size)."""
    head_weights: tuple[tuple[str, Path], ...] = ()
    """Each Dense's weights: the prefix of their keys in the state dict, and the file."""
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    activation: str | None = None
    """A CrossEncoder's activation (a ``torch.nn`` class name), when the folder names one."""
    module_folders: tuple[str, ...] = ()
    """The modules' sub-folders, read into the steps and the artifact."""


def sentence_transformers_folder(folder: Path) -> SentenceTransformersFolder | None:
    """``None`` for a folder without ``modules.json``; else what ``encode`` does with it.
    ``ValueError`` names each module or setting --hf would not apply."""
    if not (folder / MODULES_FILE).is_file():
        return None
    modules = read_json(folder / MODULES_FILE, _NAMED_BY_MODULES)
    if not (isinstance(modules, list) and all(isinstance(m, dict) for m in modules)):
        raise ValueError(f"{MODULES_FILE} must hold a list of modules, got {modules!r}")
    problems: list[str] = []
    settings = _settings(folder, problems)
    model_type = settings.get("model_type", "SentenceTransformer")
    if model_type not in _TRANSFORMER_OUTPUTS:
        problems.append(f"model_type={model_type!r}")
        model_type = "SentenceTransformer"
    reader = _ModulesReader(folder, model_type, problems)
    for index, module in enumerate(modules):
        reader.read(index, module)
    reader.finish(len(modules), settings.get("truncate_dim"))
    if problems:
        raise ValueError(
            f"{folder.name} is a sentence-transformers model with modules or settings --hf "
            f"would not apply, so its answers would differ from sentence-transformers': "
            f"{'; '.join(problems)}. {SERVED}"
        )
    return SentenceTransformersFolder(
        model_type=model_type,
        max_seq_length=reader.max_seq_length,
        steps=tuple(reader.steps),
        dimensions=reader.dimensions,
        pooled_dimensions=reader.pooled_dimensions,
        head_weights=tuple(reader.head_weights),
        module_folders=tuple(reader.module_folders),
        prompts=dict(settings.get("prompts") or {}),
        default_prompt_name=settings.get("default_prompt_name"),
        similarity_fn_name=settings.get("similarity_fn_name"),
        activation=_activation_name(settings.get("activation_fn"), SCORE_ACTIVATIONS),
    )


def cross_encoder_activation(config: dict[str, Any]) -> str | None:
    """The activation a ``CrossEncoder`` saved before sentence-transformers 6 named in its
    ``config.json`` (``sentence_transformers.activation_fn``, or before 4
    ``sbert_ce_default_activation_function``); ``None`` when it names none."""
    saved = config.get("sentence_transformers")
    path = saved.get("activation_fn") if isinstance(saved, dict) else None
    if path is None:
        path = config.get("sbert_ce_default_activation_function")
    name = _activation_name(path, SCORE_ACTIVATIONS)
    if path is not None and name is None:
        raise ValueError(
            _activation_refusal("config.json's activation_fn", path, SCORE_ACTIVATIONS)
        )
    return name


def head_prefix(step: int) -> str:
    """The state-dict prefix of step ``step``'s weights (the pooling is step 0), as
    ``hf_model.SentenceTransformersModel`` names them."""
    return f"head.steps.{step - 1}."


def write_weights(transformer: Path, head: tuple[tuple[str, Path], ...], target: Path) -> None:
    """One safetensors file at ``target``: the transformer's weights and, under their
    prefixes, each Dense layer's (read as safetensors: never unpickled)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(transformer)
    for prefix, path in head:
        tensors.update({prefix + key: value for key, value in load_file(path).items()})
    save_file(tensors, target, metadata={"format": "pt"})


class _ModulesReader:
    """Reads ``modules.json``'s modules one after the other, into steps or problems."""

    def __init__(self, folder: Path, model_type: str, problems: list[str]) -> None:
        self.folder = folder
        self.model_type = model_type
        self.problems = problems
        self.max_seq_length: int | None = None
        self.steps: list[dict[str, Any]] = []
        self.head_weights: list[tuple[str, Path]] = []
        self.dimensions: int | None = None
        self.pooled_dimensions: int | None = None
        self.module_folders: list[str] = []

    def read(self, index: int, module: dict[str, Any]) -> None:
        kind = str(module.get("type", ""))
        path = str(module.get("path", ""))
        if index > 0 and path:
            self.module_folders.append(path)
        where = f"{path or 'the folder'} ({kind.rsplit('.', 1)[-1] or 'no type'})"
        if index == 0 and _is(kind, "Transformer"):
            if path not in ("", "."):
                self.problems.append(f"{where}: saved in a sub-folder, not the folder itself")
            else:
                self._transformer(where)
        elif self.model_type == "CrossEncoder":
            self.problems.append(f"{where}: a CrossEncoder is served as its Transformer alone")
        elif index == 1 and _is(kind, "Pooling"):
            self._pooling(where, self.folder / path)
        elif index > 1 and _is(kind, "Dense"):
            self._dense(where, self.folder / path)
        elif index > 1 and _is(kind, "Normalize"):
            self._normalize(where, self.folder / path)
        else:
            self.problems.append(where)

    def finish(self, count: int, truncate_dim: object) -> None:
        if self.model_type == "CrossEncoder" or self.problems:
            return
        if count < 2:
            self.problems.append("no Pooling module after the Transformer")
            return
        if truncate_dim is not None:
            if not (isinstance(truncate_dim, int) and truncate_dim > 0):
                self.problems.append(f"truncate_dim={truncate_dim!r} (a positive integer)")
            elif self.dimensions is not None and truncate_dim < self.dimensions:
                self.steps.append({"kind": "truncate", "dimensions": truncate_dim})
                self.dimensions = truncate_dim

    def _transformer(self, where: str) -> None:
        settings = _json_object(self.folder / "sentence_bert_config.json", optional=True)
        served = {**_PLAIN_TRANSFORMER_SETTINGS, **_TRANSFORMER_OUTPUTS[self.model_type]}
        for key, value in settings.items():
            if key in _NEUTRAL_TRANSFORMER_SETTINGS or (key == "processing_kwargs" and not value):
                continue
            if key not in served or value != served[key]:
                self.problems.append(f"{where}: {key}={value!r}")
        length = settings.get("max_seq_length")
        if length is not None and not (isinstance(length, int) and length > 0):
            self.problems.append(f"{where}: max_seq_length={length!r} (a positive integer)")
        elif length is not None:
            self.max_seq_length = length

    def _pooling(self, where: str, path: Path) -> None:
        config = _json_object(path / "config.json")
        unknown = sorted(set(config) - _POOLING_KEYS)
        if unknown:
            self.problems.append(f"{where}: settings {unknown}")
        modes = _pooling_modes(config)
        wrong = [mode for mode in modes if mode not in _LEGACY_POOLING_FLAGS.values()]
        if wrong or not modes:
            self.problems.append(f"{where}: pooling_mode {modes}")
        dimensions = config.get("embedding_dimension", config.get("word_embedding_dimension"))
        if not (isinstance(dimensions, int) and dimensions > 0):
            self.problems.append(f"{where}: embedding_dimension={dimensions!r}")
            return
        include_prompt = config.get("include_prompt", True)
        if not isinstance(include_prompt, bool):
            self.problems.append(f"{where}: include_prompt={include_prompt!r}")
        self.pooled_dimensions = dimensions
        self.dimensions = dimensions * len(modes)
        self.steps.append({"kind": "pooling", "modes": modes, "include_prompt": include_prompt})

    def _dense(self, where: str, path: Path) -> None:
        from service.engine.sentence_modules import ACTIVATIONS as DENSE_ACTIVATIONS

        config = _json_object(path / "config.json")
        unknown = sorted(set(config) - _DENSE_KEYS)
        if unknown:
            self.problems.append(f"{where}: settings {unknown}")
        if not self._on_the_vector(where, config):
            return
        sizes = config.get("in_features"), config.get("out_features")
        if not all(isinstance(size, int) and size > 0 for size in sizes):
            self.problems.append(f"{where}: in_features, out_features = {sizes}")
            return
        if sizes[0] != self.dimensions:
            self.problems.append(
                f"{where}: in_features {sizes[0]} after a step giving {self.dimensions}"
            )
        # A Dense saved without one applies Tanh, the default of sentence-transformers' Dense.
        activation_path = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        activation = _activation_name(activation_path, DENSE_ACTIVATIONS)
        if activation is None:
            self.problems.append(
                f"{where}: " + _activation_refusal("activation", activation_path, DENSE_ACTIVATIONS)
            )
        weights = path / MODULE_WEIGHTS
        if not weights.is_file():
            found = sorted(p.name for p in path.iterdir() if p.is_file()) if path.is_dir() else []
            self.problems.append(
                f"{where}: no {MODULE_WEIGHTS} (found {found}); --hf never unpickles "
                "pytorch_model.bin: load the folder with sentence-transformers and save it into "
                "a new folder (SentenceTransformer(folder).save(new) writes model.safetensors), "
                "then package the new folder"
            )
        self.head_weights.append((head_prefix(len(self.steps)), weights))
        self.steps.append(
            {
                "kind": "dense",
                "in_features": sizes[0],
                "out_features": sizes[1],
                "bias": bool(config.get("bias", True)),
                "activation": activation,
                "residual": bool(config.get("use_residual", False)),
            }
        )
        self.dimensions = sizes[1]

    def _normalize(self, where: str, path: Path) -> None:
        config = _json_object(path / "config.json", optional=True)
        if self._on_the_vector(where, config):
            self.steps.append({"kind": "normalize"})

    def _on_the_vector(self, where: str, config: dict[str, Any]) -> bool:
        """Whether the module reads and writes the pooled embedding (not the tokens')."""
        names = {key: config.get(key) for key in ("module_input_name", "module_output_name")}
        wrong = {key: name for key, name in names.items() if name not in (None, _VECTOR)}
        if wrong:
            self.problems.append(f"{where}: {wrong}")
        return not wrong and bool(self.steps)


def _is(kind: str, name: str) -> bool:
    """A module of sentence-transformers itself named ``name`` (never a module of yours)."""
    return kind.startswith("sentence_transformers.") and kind.rsplit(".", 1)[-1] == name


def _pooling_modes(config: dict[str, Any]) -> list[str]:
    """The pooling's modes, read as sentence-transformers reads new and old configs."""
    mode = config.get("pooling_mode")
    if mode is None:
        active = [name for flag, name in _LEGACY_POOLING_FLAGS.items() if config.get(flag)]
        return active or ["mean"]
    return [mode] if isinstance(mode, str) else [str(name) for name in mode]


def _settings(folder: Path, problems: list[str]) -> dict[str, Any]:
    """``config_sentence_transformers.json``, checked: the keys read, each of the right kind."""
    config = _json_object(folder / SETTINGS_FILE, optional=True)
    unknown = sorted(set(config) - _SETTINGS_READ - _SETTINGS_NEUTRAL)
    if unknown:
        problems.append(f"{SETTINGS_FILE}: settings {unknown}")
    prompts = config.get("prompts") or {}
    if not (isinstance(prompts, dict) and all(isinstance(p, str) for p in prompts.values())):
        problems.append(f"prompts={prompts!r} (names to strings)")
        config["prompts"] = {}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        problems.append(f"default_prompt_name={default!r}, not one of the prompts {list(prompts)}")
    similarity = config.get("similarity_fn_name")
    if similarity is not None and similarity not in _SIMILARITIES:
        problems.append(f"similarity_fn_name={similarity!r}, not one of {sorted(_SIMILARITIES)}")
    activation = config.get("activation_fn")
    if activation is not None and _activation_name(activation, SCORE_ACTIVATIONS) is None:
        problems.append(_activation_refusal("activation_fn", activation, SCORE_ACTIVATIONS))
    return config


def _activation_name(path: object, allowed: frozenset[str]) -> str | None:
    """``torch.nn.modules.activation.Sigmoid`` -> ``Sigmoid``, when it is one of ``allowed``."""
    if not (isinstance(path, str) and path.startswith("torch.nn.")):
        return None
    name = path.rsplit(".", 1)[-1]
    return name if name in allowed else None


def _activation_refusal(what: str, path: object, allowed: frozenset[str]) -> str:
    return (
        f"{what}={path!r}: --hf applies the torch.nn activations {sorted(allowed)} "
        "(torch.nn.modules.activation.Sigmoid...)"
    )


def _json_object(path: Path, *, optional: bool = False) -> dict[str, Any]:
    return read_json_object(path, _NAMED_BY_MODULES, optional=optional)
