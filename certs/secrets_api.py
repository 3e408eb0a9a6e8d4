"""Moved: the secret-release service and its mutual-TLS adapter are
``attestmesh.controlplane.secrets`` (above the mesh state they read), the KBS adapter is
``attestmesh.controlplane.kbs``.

A transitional alias for the two importers outside this change (``attestmesh/cli.py`` and
``attestmesh/kube_mode.py`` import ``SecretPolicies`` from here); delete this module, and its
ignore in pyproject.toml's ``root`` contract, once they import it from
``attestmesh.controlplane.secrets``.
"""

from attestmesh.controlplane.secrets import SecretPolicies

__all__ = ["SecretPolicies"]
