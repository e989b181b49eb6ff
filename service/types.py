"""Type aliases and small value types shared by the front ends, the bridge and the engines."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

#: A batch of instances, or one instance: the unit every room passes around.
Array = npt.NDArray[np.generic]

Priority = Literal["high", "normal"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal")
