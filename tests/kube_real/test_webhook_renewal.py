"""The webhook's serving certificate is renewed from the mesh CA at half its lifetime; a failed
renewal is logged, counted and retried with backoff, and never ends the control plane (the
Kubernetes task group runs beside the API and xDS servers: one task's exception stops them
all). The control plane runs against the real kube-apiserver 1.20.2 (moved here from
tests/component/test_kube_webhook_renewal.py, which ran it against tests/fakekube); the failure
is the mesh CA's, injected into the issuing function."""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

import attestmesh.kube_mode as kube_mode
from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority
from certs.errors import AttestmeshError
from tests.kube_real.plane import SHOP, WEBHOOK, Env, app_pod, control_plane
from tests.kube_real.rest import until

pytestmark = pytest.mark.integration

# renewed every 2 s (a failed renewal is retried within 0.2 s): long enough for the server's
# handshake to meet a certificate that has not expired on a loaded machine
RENEW_TTL = timedelta(seconds=4)
RETRY = (timedelta(seconds=0.05), timedelta(seconds=0.2))


def renewals(metrics: Metrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "attestmesh_serving_cert_renewals_total", {"listener": "webhook", "result": result}
    )
    return value or 0.0


def served_serial(url: str) -> int:
    """The serial of the certificate the webhook presents to a new handshake."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port)), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


async def test_a_failed_webhook_renewal_is_retried_and_the_control_plane_keeps_running(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    issue = kube_mode._issue_webhook_tls
    calls: list[str] = []
    failing = asyncio.Event()

    def flaky(
        ca: CertificateAuthority,
        spiffe_id: str,
        dns_names: Sequence[str],
        now: datetime,
        directory: Path,
        ttl: timedelta = kube_mode.WEBHOOK_CERT_TTL,
    ) -> tuple[Path, Path]:
        if failing.is_set():
            calls.append("failed")
            raise AttestmeshError("the CA refused (test)")
        calls.append("issued")
        return issue(ca, spiffe_id, dns_names, now, directory, ttl)

    monkeypatch.setattr(kube_mode, "_issue_webhook_tls", flaky)
    metrics = Metrics()
    async with control_plane(
        env, tmp_path, metrics=metrics, webhook_cert_ttl=RENEW_TTL, webhook_cert_retry=RETRY
    ) as plane:
        task, mode = plane.task, plane.mode
        assert mode.webhook_url is not None
        failing.set()
        await until(lambda: calls.count("failed") >= 1 or None, timeout=10, what="a failure")
        before = await asyncio.to_thread(served_serial, mode.webhook_url)
        await until(lambda: calls.count("failed") >= 3 or None, timeout=10, what="3 failures")
        # renewals failed in a row: the control plane and its webhook are still up, serving
        # the certificate they had
        assert not task.done()
        assert renewals(metrics, "failed") == calls.count("failed") >= 3
        assert await asyncio.to_thread(served_serial, mode.webhook_url) == before
        ok = renewals(metrics, "ok")
        failing.clear()
        await until(lambda: renewals(metrics, "ok") > ok or None, timeout=10, what="renewed")
        assert not task.done()
        # the renewed certificate is the one new handshakes get, and the real server still
        # trusts the webhook with it: the caBundle it holds is the mesh CA's
        assert await asyncio.to_thread(served_serial, mode.webhook_url) != before
        hook = await asyncio.to_thread(
            env.admin.get,
            "admissionregistration.k8s.io/v1",
            "MutatingWebhookConfiguration",
            None,
            WEBHOOK,
        )
        bundle = base64.b64decode(hook["webhooks"][0]["clientConfig"]["caBundle"])
        assert bundle == plane.running.cp.ca.bundle_pem
        # a pod in an injecting namespace makes the server call the webhook (failurePolicy
        # Fail: a handshake it could not verify would be a 500); opted out by annotation, the
        # webhook lets it through unchanged (a dry run: nothing stored)
        sent = app_pod("renewal-0", SHOP, annotations={"attestmesh.dev/inject": "false"})
        status, body = await asyncio.to_thread(
            env.admin.status_of,
            "POST",
            env.admin.path("v1", "Pod", SHOP),
            sent,
            query={"dryRun": "All"},
        )
        assert status == 200, body.get("message")
        assert "initContainers" not in body["spec"]
