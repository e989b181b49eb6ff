"""``KEY=VALUE`` settings files: what ``batchserve tune --out`` writes and ``batchserve serve
--env-file`` reads, in the format ``docker run --env-file`` reads.

One ``BATCHSERVE_*`` variable a line; blank lines and lines starting with ``#`` are skipped;
the value is everything after the first ``=``, taken literally (no quotes, no expansion), as
Docker does. Only settings are accepted, each named once, so a typo fails at start-up rather
than being silently ignored. The environment wins over the file (as ``docker run -e`` wins
over ``--env-file``), and flags win over both.

A file's ``BATCHSERVE_MODEL_VERSION`` is a version of the model the file names
(``BATCHSERVE_MODEL_NAME``): when the environment or a flag names another model to serve, the
file's model and version are left out and its other settings still apply, so tuned settings
serve another model rather than stopping with "model 'other' has no version ...".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from service.config import ENV_PREFIX, Settings, SettingsError

_NAMES = {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of ``path``; ``SettingsError`` naming the line of anything else."""
    try:
        text = path.read_text()
    except OSError as error:
        raise SettingsError(f"cannot read the env file {str(path)!r}: {error.strerror}") from None
    variables: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key = key.strip()
        where = f"{path}:{number}"
        if not equals:
            raise SettingsError(f"{where}: expected KEY=VALUE, got {line!r}")
        if key not in _NAMES:
            raise SettingsError(
                f"{where}: {key!r} is not a batchserve setting (BATCHSERVE_* as listed in "
                "docs/configuration.md)"
            )
        if key in variables:
            raise SettingsError(f"{where}: {key} is set twice; set it once")
        variables[key] = value
    return variables


MODEL_NAME = ENV_PREFIX + "MODEL_NAME"
MODEL_VERSION = ENV_PREFIX + "MODEL_VERSION"
MODELS = ENV_PREFIX + "MODELS"


def apply_env_file(
    path: Path,
    environ: MutableMapping[str, str] = os.environ,
    flags: Mapping[str, object] | None = None,
) -> list[str]:
    """Set the file's variables in ``environ`` where it does not set them already (so every
    process started later reads them too); ``flags`` are the settings given on the command
    line (by field name), which win too. Returns the names taken from the file."""
    variables = read_env_file(path)
    if _serves_another_model(variables, environ, flags or {}):
        variables.pop(MODEL_NAME, None)
        variables.pop(MODEL_VERSION, None)
    taken = []
    for key, value in variables.items():
        if key not in environ:
            environ[key] = value
            taken.append(key)
    return taken


def _serves_another_model(
    variables: Mapping[str, str], environ: Mapping[str, str], flags: Mapping[str, object]
) -> bool:
    """Whether the model served is named elsewhere than the file, and is not the file's."""
    if MODEL_NAME not in variables:
        return False
    if flags.get("models") or environ.get(MODELS):
        return True
    named = flags.get("model_name") or environ.get(MODEL_NAME)
    return named is not None and named != variables[MODEL_NAME]


def render_env_file(variables: Mapping[str, str], comments: Sequence[str] = ()) -> str:
    """``# comment`` lines, then ``KEY=VALUE`` lines sorted by name."""
    for key, value in variables.items():
        if "\n" in value or key not in _NAMES:
            raise ValueError(f"cannot write {key}={value!r} to an env file")
    lines = [f"# {comment}" for comment in comments]
    lines += [f"{key}={variables[key]}" for key in sorted(variables)]
    return "\n".join(lines) + "\n"
