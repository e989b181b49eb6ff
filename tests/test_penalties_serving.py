"""Generation penalties through the routes clients call: OpenAI's ``frequency_penalty`` and
``presence_penalty`` and vLLM's extra ``repetition_penalty`` with the ``openai`` SDK, on
completions (whole and streamed) and chat, and the generate extension's parameters; a
version's own ``repetition_penalty`` is the default; a value out of range is a 400 naming
the field; ``package --hf`` names the settings of a causal LM's generation_config.json that
serving does not apply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.engine.model_store import ModelStore
from service.server.cli import main
from tests import generative_models
from tests.generation_streams import package, served
from tests.generative_models import CHATML_TEMPLATE, CONTEXT, TEXTS, byte_level_bpe, save_folder
from tests.test_generation_penalties import reference

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

#: The repetition_penalty ``lm-rp``'s generation_config.json sets.
OWN_PENALTY = 1.6
PROMPTS = [(" ".join(TEXTS) * 2)[: 6 + 31 * index] for index in range(10)]
#: Each prompt's penalties (as the SDK's arguments), penalised and plain side by side.
PENALTIES: list[dict[str, float]] = [
    {"repetition_penalty": 1.8},
    {},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0, "frequency_penalty": -0.5},
    {"repetition_penalty": 0.6},
    {},
    {"frequency_penalty": 0.9, "repetition_penalty": 1.3},
    {"presence_penalty": -1.0},
    {"repetition_penalty": 1.2},
    {"frequency_penalty": 2.0},
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 with a chat template (``lm``), and again with a repetition_penalty in
    its generation_config.json (``lm-rp``)."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("penalties-served")
    plain = generative_models.gpt2()
    own = generative_models.gpt2()
    own.generation_config.repetition_penalty = OWN_PENALTY
    for name, model in (("lm", plain), ("lm-rp", own)):
        model.save_pretrained(root / name)
        PreTrainedTokenizerFast(
            tokenizer_object=byte_level_bpe(),
            eos_token="<|endoftext|>",
            model_max_length=CONTEXT,
            chat_template=CHATML_TEMPLATE,
        ).save_pretrained(root / name)
        package(root / name, root / "repo", name)
    return root / "repo"


def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe())


def expected_text(model: Any, prompt: str, penalties: dict[str, float]) -> str:
    """The greedy text of ``prompt`` alone with ``penalties`` (``reference``'s tokens)."""
    words = tokenizer()
    ids = tuple(words(prompt)["input_ids"])
    text: str = words.decode(reference(model, ids, MAX_TOKENS, penalties), skip_special_tokens=True)
    return text


def arguments(penalties: dict[str, float]) -> dict[str, Any]:
    """The SDK's keywords: OpenAI's penalties as they are, vLLM's in the extra body."""
    extra = {key: value for key, value in penalties.items() if key == "repetition_penalty"}
    openai_fields = {key: value for key, value in penalties.items() if key not in extra}
    return openai_fields | ({"extra_body": extra} if extra else {})


async def completion(
    client: openai.AsyncOpenAI, prompt: str, penalties: dict[str, float], stream: bool
) -> str:
    fields = arguments(penalties) | {"max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        answer = await client.completions.create(model="lm", prompt=prompt, **fields)
        return answer.choices[0].text
    pieces = []
    async for chunk in await client.completions.create(
        model="lm", prompt=prompt, stream=True, **fields
    ):
        pieces += [choice.text for choice in chunk.choices]
    return "".join(pieces)


async def test_penalties_through_the_openai_sdk_the_generate_extension_and_defaults(
    repository: Path,
) -> None:
    model = generative_models.gpt2()
    messages: Any = [{"role": "user", "content": "Where is Zürich? Where is Paris?"}]
    chat_prompt = tokenizer().apply_chat_template(
        messages, chat_template=CHATML_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    chat_penalties = {"frequency_penalty": 1.2, "presence_penalty": 0.5, "repetition_penalty": 1.4}
    async with (
        served(repository, ("lm", "lm-rp"), kv_cache_mb=32) as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        # Ten concurrent completions, streamed and whole, penalised and plain rows together.
        texts = await asyncio.gather(
            *(
                completion(client, prompt, penalties, stream=bool(index % 2))
                for index, (prompt, penalties) in enumerate(zip(PROMPTS, PENALTIES, strict=True))
            )
        )
        chat = await client.chat.completions.create(
            model="lm",
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            **arguments(chat_penalties),
        )
        parameters = {"max_tokens": MAX_TOKENS, "temperature": 0, "repetition_penalty": 1.8}
        oip = await http.post(
            "/v2/models/lm/generate",
            json={"text_input": PROMPTS[3], "parameters": parameters},
        )
        oip_bad = await http.post(
            "/v2/models/lm/generate",
            json={"text_input": "a", "parameters": parameters | {"presence_penalty": 2.5}},
        )
        own = await client.completions.create(
            model="lm-rp", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0
        )
        overridden = await client.completions.create(
            model="lm-rp",
            prompt=PROMPTS[4],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"repetition_penalty": 1.0},
        )
    changed = 0
    for prompt, penalties, text in zip(PROMPTS, PENALTIES, texts, strict=True):
        wanted = expected_text(model, prompt, penalties)
        assert text == wanted, (prompt, penalties)
        changed += bool(penalties) and wanted != expected_text(model, prompt, {})
    assert changed >= 4  # the penalties changed the greedy texts
    assert chat.choices[0].message.content == expected_text(model, chat_prompt, chat_penalties)
    assert oip.status_code == 200, oip.text
    assert oip.json()["text_output"] == expected_text(
        model, PROMPTS[3], {"repetition_penalty": 1.8}
    )
    assert oip_bad.status_code == 400
    assert "presence_penalty must be between -2.0 and 2.0, got 2.5" in oip_bad.json()["error"]
    with_own = expected_text(model, PROMPTS[4], {"repetition_penalty": OWN_PENALTY})
    assert with_own != expected_text(model, PROMPTS[4], {})
    assert own.choices[0].text == with_own
    assert overridden.choices[0].text == expected_text(model, PROMPTS[4], {})


#: Values out of range, the field named and what the message says.
OUT_OF_RANGE: list[tuple[dict[str, Any], str, str]] = [
    ({"frequency_penalty": 2.5}, "frequency_penalty", "between -2.0 and 2.0, got 2.5"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "between -2.0 and 2.0, got -2.01"),
    ({"presence_penalty": 3.0}, "presence_penalty", "between -2.0 and 2.0, got 3.0"),
    ({"extra_body": {"repetition_penalty": 0.0}}, "repetition_penalty", "above 0"),
    ({"extra_body": {"repetition_penalty": -1.2}}, "repetition_penalty", "above 0"),
]


async def test_penalties_out_of_range_are_400_in_openai_s_shape_naming_the_field(
    repository: Path,
) -> None:
    refusals = []
    async with (
        served(repository, ("lm", "lm-rp"), kv_cache_mb=32) as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        for fields, param, words in OUT_OF_RANGE:
            with pytest.raises(openai.BadRequestError) as completion_refused:
                await client.completions.create(model="lm", prompt="hi", max_tokens=2, **fields)
            with pytest.raises(openai.BadRequestError) as chat_refused:
                await client.chat.completions.create(
                    model="lm", messages=[{"role": "user", "content": "hi"}], **fields
                )
            refusals += [
                (completion_refused.value, param, words),
                (chat_refused.value, param, words),
            ]
    for refused, param, words in refusals:
        assert refused.status_code == 400
        error = json.loads(refused.response.text)["error"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        assert f"{param} must be {words}" in error["message"]


def test_a_causal_lm_s_generate_settings_not_served_are_named_when_packaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = generative_models.gpt2()
    model.generation_config.no_repeat_ngram_size = 3
    model.generation_config.repetition_penalty = 1.2
    folder = save_folder(tmp_path / "lm", model)
    settings = json.loads((folder / "generation_config.json").read_text())
    settings["typical_p"] = 0.9
    (folder / "generation_config.json").write_text(json.dumps(settings))
    capsys.readouterr()
    assert main(["package", "--repository", str(tmp_path / "r"), "--name", "x", "--hf",
                 str(folder)]) == 0  # fmt: skip
    error = capsys.readouterr().err
    assert "generates without generation_config.json's no_repeat_ngram_size=3, typical_p=0.9" in (
        error
    )
    assert "repetition_penalty" not in error  # applied, as every request's default
    manifest = ModelStore(tmp_path / "r").resolve("x")
    assert manifest.metadata["generation_defaults"]["repetition_penalty"] == 1.2

    settings["repetition_penalty"] = 0
    (folder / "generation_config.json").write_text(json.dumps(settings))
    assert main(["package", "--repository", str(tmp_path / "r"), "--name", "y", "--hf",
                 str(folder)]) == 1  # fmt: skip
    assert "repetition_penalty must be a number above 0 (1 for none), got 0" in (
        capsys.readouterr().err
    )
