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


class EngineReadiness(BaseModel):
    device: str
    status: str = Field(description="The engine's phase, as for the server's status.")
    role: str | None = Field(
        description="active (takes the requests), standby (ready to take over) or null."
    )
    detail: str | None = Field(description="Why the engine failed or is down.")


class ReadinessResponse(BaseModel):
    status: str = Field(description="ready, loading, draining, down, stalled or failed.")
    model: str | None = Field(default=None, description="The model /predict answers with.")
    version: str | None = None
    models: list[str] = Field(
        default_factory=list, description="Every model served, as name@version."
    )
    engines: list[EngineReadiness] = Field(
        default_factory=list,
        description="Each engine process, standbys included: a standby that failed to load "
        "says why here (status failed), and never takes over.",
    )


class LoadedModelInfo(BaseModel):
    name: str
    version: str
    device: str
    precision: str
    compiled: bool
    memory_bytes: int = Field(
        description="What loading and warming it up took on the device: CUDA memory "
        "allocated, or the engine's resident-memory growth on the CPU."
    )
    manifest: dict[str, Any]
    weight: int = Field(
        description="Its share of its model's requests, percent (100 unless a traffic split "
        "serves the model over several versions)."
    )


class EngineInfo(BaseModel):
    device: str
    status: str
    version: str | None = Field(description="The version of the first model.")
    models: list[str] = Field(description="Every model the engine serves, as name@version.")
    pid: int | None
    role: str | None = Field(
        default=None, description="active, standby (ready to take over) or null (not ready)."
    )


class ModelsResponse(BaseModel):
    loaded: LoadedModelInfo | None = Field(description="The model /predict answers with.")
    models: list[LoadedModelInfo] = Field(
        description="Every model served, in load order: its primary version."
    )
    beside: list[LoadedModelInfo] = Field(
        description="The versions loaded beside the primaries (a traffic split), each with its "
        "weight; a request naming one is answered by it."
    )
    engines: list[EngineInfo] = Field(
        description="Each engine (one per device, and its standbys), in order."
    )
    versions: list[dict[str, Any]] = Field(
        description="Every version in the repository of each model served (the first when "
        "none is), oldest first."
    )
