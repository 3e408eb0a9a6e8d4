"""Fixtures for the tests against real Kubernetes servers (``tests/kube_real``).

``cluster`` (one per session): etcd + kube-apiserver 1.20.2 + kube-controller-manager built by
``tools/kube-build`` (built here if missing; a failed build fails the tests loudly with the
command to run), throwaway PKI, loopback ports, audit log of ServiceAccount requests; stopped at
the end of the session. test_scheduling starts its kube-scheduler; test_crd_cel starts an
apiextensions-apiserver 1.36 beside it (delegating to it). Tests that restart the API server
start their own with ``own_cluster``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kube_real.cluster import Cluster, ensure_built
from tests.kube_real.install import Installed, install
from tests.kube_real.plane import Env, make_env
from tests.kube_real.rest import Rest


@pytest.fixture(scope="session")
def kube_bins() -> Path:
    return ensure_built()


@pytest.fixture(scope="session")
def cluster(kube_bins: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("kube"), kube_bins)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def own_cluster(
    kube_bins: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], Cluster]]:
    """Start a private cluster (for tests that restart or stop its API server)."""
    started: list[Cluster] = []

    def start() -> Cluster:
        c = Cluster(tmp_path_factory.mktemp("kube-own"), kube_bins)
        started.append(c)
        c.start()
        return c

    try:
        yield start
    finally:
        for c in started:
            c.stop()


@pytest.fixture(scope="session")
def admin(cluster: Cluster) -> Iterator[Rest]:
    """REST as a cluster admin (client certificate in system:masters)."""
    rest = Rest(cluster.admin)
    yield rest
    rest.close()


@pytest.fixture(scope="session")
def installed(admin: Rest) -> Installed:
    """manifests/ (CRDs, namespace, RBAC, control plane, webhook) applied once per session."""
    return install(admin)


@pytest.fixture(scope="module")
def env(
    cluster: Cluster, admin: Rest, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Env:
    """The manifests' ServiceAccount kubeconfig, sim key and webhook port: one per module."""
    return make_env(cluster, admin, tmp_path_factory.mktemp("env"))
