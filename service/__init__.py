"""batchserve: serve PyTorch models over HTTP with dynamic batching."""
