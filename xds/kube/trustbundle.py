"""The mesh trust bundle in every namespace that needs it: the ConfigMap
``attestmesh-trust-bundle`` (key ``root.pem``), written by the leader.

A namespace needs it when it is labelled ``attestmesh.dev/inject=enabled`` or a pod carrying the
injected annotation was seen there (seen before it is registered: an injected pod cannot start
until the ConfigMap exists). It is written when a namespace first needs it and re-checked on
every re-apply (drift, a changed bundle, a deleted ConfigMap); never deleted (public data, and
pods may still mount it).

``plan_trust_configmap`` is the pure decision (create, replace with what, or leave alone);
``TrustBundles`` reads and writes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from typing import Any

from xds.kube.client import KubeClient, KubeError
from xds.kube.names import MANAGED_LABELS, TRUST_CONFIGMAP, TRUST_KEY

log = logging.getLogger(__name__)


class ConfigMapAction(enum.StrEnum):
    CREATE = "create"
    REPLACE = "replace"
    UNCHANGED = "unchanged"


def plan_trust_configmap(
    namespace: str, current: Mapping[str, Any] | None, bundle: str
) -> tuple[ConfigMapAction, dict[str, Any] | None]:
    """What makes the trust-bundle ConfigMap in ``namespace`` (``current``: as read, None when
    absent) hold ``bundle`` under ``root.pem`` and carry the managed-by labels: the body to
    create or to replace it with (``current``'s resourceVersion kept, so a concurrent writer
    gets 409; other keys kept; ``root.pem`` dropped from ``binaryData``, a key may not be in
    both), or nothing. Pure: ``current`` is not modified."""
    if current is None:
        return ConfigMapAction.CREATE, {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": TRUST_CONFIGMAP,
                "namespace": namespace,
                "labels": dict(MANAGED_LABELS),
            },
            "data": {TRUST_KEY: bundle},
        }
    meta = dict(current.get("metadata") or {})
    data = dict(current.get("data") or {})
    have_labels = dict(meta.get("labels") or {})
    if data.get(TRUST_KEY) == bundle and MANAGED_LABELS.items() <= have_labels.items():
        return ConfigMapAction.UNCHANGED, None
    updated = dict(current)
    updated["data"] = {**data, TRUST_KEY: bundle}
    binary = current.get("binaryData")
    if isinstance(binary, Mapping):
        updated["binaryData"] = {k: v for k, v in binary.items() if k != TRUST_KEY}
    meta["labels"] = {**have_labels, **MANAGED_LABELS}
    updated["metadata"] = meta
    return ConfigMapAction.REPLACE, updated


class TrustBundles:
    """The namespaces that need the trust bundle, and the bundle this replica last wrote to
    each. ``bundle()`` is the current mesh root bundle (the one the attestation API serves)."""

    def __init__(
        self, kube: KubeClient, bundle: Callable[[], bytes], *, own_namespace: str
    ) -> None:
        self.kube, self.bundle, self.own_namespace = kube, bundle, own_namespace
        self.namespaces: set[str] = set()
        self.written: dict[str, bytes] = {}
        self._queued: set[str] = set()

    def need(self, namespace: str, *, can_write: bool) -> bool:
        """``namespace`` needs the bundle; True when the caller should queue a write now (this
        replica can write, the namespace does not hold this bundle from this replica yet and
        no write is queued). The control plane's own namespace is never injected: never."""
        if namespace == self.own_namespace:
            return False
        self.namespaces.add(namespace)
        if not can_write:
            return False  # a new leader's re-apply covers every namespace in ``namespaces``
        if self.written.get(namespace) == self.bundle() or namespace in self._queued:
            return False
        self._queued.add(namespace)
        return True

    def forget(self, namespace: str) -> None:
        """The namespace was deleted."""
        self.namespaces.discard(namespace)
        self.written.pop(namespace, None)

    async def write_queued(self, namespace: str, *, can_write: bool) -> None:
        """Perform a write ``need`` asked for (unless this replica lost the Lease or the
        namespace has gone meanwhile)."""
        self._queued.discard(namespace)
        if can_write and namespace in self.namespaces:
            await self.ensure(namespace)

    async def ensure_all(self) -> list[str]:
        """Re-check every namespace (not trusting the cache); the namespaces that failed (one
        does not hold up the others)."""
        failed: list[str] = []
        for namespace in sorted(self.namespaces):
            try:
                await self.ensure(namespace, cached=False)
            except KubeError as exc:
                log.warning("trust bundle in %s: %s", namespace, exc)
                failed.append(namespace)
        return failed

    async def ensure(self, namespace: str, *, cached: bool = True) -> bool:
        """Create or update the ConfigMap in ``namespace`` so that ``root.pem`` is the current
        bundle; True when it wrote. Idempotent: reads first, and an unchanged ConfigMap is not
        written (``cached``: not even read when this replica wrote the same bundle there)."""
        bundle = self.bundle()
        if cached and self.written.get(namespace) == bundle:
            return False
        kube = self.kube
        for _ in range(2):  # a create that lost a race is followed by one read-and-update
            try:
                current = await kube.call(
                    kube.core.read_namespaced_config_map, TRUST_CONFIGMAP, namespace
                )
            except KubeError as exc:
                if exc.status != 404:
                    raise
                current = None
            action, body = plan_trust_configmap(namespace, current, bundle.decode())
            if action is ConfigMapAction.UNCHANGED:
                self.written[namespace] = bundle
                return False
            if action is ConfigMapAction.CREATE:
                try:
                    await kube.call(kube.core.create_namespaced_config_map, namespace, body)
                except KubeError as exc:
                    if exc.status == 409:
                        continue
                    raise
                log.info("created ConfigMap %s/%s (mesh trust bundle)", namespace, TRUST_CONFIGMAP)
            else:
                await kube.call(
                    kube.core.replace_namespaced_config_map, TRUST_CONFIGMAP, namespace, body
                )
                log.info("updated ConfigMap %s/%s (mesh trust bundle)", namespace, TRUST_CONFIGMAP)
            self.written[namespace] = bundle
            return True
        raise KubeError("conflict", f"ConfigMap {namespace}/{TRUST_CONFIGMAP} keeps changing", 409)


__all__ = ["ConfigMapAction", "TrustBundles", "plan_trust_configmap"]
