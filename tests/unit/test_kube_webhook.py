"""xds.kube.webhook: the JSON patch that puts the CA bundle into every webhook that lacks it,
the re-issue schedule of a serving certificate, and a rotator that survives failed re-issues."""

from __future__ import annotations

import asyncio
import base64
from datetime import timedelta

import pytest

from xds.kube.webhook import ServingCertRotator, ca_bundle_ops, renewal_wait

PEM = b"-----BEGIN CERTIFICATE-----\nMII...\n-----END CERTIFICATE-----\n"
B64 = base64.b64encode(PEM).decode()


def test_webhooks_already_trusting_the_bundle_need_no_patch() -> None:
    config = {"webhooks": [{"name": "a", "clientConfig": {"caBundle": B64, "url": "x"}}]}
    assert ca_bundle_ops(config, PEM) == []
    assert ca_bundle_ops({}, PEM) == []


def test_each_write_is_guarded_by_a_test_of_that_webhooks_name() -> None:
    config = {
        "webhooks": [
            {"name": "ok", "clientConfig": {"caBundle": B64}},
            {"name": "stale", "clientConfig": {"caBundle": "b2xk", "service": {"name": "cp"}}},
            {"name": "bare"},
        ]
    }
    assert ca_bundle_ops(config, PEM) == [
        {"op": "test", "path": "/webhooks/1/name", "value": "stale"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": B64},
        {"op": "test", "path": "/webhooks/2/name", "value": "bare"},
        {"op": "add", "path": "/webhooks/2/clientConfig", "value": {"caBundle": B64}},
    ]


S = timedelta(seconds=1)


def test_renewal_waits_half_the_lifetime_and_backs_off_after_failures() -> None:
    renew = timedelta(hours=12)
    assert renewal_wait(0, renew, 10 * S, 600 * S) == renew
    assert [renewal_wait(n, renew, 10 * S, 600 * S) for n in (1, 2, 3, 7, 8, 40)] == [
        10 * S, 20 * S, 40 * S, 600 * S, 600 * S, 600 * S,
    ]  # fmt: skip
    # never later than a renewal would have been
    assert renewal_wait(3, 30 * S, 10 * S, 600 * S) == 30 * S
    with pytest.raises(ValueError, match="failures must be >= 0"):
        renewal_wait(-1, renew, S, S)


async def test_a_failed_reissue_is_counted_and_retried_and_a_success_resets_the_backoff() -> None:
    outcomes: list[str] = []
    plan = iter([False, False, True, True])  # fail twice, then succeed
    stop = asyncio.Event()

    def reissue() -> None:
        if not next(plan):
            raise OSError("the CA refused (test)")
        if outcomes.count("ok") == 1:
            stop.set()

    def on_result(result: str) -> None:
        outcomes.append(result)

    rotator = ServingCertRotator(
        reissue,
        ttl=timedelta(milliseconds=40),
        retry=(timedelta(milliseconds=5), timedelta(milliseconds=10)),
        on_result=on_result,
    )
    await asyncio.wait_for(rotator.run(stop), 5)
    assert outcomes == ["failed", "failed", "ok", "ok"]
    assert rotator.failures == 0


async def test_the_rotator_returns_when_stopped_without_reissuing() -> None:
    calls: list[int] = []
    stop = asyncio.Event()
    stop.set()
    rotator = ServingCertRotator(lambda: calls.append(1), ttl=timedelta(hours=24), retry=(S, S))
    await asyncio.wait_for(rotator.run(stop), 1)
    assert calls == []
