"""Built-in architectures of the embedded demo models."""
