"""What the processes of one server tell each other: start-up variables and exit statuses.

The supervisor sets the variables for the engines and front ends it starts, and reads the
exit status of each engine to decide what to do next. Shared, so that neither side imports
the other (the supervisor never imports torch).
"""

from __future__ import annotations

#: The folder of one server's run (sockets, heartbeat files, the published version).
RUN_DIR_ENV = "_BATCHSERVE_RUN_DIR"
#: For an engine: its bridge socket, its device, and the file it touches while alive.
ENGINE_SOCKET_ENV = "_BATCHSERVE_ENGINE_SOCKET"
ENGINE_DEVICE_ENV = "_BATCHSERVE_ENGINE_DEVICE"
ENGINE_HEARTBEAT_FILE_ENV = "_BATCHSERVE_ENGINE_HEARTBEAT_FILE"
#: What an engine writes into its heartbeat file once its models are loaded (empty before).
READY_MARK = b"ready"
#: What a standby engine that could not load its models writes there instead: it stays up,
#: reporting its failure to every front end, until the supervisor starts it again.
FAILED_MARK = b"failed"
#: For an engine: the order in which the supervisor started it (0, 1, ...); of the ready
#: engines of a device, the front ends send requests to the one started first.
ENGINE_GENERATION_ENV = "_BATCHSERVE_ENGINE_GENERATION"
#: For an engine: "1" when another engine of its device serves already, so that this one
#: starts as a standby; one that cannot load then stays up, failed, and stops nothing.
ENGINE_STANDBY_ENV = "_BATCHSERVE_ENGINE_STANDBY"
#: For an engine: its place among the server's engines (0, 1, ...), the order of its device.
ENGINE_INDEX_ENV = "_BATCHSERVE_ENGINE_INDEX"
#: For a front end: a JSON list of ``[socket path, device]``, one per engine.
ENGINES_ENV = "_BATCHSERVE_ENGINES"

#: What a spare engine interpreter writes on its ready pipe once its imports are done.
SPARE_READY = b"ready\n"
#: What it writes there once told its engine (a line of variables on its stdin) and beating
#: that engine's heartbeat: the supervisor hands it the engine's place only then.
SPARE_TAKEN = b"taken\n"

#: The model could not be loaded at start-up: restarting would fail the same way.
EXIT_LOAD_FAILED = 3
#: The model hung (a batch outlived ``stall_timeout_s``): restart the process (EX_SOFTWARE).
EXIT_STALLED = 70
