"""The V2 gRPC API: its .proto and the Python code generated from it."""
