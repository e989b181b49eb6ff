"""Deployment helpers: the container smoke test and the offline kustomize renderer."""
