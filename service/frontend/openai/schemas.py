"""OpenAI's completion and chat completion requests, as far as batchserve serves them.

A field OpenAI defines that batchserve does not serve is refused (400, naming it) when it is
set to anything but its neutral value, and a field OpenAI does not define is refused too:
a client is never answered as if a setting it sent had been applied. Beside OpenAI's fields,
four of vLLM's extensions: ``top_k``, ``ignore_eos``, ``stop_token_ids`` and
``repetition_penalty``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from service.errors import InvalidParameterError
from service.frontend.generation.sampling import SamplingSettings

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: StrictBool = Field(
        default=False, description="A last chunk with the usage of the whole request."
    )


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    model_config = _STRICT

    model: StrictStr = Field(description="A model served (`GET /v1/models`).")
    temperature: StrictFloat | None = Field(default=None, description="0 to 2; 0 is greedy.")
    top_p: StrictFloat | None = None
    n: StrictInt = Field(default=1, description="Choices to generate (1 to 16).")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None, description="Up to 16 strings; the text ends before the first that shows."
    )
    seed: StrictInt | None = Field(
        default=None, description="Sampling with a seed is reproducible (choice i: seed + i)."
    )
    user: StrictStr | None = Field(default=None, description="Accepted and ignored.")
    frequency_penalty: StrictFloat | None = Field(
        default=None,
        description="-2 to 2: a token's logit less this for each time the choice generated it.",
    )
    presence_penalty: StrictFloat | None = Field(
        default=None,
        description="-2 to 2: a token's logit less this once the choice generated it.",
    )
    logit_bias: dict[str, StrictFloat] | None = Field(default=None, description="Empty only.")
    top_k: StrictInt | None = Field(default=None, description="vLLM's extension.")
    ignore_eos: StrictBool = Field(default=False, description="vLLM's extension.")
    stop_token_ids: list[StrictInt] | None = Field(default=None, description="vLLM's extension.")
    repetition_penalty: StrictFloat | None = Field(
        default=None,
        description="vLLM's extension: above 0; a positive logit of a token of the prompt or "
        "the choice divided by it, a negative one multiplied. Unset: the model's "
        "generation_config.json's, else 1 (none).",
    )

    def check_unsupported(self) -> None:
        """400 for a setting batchserve cannot apply."""
        if self.logit_bias:
            raise InvalidParameterError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError(
                "stream_options", "stream_options is only allowed with stream: true"
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingSettings:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingSettings(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k == -1 else self.top_k,  # -1: vLLM's "no top-k"
            seed=self.seed,
            n=self.n,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )


Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(
        description="A text, texts, token ids, or lists of token ids (one completion each)."
    )
    max_tokens: StrictInt | None = Field(
        default=16,
        description="New tokens at most (OpenAI's default: 16); null: as many "
        "as the model's context leaves.",
    )
    logprobs: StrictInt | None = Field(
        default=None, description="The log-probability of each token, and the top k beside it."
    )
    echo: StrictBool = Field(default=False, description="The prompt's text before the completion.")
    best_of: StrictInt | None = Field(default=None, description="Equal to n (or left out) only.")
    suffix: StrictStr | None = Field(default=None, description="Not supported (null only).")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", "best_of is not supported; leave it out")
        if self.suffix:
            raise InvalidParameterError("suffix", "suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise InvalidParameterError(
                "echo", "echo with logprobs is not supported: the prompt's are not computed"
            )


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="`developer` is given to the chat template as `system`."
    )
    content: StrictStr | list[TextPart] = Field(description="Text, or text parts (joined).")
    name: StrictStr | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: its text whole."""
        content = self.content
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text"] = Field(description="Only text; JSON modes are not supported.")


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, description="Deprecated by OpenAI.")
    max_completion_tokens: StrictInt | None = Field(
        default=None, description="New tokens at most; null: as many as the context leaves."
    )
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, description="0 to 20, with logprobs.")
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, description="Empty only.")
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: StrictBool | None = Field(default=None, description="Ignored.")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise InvalidParameterError("tools", "tools (function calling) are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidParameterError(
                "max_tokens", "send max_completion_tokens or max_tokens, not both"
            )
