"""The webhook's serving certificate is renewed from the mesh CA at half its lifetime; a failed
renewal is retried with a doubling wait (the pure schedule here). The control plane's renewal
and its retries run against the real kube-apiserver 1.20.2:
tests/kube_real/test_webhook_renewal.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from attestmesh.kube_mode import renewal_wait


def test_renewal_wait_doubles_from_the_first_retry_up_to_the_cap_and_resets() -> None:
    renew = timedelta(hours=12)
    first, cap = timedelta(seconds=10), timedelta(minutes=10)
    waits = [renewal_wait(n, renew, first, cap) for n in range(9)]
    assert waits[0] == renew  # no failure: the next renewal at half the lifetime
    assert waits[1:] == [timedelta(seconds=s) for s in (10, 20, 40, 80, 160, 320, 600, 600)]
    # never later than the regular renewal (a short-lived certificate is retried within it)
    assert renewal_wait(5, timedelta(seconds=30), first, cap) == timedelta(seconds=30)
    with pytest.raises(ValueError, match="failures"):
        renewal_wait(-1, renew, first, cap)
