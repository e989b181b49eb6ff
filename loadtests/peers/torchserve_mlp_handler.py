"""TorchServe handler for the PEERS.md MLP, archived by ``loadtests/torchserve_peer.py``.

It runs inside TorchServe's Python worker (TorchServe's own virtualenv, not this project's),
so it imports only ``ts``, ``torch`` and the standard library. The model and its weights are
loaded by ``BaseHandler`` from the archive (``peer_mlp.py`` and a state dict); this handler
only turns TorchServe's batch of requests, each ``{"instances": [[256 floats], ...]}``, into
one tensor and splits the logits back per request, answered as batchserve answers
(``{"predictions": [[10 floats], ...]}``), so both servers do the same work per request.
"""

import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class PeerMLPHandler(BaseHandler):
    """One forward per TorchServe batch (up to ``batchSize`` requests)."""

    def __init__(self):
        super().__init__()
        self.rows_per_request = []

    def preprocess(self, data):
        instances = []
        self.rows_per_request = []
        for request in data:
            body = request.get("body") or request.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            rows = body["instances"]
            self.rows_per_request.append(len(rows))
            instances.extend(rows)
        return torch.tensor(instances, dtype=torch.float32)

    def postprocess(self, data):
        answers = []
        for part in torch.split(data, self.rows_per_request):
            answers.append({"predictions": part.tolist()})
        return answers
