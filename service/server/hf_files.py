"""Which files of a ``save_pretrained`` folder a ``--hf`` version holds, and how its JSON files
are read.

A version holds what describes and serves the model: its config, its weights
(``model.safetensors``), the tokenizer's files, the image processor's, generation settings, a
chat template, ``sentence-transformers``' module list. What else a training run leaves in the
folder (``pytorch_model.bin`` beside the safetensors, ``training_args.bin``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, pickles, ``auto_map`` code, logs) is
never loaded, so it is left out of the version and of its id, and named with the reason.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

#: Files a version keeps, besides its artifact.
SERVED_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "spiece.model",
        "sentencepiece.bpe.model",
        "tokenizer.model",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.jinja",
        "chat_template.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
    }
)
_WEIGHTS = frozenset({".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors", ".onnx"})
_PICKLES = frozenset({".pkl", ".pickle", ".joblib"})


@dataclass(frozen=True)
class FolderFiles:
    kept: tuple[Path, ...]
    """The files packaged besides the artifact."""
    left_out: tuple[str, ...]
    """Each file or folder left out, with why: ``"optimizer.pt (...)"``."""


def folder_files(folder: Path, artifact: str, modules: Collection[str] = ()) -> FolderFiles:
    """Split ``folder``'s entries into the files a version holds and the rest. ``modules``:
    sentence-transformers' module folders (``1_Pooling``), read into the version when it is
    packaged (their settings into its manifest, their weights into its artifact)."""
    kept, left_out = [], []
    for path in sorted(folder.iterdir()):
        if path.name == artifact:
            continue
        if path.is_file() and path.name in SERVED_FILES:
            kept.append(path)
        elif path.name in modules:
            left_out.append(
                f"{path.name} (a sentence-transformers module: its settings are in the "
                "version's manifest, its weights in its artifact)"
            )
        else:
            left_out.append(f"{path.name} ({_why_left_out(path, artifact)})")
    return FolderFiles(kept=tuple(kept), left_out=tuple(left_out))


def _why_left_out(path: Path, artifact: str) -> str:
    if path.is_dir():
        return "a folder"
    suffix = path.suffix.lower()
    if suffix in _WEIGHTS:
        return f"weights or training state; the version loads {artifact} alone"
    if suffix in _PICKLES:
        return "a pickle, never loaded"
    if suffix == ".py":
        return "code, never run"
    return "not read when serving"


def read_json(path: Path, missing: str) -> Any:
    """The document in ``path``; ``ValueError`` naming the file when it is not there (followed
    by ``missing``: why it should be) or not JSON."""
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"{path.parent.name} has no {path.name}{missing}") from None
    except orjson.JSONDecodeError as error:
        raise ValueError(f"{path.name} is not valid JSON: {error}") from None


def read_json_object(path: Path, missing: str = "", *, optional: bool = False) -> dict[str, Any]:
    """``read_json`` of a file that must hold an object; ``{}`` for an ``optional`` one that
    is not there."""
    if optional and not path.is_file():
        return {}
    document = read_json(path, missing)
    if not isinstance(document, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return document
