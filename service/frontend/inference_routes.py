"""The inference routes, in one table: ``routes.py`` and ``oip/routes.py`` register each row
with the app's router (which answers them and describes them in the OpenAPI document), and the
request metrics and traces label requests by it. A new inference path is a new row here and
its registration beside the others of its protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Protocol = Literal["predict", "v2", "v2_generate", "openai", "openai_generation", "tei"]
"""What answers a route: ``/predict``'s code (``predict.py``), the V2 protocol's
(``oip/rest.py``), its generate extension's (``oip/generate.py``), OpenAI's embeddings
(``openai/embeddings.py``), OpenAI's completions and chat completions (``openai/``) or TEI's
(``tei.py``)."""

PREDICT_PATH = "/predict"
MODEL_PREDICT_PATH = "/models/{name}/predict"
MODEL_VERSION_PREDICT_PATH = "/models/{name}/versions/{version}/predict"
V2_INFER_PATH = "/v2/models/{name}/infer"
V2_VERSION_INFER_PATH = "/v2/models/{name}/versions/{version}/infer"
OPENAI_EMBEDDINGS_PATH = "/v1/embeddings"
TEI_EMBED_PATH = "/embed"
TEI_RERANK_PATH = "/rerank"
MODEL_EMBED_PATH = "/models/{name}/embed"
MODEL_RERANK_PATH = "/models/{name}/rerank"
V2_GENERATE_PATH = "/v2/models/{name}/generate"
V2_VERSION_GENERATE_PATH = "/v2/models/{name}/versions/{version}/generate"
V2_GENERATE_STREAM_PATH = "/v2/models/{name}/generate_stream"
V2_VERSION_GENERATE_STREAM_PATH = "/v2/models/{name}/versions/{version}/generate_stream"
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class InferenceRoute:
    path: str
    """The path as the router and OpenAPI write it; ``{name}`` and ``{version}`` are path
    segments."""
    protocol: Protocol
    label: str
    """The route in the request metrics and the server span's name (a version named in the
    path is counted with its model's route)."""
    summary: str
    """The OpenAPI operation's summary."""

    @property
    def names_model(self) -> bool:
        return "{name}" in self.path


INFERENCE_ROUTES: tuple[InferenceRoute, ...] = (
    InferenceRoute(PREDICT_PATH, "predict", PREDICT_PATH, "Predict one or more instances"),
    InferenceRoute(
        MODEL_VERSION_PREDICT_PATH,
        "predict",
        MODEL_PREDICT_PATH,
        "Predict with a model's version",
    ),
    InferenceRoute(MODEL_PREDICT_PATH, "predict", MODEL_PREDICT_PATH, "Predict with a model"),
    InferenceRoute(V2_VERSION_INFER_PATH, "v2", V2_INFER_PATH, "Inference on a version"),
    InferenceRoute(V2_INFER_PATH, "v2", V2_INFER_PATH, "Inference"),
    InferenceRoute(
        OPENAI_EMBEDDINGS_PATH, "openai", OPENAI_EMBEDDINGS_PATH, "Embeddings (OpenAI's API)"
    ),
    InferenceRoute(TEI_EMBED_PATH, "tei", TEI_EMBED_PATH, "Embed (TEI's API)"),
    InferenceRoute(TEI_RERANK_PATH, "tei", TEI_RERANK_PATH, "Rerank (TEI's API)"),
    InferenceRoute(MODEL_EMBED_PATH, "tei", MODEL_EMBED_PATH, "Embed with a model (TEI's API)"),
    InferenceRoute(MODEL_RERANK_PATH, "tei", MODEL_RERANK_PATH, "Rerank with a model (TEI's API)"),
    InferenceRoute(
        V2_VERSION_GENERATE_PATH, "v2_generate", V2_GENERATE_PATH, "Generate with a version"
    ),
    InferenceRoute(V2_GENERATE_PATH, "v2_generate", V2_GENERATE_PATH, "Generate"),
    InferenceRoute(
        V2_VERSION_GENERATE_STREAM_PATH,
        "v2_generate",
        V2_GENERATE_STREAM_PATH,
        "Generate with a version, streamed",
    ),
    InferenceRoute(
        V2_GENERATE_STREAM_PATH, "v2_generate", V2_GENERATE_STREAM_PATH, "Generate, streamed"
    ),
    InferenceRoute(COMPLETIONS_PATH, "openai_generation", COMPLETIONS_PATH, "Completions"),
    InferenceRoute(
        CHAT_COMPLETIONS_PATH, "openai_generation", CHAT_COMPLETIONS_PATH, "Chat completions"
    ),
)
#: The label of each inference route, by its path.
INFERENCE_LABELS = {route.path: route.label for route in INFERENCE_ROUTES}


def of_protocol(protocol: Protocol) -> tuple[InferenceRoute, ...]:
    return tuple(route for route in INFERENCE_ROUTES if route.protocol == protocol)
