"""Request and response bodies, for validation where cheap and for the OpenAPI document.

``/predict`` bodies are parsed from raw bytes with orjson for speed (see ``inputs.py``). The two
``Predict`` models describe them only while no model is loaded: ``openapi.py`` then states the
served model's exact shapes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class PredictRequest(BaseModel):
    # Each instance is a number, nested lists of numbers, or an object with one such value per
    # input name; the exact shape is the model's.
    instances: list[float | list[Any] | dict[str, Any]] = Field(
        min_length=1,
        description="One or more instances, each shaped like the model's input without the "
        "batch axis (one value per input name for a model with several inputs).",
    )


class PredictResponse(BaseModel):
    model: str = Field(description="Name of the model that answered.")
    version: str = Field(description="12-hex-character version id of the model that answered.")
    predictions: list[Any] = Field(description="One output row per instance, in request order.")


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable error code, e.g. invalid_input.")
    message: str = Field(description="What was wrong and what is accepted.")
    request_id: str = Field(description="Quote this when reporting a problem.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: str = Field(description="alive, or stalled (one process whose model hung).")
    engine: str = Field(description="The engines' state: ready, loading, stalled, down...")


class ReadinessResponse(BaseModel):
    status: str = Field(description="ready, loading, draining, down, stalled or failed.")
    model: str | None = None
    version: str | None = None


class LoadedModelInfo(BaseModel):
    name: str
    version: str
    device: str
    precision: str
    compiled: bool
    manifest: dict[str, Any]


class EngineInfo(BaseModel):
    device: str
    status: str
    version: str | None
    pid: int | None


class ModelsResponse(BaseModel):
    loaded: LoadedModelInfo | None
    engines: list[EngineInfo] = Field(description="Each engine (one per device), in order.")
    versions: list[dict[str, Any]] = Field(
        description="Every version of the served model in the repository, oldest first."
    )
