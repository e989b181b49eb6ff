"""Which outputs follow an input's length, found by running the model at several lengths.

``batchserve package`` records ``length_of`` on each output whose variable axis is as long as
the model's variable input at every length tried (a tagger's tags, per-token logits), so
``--output tags:int64:-1,-1`` answers each instance at its own length without a key its
author must know. An output given a ``length_of`` keeps it; one whose length differs at any
length tried (a summary of fixed size, a sequence of its own length) gets none.
"""

from __future__ import annotations

import torch

from service.engine.outputs import named_outputs, run_on_examples
from service.manifest import Manifest

#: Lengths of the variable axis the model is run at (capped at the input's ``max_length``).
PROBE_LENGTHS = (3, 5, 8)


def tie_lengths(module: torch.nn.Module, manifest: Manifest) -> Manifest:
    """``manifest`` with ``length_of`` set on each output that follows its variable input's
    length (a new version id), or as it is when none does. A model that fails at a length
    tried ties nothing: the packaging check that follows says why it fails."""
    variable = manifest.variable_input
    untied = [
        spec
        for spec in manifest.outputs
        if spec.variable_axis is not None and spec.length_of is None
    ]
    if variable is None or not untied:
        return manifest
    limit = variable.max_length or max(PROBE_LENGTHS)
    lengths = sorted({min(length, limit) for length in PROBE_LENGTHS})
    if len(lengths) < 2:  # one length cannot tell a tie from a coincidence
        return manifest
    following = {
        spec.name: spec.variable_axis + 1 for spec in untied if spec.variable_axis is not None
    }
    for length in lengths:
        shapes = _output_shapes(module, manifest, length)
        if shapes is None:
            return manifest
        following = {
            name: axis
            for name, axis in following.items()
            if len(shapes[name]) > axis and shapes[name][axis] == length
        }
    if not following:
        return manifest
    outputs = tuple(
        spec.model_copy(update={"length_of": variable.name}) if spec.name in following else spec
        for spec in manifest.outputs
    )
    return Manifest.create(**manifest.model_dump(exclude={"version", "outputs"}), outputs=outputs)


def _output_shapes(
    module: torch.nn.Module, manifest: Manifest, length: int
) -> dict[str, tuple[int, ...]] | None:
    """Each output's shape for 2 example rows ``length`` long; None when the model fails."""
    try:
        outputs = named_outputs(
            run_on_examples(module, manifest, 2, length, length), manifest.outputs
        )
    except Exception:  # check_forward, run next, reports the failure
        return None
    return {name: tuple(tensor.shape) for name, tensor in outputs.items()}
