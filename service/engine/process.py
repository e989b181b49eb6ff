"""An engine process: ``python -m service.engine.process``, started by the supervisor.

Its first step, before anything slow, is to start beating its heartbeat file from a thread
(``starting_heartbeat.py``): importing torch and the engine takes seconds (tens of seconds on
a loaded host), and the supervisor kills a starting engine that stays quiet for
``engine_start_heartbeat_timeout_s``. Only then does it import the engine and serve
(``serving.py``). So this module imports nothing heavy itself; a spare engine interpreter
(``spare.py``) has done those imports already and takes the same path once told its engine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from service.config import SettingsError, load_settings
from service.engine.starting_heartbeat import StartingHeartbeat
from service.processes import ENGINE_HEARTBEAT_FILE_ENV


def main(beating: Callable[[], None] = lambda: None) -> int:
    """Run the engine of this process's variables (``service/processes.py``) until it stops;
    the exit status. ``beating`` is called as soon as its heartbeat beats."""
    try:
        settings = load_settings()
    except SettingsError as error:
        print(error, file=sys.stderr)
        return 2
    heartbeat = os.environ.get(ENGINE_HEARTBEAT_FILE_ENV)
    starting = StartingHeartbeat(
        Path(heartbeat) if heartbeat else None, settings.engine_heartbeat_interval_s
    ).start()
    beating()
    # Imported only now, with the heartbeat beating: torch and the engine take seconds.
    from service.engine.serving import run_engine

    return run_engine(settings, starting)


if __name__ == "__main__":
    sys.exit(main())
