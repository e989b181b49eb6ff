"""The parts of a one-process app (``server.single.create_app``) that tests look inside."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from service.engine.engine import Engine
from service.engine.runner import TorchRunner
from service.frontend.state import FrontendState


def frontend_of(app: FastAPI) -> FrontendState:
    state: FrontendState = app.state.frontend
    return state


def engine_of(app: FastAPI) -> Engine:
    engine: Engine = app.state.engine
    return engine


def runner_of(app: FastAPI) -> TorchRunner:
    served = engine_of(app).served
    assert served is not None, "no model is served"
    return served.runner


def registry_of(app: FastAPI) -> CollectorRegistry:
    return frontend_of(app).registry
