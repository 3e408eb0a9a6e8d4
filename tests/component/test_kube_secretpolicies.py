"""The cross-policy rule for SecretPolicy resources (one secret, one policy) applied by
SecretPolicies (pure). The resources themselves (watched only when secret release is on, each
parsed on its own, handed over whole) and secret release end to end run against a real
kube-apiserver 1.20.2: tests/kube_real/test_secret_policies.py."""

from __future__ import annotations

from typing import Any

from attestmesh.controlplane.secrets import SecretPolicies
from xds.secretpolicy import parse_secret_policies


def secret_cr(name: str, secret: str = "db", ns: str = "shop", **rule: Any) -> dict[str, Any]:  # noqa: S107
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "SecretPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "secrets": [{"name": secret, "kv": {"mount": "secret", "path": f"shop/{secret}"}}],
            "rules": [{"from": [{"serviceAccount": "web"}], "secrets": [secret], **rule}],
        },
    }


def test_one_secret_one_policy_across_resources() -> None:
    (a,) = parse_secret_policies([secret_cr("a")])
    (b,) = parse_secret_policies([secret_cr("b")])  # the same secret shop/db again
    (c,) = parse_secret_policies([secret_cr("c", secret="cache")])
    holder = SecretPolicies()
    kept = holder.set_policies([c, b, a])
    assert [p.name for p in kept] == ["a", "c"] and holder.current == kept
