"""Which versions may answer a request prepared for another: the rule of the engine's check.

A front end validates a request against the version it sees served, runs that version's
handler on the body (its tokenizer, its bundled code, its options) and will turn the answer's
rows into JSON the same way. If the version is switched before the request is queued, the
engine may run it on the version now served only when nothing that shaped the request's
tensors, or will shape its answer, differs: the inputs, the outputs, the handler (import path
and options) and every file of the version but the model artifact (``tokenizer.json``, bundled
``.py`` files, label files). Different weights are fine (that is what a switch is for); a
different tokenizer is not, even with identical tensor specs, because the same text becomes
other token ids.
"""

from __future__ import annotations

from service.manifest import HandlerSpec, Manifest, TensorSpec

RequestContract = tuple[
    tuple[TensorSpec, ...],
    tuple[TensorSpec, ...],
    HandlerSpec | None,
    tuple[tuple[str, str], ...],
]
"""Inputs, outputs, handler, and (file name, SHA-256) of every file but the artifact."""


def request_contract(manifest: Manifest) -> RequestContract:
    """What a request prepared for ``manifest``'s version relies on, to compare with another."""
    files = tuple(
        sorted(
            (name, digest) for name, digest in manifest.files.items() if name != manifest.artifact
        )
    )
    return manifest.inputs, manifest.outputs, manifest.handler, files


def interchangeable(prepared_for: RequestContract | None, served: RequestContract) -> bool:
    """Whether a request prepared for one version (None: a version whose contract is not
    known here) is answered exactly as the other would have prepared and answered it: they
    differ at most in the model artifact."""
    return prepared_for is not None and prepared_for == served
