"""The injection webhook's Kubernetes side: its CA bundle in the MutatingWebhookConfiguration,
and the rotation of a serving certificate issued from the mesh CA.

``ca_bundle_ops`` and ``renewal_wait`` are pure; ``WebhookConfiguration`` patches the API
server; ``ServingCertRotator`` re-issues on a timer through a callback (the composition root
says how a certificate is issued and loaded).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from xds.kube.client import KubeClient, KubeError

log = logging.getLogger(__name__)


def ca_bundle_ops(configuration: Mapping[str, Any], bundle_pem: bytes) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that sets ``clientConfig.caBundle`` of every webhook of a
    MutatingWebhookConfiguration (as read) to ``bundle_pem``; empty when all hold it already.
    Each write is preceded by a ``test`` of that webhook's name, so a concurrent reordering
    makes the patch fail instead of patching the wrong hook. Pure."""
    bundle = base64.b64encode(bundle_pem).decode()
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(configuration.get("webhooks") or []):
        if not isinstance(hook, Mapping):
            continue
        config = hook.get("clientConfig")
        if isinstance(config, Mapping) and config.get("caBundle") == bundle:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.get("name")})
        if isinstance(config, Mapping):
            ops.append(
                {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
            )
        else:
            ops.append(
                {"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {"caBundle": bundle}}
            )
    return ops


class WebhookConfiguration:
    """The MutatingWebhookConfiguration ``name`` whose webhooks must trust ``bundle`` (the CA
    that issued the webhook's serving certificate; None: a certificate given from outside,
    whose CA bundle the operator installs)."""

    def __init__(self, kube: KubeClient, name: str, bundle: bytes | None = None) -> None:
        self.kube, self.name, self.bundle = kube, name, bundle

    async def write_ca_bundle(self) -> bool:
        """Patch what differs; True when it wrote. A missing configuration is logged."""
        if self.bundle is None:
            return False
        kube = self.kube
        try:
            current = await kube.call(kube.admission.read_mutating_webhook_configuration, self.name)
        except KubeError as exc:
            if exc.status == 404:
                log.warning(
                    "MutatingWebhookConfiguration %s not found: caBundle not set", self.name
                )
                return False
            raise
        ops = ca_bundle_ops(current, self.bundle)
        if not ops:
            return False
        await kube.call(
            kube.admission.patch_mutating_webhook_configuration,
            self.name,
            ops,
            _content_type="application/json-patch+json",
        )
        log.info("wrote caBundle into MutatingWebhookConfiguration %s", self.name)
        return True


def renewal_wait(
    failures: int, renew: timedelta, first_retry: timedelta, max_retry: timedelta
) -> timedelta:
    """How long to wait before the next re-issue of a serving certificate: ``renew`` after a
    success (``failures == 0``); after consecutive failures ``first_retry`` doubling up to
    ``max_retry``, never later than ``renew``."""
    if failures < 0:
        raise ValueError(f"failures must be >= 0, not {failures}")
    if failures == 0:
        return renew
    backoff: timedelta = first_retry * (2 ** min(failures - 1, 32))
    return min(backoff, max_retry, renew)


class ServingCertRotator:
    """Re-issues a serving certificate at half its lifetime (``reissue``: issue and load it, so
    that new handshakes use it). A failed re-issue is logged, counted (``on_result("failed")``)
    and retried with backoff (``renewal_wait``): it must not end the caller's task group, and
    with it the control plane; the current certificate stays valid for the other half."""

    def __init__(
        self,
        reissue: Callable[[], None],
        *,
        ttl: timedelta,
        retry: tuple[timedelta, timedelta],
        on_result: Callable[[str], None] = lambda _: None,
        name: str = "webhook",
    ) -> None:
        self.reissue, self.ttl, self.retry, self.on_result = reissue, ttl, retry, on_result
        self.name = name
        self.failures = 0

    async def run(self, stop: asyncio.Event) -> None:
        renew, (first, cap) = self.ttl / 2, self.retry
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                wait = renewal_wait(self.failures, renew, first, cap)
                await asyncio.wait_for(stop.wait(), wait.total_seconds())
            if stop.is_set():
                return
            try:
                self.reissue()
            except Exception:  # any failure: the listener keeps serving its current certificate
                self.failures += 1
                self.on_result("failed")
                log.exception(
                    "could not renew the %s's serving certificate (%d)", self.name, self.failures
                )
            else:
                self.failures = 0
                self.on_result("ok")


__all__ = ["ServingCertRotator", "WebhookConfiguration", "ca_bundle_ops", "renewal_wait"]
