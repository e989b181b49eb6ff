"""``KEY=VALUE`` settings files: ``batchserve serve --env-file`` reads what ``tune`` writes,
in ``docker run --env-file``'s format; the environment wins over the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.config import SettingsError, load_settings
from service.server.cli import main
from service.server.env_file import apply_env_file, read_env_file, render_env_file


def test_render_then_read_gives_the_same_variables(tmp_path: Path) -> None:
    variables = {"BATCHSERVE_MAX_WAIT_MS": "2.5", "BATCHSERVE_LENGTH_BUCKETS": "16,64,512"}
    path = tmp_path / "tuned.env"
    path.write_text(render_env_file(variables, ["tuned on 2 cores"]))
    assert path.read_text().splitlines()[0] == "# tuned on 2 cores"
    assert read_env_file(path) == variables


def test_values_are_literal_after_the_first_equals_sign(tmp_path: Path) -> None:
    path = tmp_path / "a.env"
    path.write_text('\n# comment\nBATCHSERVE_ADMIN_TOKEN="a=b c"\n   \n')
    assert read_env_file(path) == {"BATCHSERVE_ADMIN_TOKEN": '"a=b c"'}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("BATCHSERVE_MAX_WAIT_MS\n", "a.env:1: expected KEY=VALUE, got 'BATCHSERVE_MAX_WAIT_MS'"),
        ("\nBATCHSERVE_MAX_WAITMS=1\n", "a.env:2: 'BATCHSERVE_MAX_WAITMS' is not a batchserve"),
        ("PATH=/tmp\n", "'PATH' is not a batchserve setting"),
        ("BATCHSERVE_WORKERS=1\nBATCHSERVE_WORKERS=2\n", "BATCHSERVE_WORKERS is set twice"),
    ],
)
def test_a_bad_line_is_refused_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "a.env"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        read_env_file(path)


def test_the_environment_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.env"
    path.write_text("BATCHSERVE_MAX_BATCH_SIZE=8\nBATCHSERVE_MAX_WAIT_MS=2\n")
    environ = {"BATCHSERVE_MAX_BATCH_SIZE": "16"}
    assert apply_env_file(path, environ) == ["BATCHSERVE_MAX_WAIT_MS"]
    assert environ == {"BATCHSERVE_MAX_BATCH_SIZE": "16", "BATCHSERVE_MAX_WAIT_MS": "2"}


def unset_restored_after(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset ``names`` now and restore them after the test, whatever the test sets."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_file_is_read_as_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.env"
    path.write_text("BATCHSERVE_MAX_BATCH_SIZE=8\nBATCHSERVE_BATCH_POLICY=fixed\n")
    unset_restored_after(monkeypatch, "BATCHSERVE_MAX_BATCH_SIZE", "BATCHSERVE_BATCH_POLICY")
    apply_env_file(path)
    settings = load_settings(max_batch_size=4)  # a flag wins over both
    assert (settings.max_batch_size, settings.batch_policy) == (4, "fixed")


def test_serve_refuses_a_bad_env_file_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    unset_restored_after(monkeypatch, "BATCHSERVE_MAX_BATCH_SIZE")
    path = tmp_path / "bad.env"
    path.write_text("BATCHSERVE_MAX_BATCH_SIZE=0\n")
    assert main(["serve", "--env-file", str(path)]) == 2
    assert "BATCHSERVE_MAX_BATCH_SIZE = '0'" in capsys.readouterr().err
    assert main(["serve", "--env-file", str(tmp_path / "missing.env")]) == 2
    assert "cannot read the env file" in capsys.readouterr().err


TUNED = (
    "BATCHSERVE_MODEL_NAME=digits\n"
    "BATCHSERVE_MODEL_VERSION=dae3cd981a36\n"
    "BATCHSERVE_MAX_BATCH_SIZE=8\n"
)


@pytest.mark.parametrize(
    ("flags", "environ"),
    [
        ({"model_name": "textenc"}, {}),
        ({}, {"BATCHSERVE_MODEL_NAME": "textenc"}),
        ({"models": ("textenc",)}, {}),
        ({}, {"BATCHSERVE_MODELS": "textenc"}),
    ],
)
def test_the_files_version_is_left_out_when_another_model_is_served(
    tmp_path: Path, flags: dict[str, object], environ: dict[str, str]
) -> None:
    """Issue 37, item 1: ``--env-file tuned.env --model-name other`` stopped with "model
    'other' has no version 'dae3cd981a36'": the version belongs to the file's model."""
    path = tmp_path / "tuned.env"
    path.write_text(TUNED)
    assert apply_env_file(path, environ, flags) == ["BATCHSERVE_MAX_BATCH_SIZE"]
    assert "BATCHSERVE_MODEL_VERSION" not in environ
    assert environ["BATCHSERVE_MAX_BATCH_SIZE"] == "8"


@pytest.mark.parametrize(
    ("flags", "environ"),
    [({}, {}), ({"model_name": "digits"}, {}), ({}, {"BATCHSERVE_MODEL_NAME": "digits"})],
)
def test_the_files_version_applies_to_the_files_model(
    tmp_path: Path, flags: dict[str, object], environ: dict[str, str]
) -> None:
    path = tmp_path / "tuned.env"
    path.write_text(TUNED)
    apply_env_file(path, environ, flags)
    assert environ["BATCHSERVE_MODEL_VERSION"] == "dae3cd981a36"


def test_serve_with_another_models_name_takes_the_tuned_settings_but_not_the_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the command line: the flag naming the model is seen before the file applies.
    (A port of 0 stops the start once the settings are read.)"""
    unset_restored_after(
        monkeypatch,
        "BATCHSERVE_MODEL_NAME",
        "BATCHSERVE_MODEL_VERSION",
        "BATCHSERVE_MODELS",
        "BATCHSERVE_MAX_BATCH_SIZE",
    )
    path = tmp_path / "tuned.env"
    path.write_text(TUNED)
    assert main(["serve", "--env-file", str(path), "--model-name", "textenc", "--port", "0"]) == 2
    assert "BATCHSERVE_PORT = '0'" in capsys.readouterr().err
    assert "BATCHSERVE_MODEL_VERSION" not in os.environ
    assert os.environ["BATCHSERVE_MAX_BATCH_SIZE"] == "8"
