"""A folder ``sentence-transformers`` saved (it has a ``modules.json``), checked for ``--hf``.

``SentenceTransformer.encode`` runs every module the folder lists, in order; ``--hf`` serves
its transformer as feature extraction, the mean of the last hidden states over the tokens.
That equals ``encode`` only for a ``Transformer`` followed by a mean ``Pooling``, so any other
module (``Normalize``, ``Dense``, a CLS or max pooling...) or setting that changes the
answers (lower-casing, a default prompt) is refused, naming it: served without it, every
answer would be wrong. The transformer's ``max_seq_length``, when the folder sets one, is
the length it truncates to, as ``encode`` truncates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

MODULES_FILE = "modules.json"
#: The Transformer module's settings that leave ``encode``'s answers as --hf gives them.
_SERVED_TRANSFORMER_SETTINGS: dict[str, Any] = {
    "transformer_task": "feature-extraction",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "module_output_name": "token_embeddings",
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
SERVED = (
    "--hf serves a sentence-transformers folder whose modules.json lists a Transformer (saved "
    "in the folder itself) followed by a Pooling with pooling_mode 'mean' and no default "
    "prompt: the mean of the last hidden states over the tokens"
)


@dataclass(frozen=True)
class SentenceTransformersFolder:
    """What ``encode`` does beyond the transformer that --hf must do too."""

    max_seq_length: int | None
    """The transformer's ``max_seq_length`` from ``sentence_bert_config.json``, when set."""


def sentence_transformers_folder(folder: Path) -> SentenceTransformersFolder | None:
    """``None`` for a folder without ``modules.json``; else its settings, when --hf serves
    every module exactly. ``ValueError`` names each module or setting it would not apply."""
    if not (folder / MODULES_FILE).is_file():
        return None
    modules = _json(folder / MODULES_FILE)
    if not (isinstance(modules, list) and all(isinstance(m, dict) for m in modules)):
        raise ValueError(f"{MODULES_FILE} must hold a list of modules, got {modules!r}")
    problems: list[str] = []
    max_seq_length: int | None = None
    for index, module in enumerate(modules):
        kind = str(module.get("type", ""))
        path = str(module.get("path", ""))
        where = f"{path or 'the folder'} ({kind.rsplit('.', 1)[-1] or 'no type'})"
        if index == 0 and _is(kind, "Transformer"):
            if path not in ("", "."):
                problems.append(f"{where}: saved in a sub-folder, not the folder itself")
                continue
            settings, wrong = _transformer_settings(folder)
            problems.extend(f"{where}: {setting}" for setting in wrong)
            max_seq_length = settings.get("max_seq_length")
        elif index == 1 and _is(kind, "Pooling"):
            modes = _pooling_modes(_json_object(folder / path / "config.json"))
            if modes != ["mean"]:
                problems.append(f"{where}: pooling_mode {modes}")
        else:
            problems.append(where)
    if len(modules) < 2 and not problems:
        problems.append("no Pooling module after the Transformer")
    problems.extend(_prompt_problems(folder))
    if problems:
        raise ValueError(
            f"{folder.name} is a sentence-transformers model with modules or settings --hf "
            f"would not apply, so its answers would differ from SentenceTransformer.encode: "
            f"{'; '.join(problems)}. {SERVED}; Normalize, Dense and other poolings are not "
            "served yet"
        )
    return SentenceTransformersFolder(max_seq_length=max_seq_length)


def _is(kind: str, name: str) -> bool:
    """A module of sentence-transformers itself named ``name`` (never a module of yours)."""
    return kind.startswith("sentence_transformers.") and kind.rsplit(".", 1)[-1] == name


def _transformer_settings(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """``sentence_bert_config.json`` and, in words, each setting --hf would not apply."""
    path = folder / "sentence_bert_config.json"
    settings = _json_object(path) if path.is_file() else {}
    wrong = []
    for key, value in settings.items():
        if key in _NEUTRAL_TRANSFORMER_SETTINGS or (key == "processing_kwargs" and not value):
            continue
        if key not in _SERVED_TRANSFORMER_SETTINGS or value != _SERVED_TRANSFORMER_SETTINGS[key]:
            wrong.append(f"{key}={value!r}")
    length = settings.get("max_seq_length")
    if length is not None and not (isinstance(length, int) and length > 0):
        wrong.append(f"max_seq_length={length!r} (a positive integer)")
    return settings, wrong


def _pooling_modes(config: dict[str, Any]) -> list[str]:
    """The pooling's modes, read as sentence-transformers reads new and old configs."""
    mode = config.get("pooling_mode")
    if mode is None:
        active = [name for flag, name in _LEGACY_POOLING_FLAGS.items() if config.get(flag)]
        return active or ["mean"]
    return [mode] if isinstance(mode, str) else [str(name) for name in mode]


def _prompt_problems(folder: Path) -> list[str]:
    """``encode`` prepends a default prompt, or the folder is another kind of model."""
    path = folder / "config_sentence_transformers.json"
    if not path.is_file():
        return []
    config = _json_object(path)
    problems = []
    if config.get("default_prompt_name"):
        problems.append(f"default_prompt_name={config['default_prompt_name']!r}")
    if config.get("model_type", "SentenceTransformer") != "SentenceTransformer":
        problems.append(f"model_type={config['model_type']!r}")
    return problems


def _json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(
            f"{path.parent.name} has no {path.name}, which {MODULES_FILE} names"
        ) from None
    except orjson.JSONDecodeError as error:
        raise ValueError(f"{path.name} is not valid JSON: {error}") from None


def _json_object(path: Path) -> dict[str, Any]:
    document = _json(path)
    if not isinstance(document, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return document
