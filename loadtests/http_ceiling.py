"""The HTTP ceiling: batchserve's own front end answering ``/predict`` without running a model.

It lives in ``service.server.tuning.ceiling`` (``batchserve tune`` measures it too); this
module keeps the harness's name for it.

    BATCHSERVE_MODEL_NAME=digits python -m loadtests.http_ceiling --port 8098
    BATCHSERVE_WORKERS=2 python -m loadtests.http_ceiling --port 8098
"""

from __future__ import annotations

import sys

from service.server.tuning.ceiling import (
    APP_FACTORY,
    ZeroEngine,
    create_app_from_environment,
    create_ceiling_app,
    main,
    model_info,
)

__all__ = [
    "APP_FACTORY",
    "ZeroEngine",
    "create_app_from_environment",
    "create_ceiling_app",
    "main",
    "model_info",
]

if __name__ == "__main__":
    sys.exit(main())
