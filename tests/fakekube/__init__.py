"""A protocol-faithful fake Kubernetes API server for tests (see server.py)."""

from __future__ import annotations

from tests.fakekube.server import FakeKube, ResourceType

__all__ = ["FakeKube", "ResourceType"]
