"""The shell examples of docs/models.md run as written.

The blocks marked ``<!-- run by tests/test_docs_examples.py -->`` are run in order, in a
folder holding the tiny models of ``tests/hf_folders.py`` under the names the page uses:
``batchserve package`` through the CLI's ``main``, ``batchserve serve`` as an in-process server
configured by the line's variables, each ``curl`` line by bash. Two things are replaced: a
temporary repository for ``/srv/models`` and a free port for ``localhost:8000``. Each answer
must equal the one the page shows (the same labels, words and places; numbers to 1e-4; the
version id that packaging printed). Every other block is checked for what made examples fail
as written: a command that writes a repository without ``--repository`` (in a clone, the
default is the project's own ``models/`` folder) and a ``curl`` that sends a body without a
content type (415).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from service.config import load_settings
from service.server.cli import main
from service.server.draining import uvicorn_config
from service.server.single import create_app
from tests.fixtures import uvicorn_port
from tests.hf_folders import (
    TEXT_TASKS,
    save_cross_encoder,
    save_image_model,
    save_sentence_transformer,
    save_text_model,
)

pytest.importorskip("transformers")

pytestmark = [
    # transformers 5 says, once, that it falls back from torchvision to Pillow.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

PAGE = Path(__file__).parent.parent / "docs" / "models.md"
MARKER = "<!-- run by tests/test_docs_examples.py -->"
REPOSITORY, ADDRESS = "/srv/models", "localhost:8000"
TOLERANCE = 1e-4
#: Commands that write into a repository.
WRITERS = ("batchserve package", "batchserve export")


@dataclass
class Step:
    command: str
    """As the page writes it (continued lines and quotes over several lines kept)."""
    shown: list[str] = field(default_factory=list)
    """The lines the page shows after it: its answer."""


def shell_blocks(page: str) -> list[tuple[bool, str]]:
    """Each ``sh`` block of the page, and whether it is marked to be run."""
    pattern = re.compile(rf"(?:({re.escape(MARKER)})\n)?```sh\n(.*?)```", re.DOTALL)
    return [(bool(match.group(1)), match.group(2)) for match in pattern.finditer(page)]


def steps(block: str) -> list[Step]:
    """The block's commands, each with the lines shown after it (comment lines skipped)."""
    found: list[Step] = []
    pending: str | None = None
    for line in block.splitlines():
        if pending is not None:
            pending += "\n" + line
        elif line.startswith(("batchserve ", "curl ", "BATCHSERVE_")):
            pending = line
        elif not line.startswith("#") and found:
            found[-1].shown.append(line)
            continue
        else:
            continue
        if _complete(pending):
            found.append(Step(pending))
            pending = None
    assert pending is None, f"an unfinished command: {pending}"
    return found


def _complete(command: str) -> bool:
    if command.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(command, comments=True)
    except ValueError:  # a quote still open
        return False
    return True


def words(command: str) -> list[str]:
    return shlex.split(command.replace("\\\n", " "), comments=True)


def test_every_example_names_its_repository_and_its_body_type() -> None:
    page = PAGE.read_text()
    commands = [step.command for _, block in shell_blocks(page) for step in steps(block)]
    assert any(command.startswith(WRITERS) for command in commands)
    for command in commands:
        argv = words(command)
        if command.startswith(WRITERS):
            assert "--repository" in argv, f"writes into the default repository: {command}"
        if "serve" in argv:
            assert any(word.startswith("BATCHSERVE_MODEL_REPOSITORY=") for word in argv), command
        if argv[0] == "curl" and {"-d", "--data", "--data-binary"} & set(argv):
            headers = [argv[i + 1].lower() for i, word in enumerate(argv) if word == "-H"]
            assert any(h.startswith("content-type:") for h in headers), f"415: {command}"


def same(got: Any, shown: Any, versions: dict[str, str], where: str = "answer") -> None:
    """``got`` equals ``shown``: numbers to the tolerance, a version id as packaging printed."""
    if isinstance(shown, dict):
        assert isinstance(got, dict), (where, got)
        assert set(got) == set(shown), (where, got, shown)
        for key, value in shown.items():
            if key == "version":
                assert re.fullmatch("[0-9a-f]{12}", value), (where, value)
                assert got[key] == versions[got["model"]], (where, got[key])
            else:
                same(got[key], value, versions, f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(got, list), (where, got)
        assert len(got) == len(shown), (where, got, shown)
        for index, (a, b) in enumerate(zip(got, shown, strict=True)):
            same(a, b, versions, f"{where}[{index}]")
    elif isinstance(shown, float):
        assert abs(got - shown) <= TOLERANCE, (where, got, shown)
    else:
        assert got == shown, (where, got, shown)


@asynccontextmanager
async def served(argv: list[str]) -> AsyncIterator[int]:
    """``VAR=value ... batchserve serve``: a server configured by those variables, in this
    process on a free port, once every model is ready."""
    variables = dict(word.split("=", 1) for word in argv if "=" in word)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in variables.items():
            patch.setenv(name, value)
        settings = load_settings()
    config = uvicorn_config(create_app(settings), settings)
    config.host, config.port = "127.0.0.1", 0
    async with uvicorn_port(config) as port, httpx.AsyncClient() as client:
        for _ in range(1200):  # models load and warm up; the machine may be shared
            if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the server was not ready within 120 s")
        yield port


async def test_the_hugging_face_examples_answer_as_the_page_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for task in TEXT_TASKS:
        save_text_model(tmp_path / task, task)
    save_image_model(tmp_path / "image-classification")
    save_sentence_transformer(
        tmp_path / "sentence-transformer",
        tmp_path / "feature-extraction",
        pooling="cls",
        then=("dense", "normalize"),
        prompts={"query": "query: ", "passage": "passage: "},
    )
    save_cross_encoder(tmp_path / "cross-encoder", tmp_path / "feature-extraction")
    pixels = (np.random.default_rng(7).random((40, 50, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.png")
    monkeypatch.chdir(tmp_path)
    repository = str(tmp_path / "repository")
    marked = [block for run, block in shell_blocks(PAGE.read_text()) if run]
    assert len(marked) >= 5, "the page's Hugging Face examples are marked to be run"
    versions: dict[str, str] = {}
    answered = 0
    async with AsyncExitStack() as serving:
        port = None
        for step in (step for block in marked for step in steps(block)):
            command = step.command.replace(REPOSITORY, repository)
            argv = words(command)
            if argv[0] == "batchserve":
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    assert main(argv[1:]) == 0, command
                versions[argv[argv.index("--name") + 1]] = printed.getvalue().strip()
            elif "serve" in argv:
                port = await serving.enter_async_context(served(argv))
            else:
                assert port is not None, "a curl before the server is started"
                process = await asyncio.create_subprocess_exec(
                    "bash",
                    "-c",
                    command.replace(ADDRESS, f"127.0.0.1:{port}"),
                    stdout=asyncio.subprocess.PIPE,
                )
                output, _ = await process.communicate()
                assert process.returncode == 0, command
                same(json.loads(output), json.loads("".join(step.shown)), versions)
                answered += 1
    assert answered == 6
