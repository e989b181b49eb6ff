"""A ``transformers`` model rebuilt from its ``config.json``, for versions packaged with ``--hf``.

The version's manifest names one of these classes as its architecture, with the folder's
config as ``kwargs``; the model store then loads the version's verified ``model.safetensors``
into it (``load_state_dict`` goes to the wrapped model, so the keys are those
``save_pretrained`` wrote). Nothing is read from the hub or the folder here: what is served is
exactly what was hashed. ``transformers`` is imported only when such a version is built.

The wrappers return plain tensors, so the versions batch, export and serve as any other:
the logits (classification), the one logit of each pair (a reranker), the mean of the last
hidden states over the real tokens (feature extraction), or a ``sentence-transformers``
folder's embedding (``SentenceTransformersModel``: its pooling, dense and normalize steps run
by ``sentence_modules``).
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.sentence_modules import Pooling, SentenceHead

#: Keys of a ``SentenceTransformersModel``'s state dict that belong to its head (its ``Dense``
#: layers' weights, written beside the transformer's by packaging).
HEAD_PREFIX = "head."


def model_class(config: dict[str, Any]) -> type[torch.nn.Module]:
    """The ``transformers`` class ``config.architectures`` names (what saved the folder)."""
    import transformers

    architectures = config.get("architectures") or [None]
    cls = getattr(transformers, str(architectures[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"config.json's architectures[0] must be a transformers model class, got "
            f"{architectures[0]!r} (transformers {transformers.__version__})"
        )
    return cls


def hf_config(config: dict[str, Any]) -> Any:
    """The ``PretrainedConfig`` of a ``config.json`` read as a dict."""
    import transformers

    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"config.json needs a model_type, got {model_type!r}")
    return transformers.AutoConfig.for_model(model_type, **settings)


class _Wrapped(torch.nn.Module):
    """Holds the ``transformers`` model. It is built without weights (on the meta device)
    until ``load_state_dict`` builds it from the state dict ``save_pretrained`` wrote, through
    ``from_pretrained``, so the checkpoint's key names are converted as ``transformers``
    converts them (ViT's saved names differ from its modules' in transformers 5)."""

    def __init__(self, task: str, config: dict[str, Any]) -> None:
        super().__init__()
        self.task = task
        self.config = hf_config(config)
        self.cls: Any = model_class(config)
        with torch.device("meta"):
            self.model: torch.nn.Module = self.cls(self.config)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model, info = self.cls.from_pretrained(
            None, config=self.config, state_dict=dict(state_dict), output_loading_info=True
        )
        problems = {
            key: sorted(info[key])
            for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
            if info.get(key)
        }
        if strict and problems:
            raise ValueError(f"the weights do not fit {self.cls.__name__}: {problems}")
        self.model = model.eval()
        return None


class TransformersTextModel(_Wrapped):
    """Token ids (and the optional mask and type ids) in; logits, each pair's score
    (``text-ranking``: a reranker's one logit) or mean-pooled features out."""

    def __init__(self, task: str, config: dict[str, Any]) -> None:
        super().__init__(task, config)
        self.mean = Pooling(("mean",))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        output = self.model(**inputs, return_dict=True)
        if self.task == "feature-extraction":
            pooled: torch.Tensor = self.mean(output.last_hidden_state, attention_mask)
            return pooled
        logits: torch.Tensor = output.logits
        return logits[:, 0] if self.task == "text-ranking" else logits


class SentenceTransformersModel(_Wrapped):
    """A ``sentence-transformers`` folder: its transformer's last hidden states, then the
    pooling and vector steps its modules list (``steps``, read from the folder when it was
    packaged); one embedding per text out. ``prompt_length`` (tokens, per row) is an input only
    when the pooling leaves the prompt out."""

    def __init__(self, config: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        super().__init__("feature-extraction", config)
        self.head = SentenceHead(steps)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        head = {
            key.removeprefix(HEAD_PREFIX): value
            for key, value in state_dict.items()
            if key.startswith(HEAD_PREFIX)
        }
        self.head.load_state_dict(head, strict=strict)
        rest = {key: value for key, value in state_dict.items() if not key.startswith(HEAD_PREFIX)}
        return super().load_state_dict(rest, strict=strict, assign=assign)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        prompt_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        hidden: torch.Tensor = self.model(**inputs, return_dict=True).last_hidden_state
        embedding: torch.Tensor = self.head(hidden, attention_mask, prompt_length)
        return embedding


class TransformersImageModel(_Wrapped):
    """Pixel values (``(batch, channels, height, width)``, normalised) in; logits out."""

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(pixel_values=pixel_values, return_dict=True).logits
        return logits


class TransformersCausalLM(_Wrapped):
    """A causal language model. The engine generates from ``language_model`` (its continuous
    batch, ``engine/generation``); as a tensor model it answers each prompt's next-token
    logits: the model's output embeddings over its base model's hidden state at the prompt's
    last real token, which a load checks equals the model's own logits (a model that scales
    its logits beyond its head is refused rather than answered differently)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__("text-generation", config)

    @property
    def language_model(self) -> Any:
        """The ``transformers`` model itself, which the continuous batch steps."""
        return self.model

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        super().load_state_dict(state_dict, strict=strict, assign=assign)
        probe = torch.tensor([[1, 2, 3]])
        with torch.inference_mode():
            whole = self.model(input_ids=probe).logits[:, -1].float()
            ours = self(probe)
        if not torch.allclose(whole, ours, rtol=1e-4, atol=1e-4):
            raise ValueError(
                f"{self.cls.__name__} computes its logits beyond its output embeddings "
                "(a scale or a cap), which the next-token path does not; it is not served"
            )
        return None

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        model: Any = self.model
        hidden = model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True
        ).last_hidden_state
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        logits: torch.Tensor = model.get_output_embeddings()(hidden[rows, last])
        return logits.float()


class TransformersSeq2SeqLM(_Wrapped):
    """An encoder-decoder (T5, BART). The engine generates from ``language_model`` in cohorts
    (``engine/generation/cohorts.py``); as a tensor model it answers each prompt's first
    decoded token's logits (the decoder fed its start token alone)."""

    def __init__(self, config: dict[str, Any], decoder_start_token_id: int) -> None:
        super().__init__("text2text-generation", config)
        self.decoder_start_token_id = decoder_start_token_id

    @property
    def language_model(self) -> Any:
        """The ``transformers`` model itself, which the cohorts step."""
        return self.model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        start = torch.full(
            (input_ids.shape[0], 1),
            self.decoder_start_token_id,
            dtype=input_ids.dtype,
            device=input_ids.device,
        )
        model: Any = self.model
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=start,
            use_cache=False,
            return_dict=True,
        )
        logits: torch.Tensor = output.logits[:, -1]
        return logits.float()
