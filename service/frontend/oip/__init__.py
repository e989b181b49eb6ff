"""The Open Inference Protocol (KServe V2) over REST and gRPC: tritonclient, the KServe SDK and
V2 clients call batchserve unchanged. Requests become the same named tensors ``/predict``
queues, so V2, gRPC and ``/predict`` traffic share the engine's batches."""
