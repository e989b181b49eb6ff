"""Offline tooling: packaging a model as a version (``package``, ``spec``), writing and
repairing version folders (``writing``), and exporting a version to another format
(``export``). The CLI and tests use it; a serving process never imports it."""
