"""gunicorn's configuration file for ``batchserve serve --workers N`` (``-c python:...``).

gunicorn reads a configuration module's globals, so this one module reads the settings when it
is imported; nothing but gunicorn imports it. ``batchserve serve --workers N`` has already
validated the settings, exported them as ``BATCHSERVE_*`` variables and emptied
``PROMETHEUS_MULTIPROC_DIR`` before it starts gunicorn. The options and hooks themselves, and
why each is set, are in ``gunicorn_setup.py``.
"""

from __future__ import annotations

from service.config import load_settings
from service.server.gunicorn_setup import gunicorn_options, require_multiprocess_dir

require_multiprocess_dir()
globals().update(gunicorn_options(load_settings()))
