"""xds.kube.trustbundle: what the trust-bundle ConfigMap still needs (create, replace with what,
or nothing), and which namespaces need a write queued."""

from __future__ import annotations

import copy
from typing import Any

from xds.kube.names import MANAGED_LABELS, TRUST_CONFIGMAP, TRUST_KEY
from xds.kube.trustbundle import ConfigMapAction, TrustBundles, plan_trust_configmap

PEM = "-----BEGIN CERTIFICATE-----\nMII...\n-----END CERTIFICATE-----\n"


def configmap(data: dict[str, str], labels: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": TRUST_CONFIGMAP,
            "namespace": "shop",
            "resourceVersion": "41",
            "labels": labels,
        },
        "data": data,
        **extra,
    }


def test_an_absent_configmap_is_created_with_the_bundle_and_the_managed_labels() -> None:
    action, body = plan_trust_configmap("shop", None, PEM)
    assert action is ConfigMapAction.CREATE
    assert body == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TRUST_CONFIGMAP, "namespace": "shop", "labels": dict(MANAGED_LABELS)},
        "data": {TRUST_KEY: PEM},
    }


def test_a_configmap_holding_the_bundle_and_labels_is_left_alone() -> None:
    current = configmap({TRUST_KEY: PEM}, {**MANAGED_LABELS, "team": "a"})
    assert plan_trust_configmap("shop", current, PEM) == (ConfigMapAction.UNCHANGED, None)


def test_a_stale_bundle_is_replaced_keeping_other_keys_labels_and_the_resource_version() -> None:
    current = configmap(
        {TRUST_KEY: "old", "extra.pem": "kept"},
        {"team": "a"},
        binaryData={TRUST_KEY: "b2xk", "blob": "YQ=="},
    )
    before = copy.deepcopy(current)
    action, body = plan_trust_configmap("shop", current, PEM)
    assert action is ConfigMapAction.REPLACE
    assert body is not None
    assert body["data"] == {TRUST_KEY: PEM, "extra.pem": "kept"}
    # a key may not be in data and binaryData both
    assert body["binaryData"] == {"blob": "YQ=="}
    assert body["metadata"]["labels"] == {"team": "a", **MANAGED_LABELS}
    # a concurrent writer gets 409: the version read is the one replaced
    assert body["metadata"]["resourceVersion"] == "41"
    assert current == before  # pure: what was read is not modified


def test_missing_labels_alone_are_a_reason_to_replace() -> None:
    action, body = plan_trust_configmap("shop", configmap({TRUST_KEY: PEM}, {}), PEM)
    assert action is ConfigMapAction.REPLACE
    assert body is not None and body["metadata"]["labels"] == dict(MANAGED_LABELS)


def bundles(bundle: bytes = PEM.encode()) -> TrustBundles:
    # kube is never called by need/forget: a client object is not needed for these decisions
    return TrustBundles(None, lambda: bundle, own_namespace="attestmesh-system")  # type: ignore[arg-type]


def test_a_namespace_needing_the_bundle_is_queued_once_and_only_by_a_writer() -> None:
    t = bundles()
    assert t.need("attestmesh-system", can_write=True) is False  # never injected
    assert "attestmesh-system" not in t.namespaces
    assert t.need("shop", can_write=False) is False  # a follower: the leader's re-apply covers it
    assert t.namespaces == {"shop"}
    assert t.need("shop", can_write=True) is True
    assert t.need("shop", can_write=True) is False  # already queued
    t.written["billing"] = PEM.encode()
    assert t.need("billing", can_write=True) is False  # this replica wrote this bundle there
    t.forget("billing")
    assert "billing" not in t.namespaces and "billing" not in t.written


def test_a_changed_bundle_makes_a_written_namespace_need_a_write_again() -> None:
    current = [b"old"]
    t = TrustBundles(None, lambda: current[0], own_namespace="x")  # type: ignore[arg-type]
    t.written["shop"] = b"old"
    assert t.need("shop", can_write=True) is False
    current[0] = b"new"
    assert t.need("shop", can_write=True) is True
